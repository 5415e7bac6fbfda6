"""The prompt at the attention: each layer's attention reads the prompt's keys/values from a forward keyword.

While an adapter is attached, the model's `config._attn_implementation` names one of our registered functions
(`softprompt_plus_sdpa`, `softprompt_plus_eager`, or `softprompt_plus_fa2`/`fa3` for a model loaded with flash
attention, which keeps flash: flash.py). Given a `PromptKV` under the keyword `KWARG`, it either records
the layer's keys/values (the prompt pass) or puts the prompt's in front of the text's (the text pass and every
`generate` step). Without the keyword it is the plain kernel, so the base model and a concatenation run through it
unchanged. The keyword travels with the layer's other arguments, so a checkpointed layer's recomputation reads the
same tensors. A context may run another of our kernels for a model (`running`); attention_owner.py alone switches
what the config names.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
from typing import Callable, Optional

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, flash_attention_mask, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from . import flash, kernels
from .prompt_kv import PromptKV

logger = logging.getLogger(__name__)

KWARG = "softprompt_plus_kv"
PREFIX = "softprompt_plus_"


# ---------------------------------------------------------------------------------------------- the kernels


def _family_eager(module: nn.Module) -> Callable:
    """The eager attention of the module's own modeling file (Gemma-2's soft-capping, for one, lives there)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise NotImplementedError(f"{type(module).__name__} has no module-level `eager_attention_forward`.")
    if getattr(module, "reorder_and_upcast_attn", False) and hasattr(module, "_upcast_and_reordered_attn"):
        # GPT-2's float32 upcast variant, which it only takes under the name "eager".
        return lambda mod, q, k, v, mask, **kwargs: mod._upcast_and_reordered_attn(q, k, v, mask)
    return fn


def _recorded(prompt_kv: PromptKV, module: nn.Module) -> tuple:
    if module not in prompt_kv.layers:
        raise RuntimeError(
            f"{type(module).__name__} attends to text but recorded no prompt keys/values in the prompt pass; the "
            "model's layers don't all route attention alike. Use `forward_path='concat'` for this model."
        )
    return prompt_kv.layers[module]  # [A, Hkv, N, hd] each


def _prepended(prompt: tuple, prompt_kv: PromptKV, key: torch.Tensor, value: torch.Tensor) -> tuple:
    """Each row's prompt keys/values in front of the text's: `[B, Hkv, N+kv, hd]` each (one copy per layer call)."""
    batch = key.shape[0]
    return tuple(
        torch.cat([prompt_kv.for_rows(own, batch).to(text.dtype), text], dim=2)
        for own, text in zip(prompt, (key, value), strict=True)
    )


def _masked_function(kernel_name: str, kernel_of: Callable[[nn.Module], Callable], mask_free: bool) -> Callable:
    """sdpa and eager: the prompt's keys in front of the text's, read under one explicit additive mask per forward;
    `mask_free` (sdpa) also reads them with no mask tensor (the lower-right bias) or split from the text's (decode
    steps)."""

    def attend(module, query, key, value, attention_mask, **kwargs):
        prompt_kv: Optional[PromptKV] = kwargs.pop(KWARG, None)
        kernel = kernel_of(module)
        if prompt_kv is None:
            return kernel(module, query, key, value, attention_mask, **kwargs)
        if prompt_kv.capturing:
            # The first record stands: a checkpointed prompt pass records again when backward recomputes it.
            prompt_kv.layers.setdefault(module, (key, value))  # [A, Hkv, N, hd] each
            return kernel(module, query, key, value, attention_mask, **kwargs)
        prompt_k, prompt_v = _recorded(prompt_kv, module)
        window = kwargs.get("sliding_window") or None
        lower_right = mask_free and kernels.lower_right_fits(prompt_kv, query, key, attention_mask, window, kwargs)
        if not lower_right and mask_free and _decoding(query, kwargs):
            prompt_kv.kernels.add("sdpa_split")
            mask = prompt_kv.mask(attention_mask, query, key, window, additive=False, module=module)
            return kernels.split_attention(
                prompt_kv, query, (prompt_k, prompt_v), (key, value), mask, kwargs.get("scaling")
            )
        text_key = key
        key, value = _prepended((prompt_k, prompt_v), prompt_kv, key, value)
        if lower_right:
            out = kernels.lower_right(query, key, value, kwargs)
            if out is not None:
                prompt_kv.kernels.add("sdpa_lower_right")
                return out
        prompt_kv.kernels.add(f"{kernel_name}_mask")
        mask = prompt_kv.mask(attention_mask, query, text_key, window, additive=True, module=module)
        return kernel(module, query, key, value, mask, **kwargs)

    return attend


def _flash_function(library: str) -> Callable:
    """flash_attention_2/3: the prompt's keys in front of the text's, causal aligned to the lower right (flash.py);
    the mask transformers hands this kernel is the 2-D padding mask, or None."""

    def attend(module, query, key, value, attention_mask, **kwargs):
        prompt_kv: Optional[PromptKV] = kwargs.pop(KWARG, None)
        text_valid = attention_mask.bool() if attention_mask is not None else None  # [B, kv]
        if prompt_kv is None or prompt_kv.capturing:
            if prompt_kv is not None:
                prompt_kv.layers.setdefault(module, (key, value))  # [A, Hkv, N, hd] each
            return flash.attention(library, module, query, key, value, text_valid, kwargs)
        key, value = _prepended(_recorded(prompt_kv, module), prompt_kv, key, value)
        if prompt_kv.rows is None and text_valid is None:  # one prompt, no padding: the dense kernel
            prompt_kv.kernels.add("flash")
            return flash.attention(library, module, query, key, value, None, kwargs)
        prompt_kv.kernels.add("flash_varlen")
        valid, unpadded = prompt_kv.unpadded(text_valid, query, key)
        return flash.attention(library, module, query, key, value, valid, kwargs, unpadded)

    return attend


# Our kernel's name -> (its attention function, the mask builder transformers uses for it)
_KERNELS: dict[str, tuple[Callable, Callable]] = {
    "sdpa": (_masked_function("sdpa", lambda module: sdpa_attention_forward, mask_free=True), sdpa_mask),
    "eager": (_masked_function("eager", _family_eager, mask_free=False), eager_mask),
    **{
        implementation: (_flash_function(library), flash_attention_mask)
        for implementation, library in flash.LIBRARIES.items()
    },
}

# This context's kernel for a model's configs (`id(config)` -> a `_KERNELS` name), where it differs from the one the
# config names: set by `attention_owner.AttentionOwner.running`, so a thread that needs eager's weights never changes
# what another thread calling the same model runs.
_RUNNING: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("softprompt_plus_running", default=None)


def _kernel_of(config, named: str) -> str:
    running = _RUNNING.get()
    return named if running is None else running.get(id(config), named)


def _dispatched(named: str) -> tuple[Callable, Callable]:
    """The function and mask builder registered under our name for `named`: `named`'s, unless this context runs
    another kernel for the model (`_RUNNING`). Both read the same choice, so a kernel always gets its own mask."""

    def attend(module, *args, **kwargs):
        return _KERNELS[_kernel_of(getattr(module, "config", None), named)][0](module, *args, **kwargs)

    def mask(*args, config=None, **kwargs):
        return _KERNELS[_kernel_of(config, named)][1](*args, config=config, **kwargs)

    return attend, mask


@contextlib.contextmanager
def running(configs, kernel_name: str):
    """This context's calls of the layers whose config is one of `configs` run `kernel_name` (a `_KERNELS` name);
    other threads and tasks keep the kernel the config names."""
    if kernel_name not in _KERNELS:
        raise ValueError(f"`kernel_name` must be one of {sorted(_KERNELS)}, got {kernel_name!r}.")
    token = _RUNNING.set({**(_RUNNING.get() or {}), **{id(config): kernel_name for config in configs}})
    try:
        yield
    finally:
        _RUNNING.reset(token)


def _decoding(query: torch.Tensor, kwargs: dict) -> bool:
    """A few queries without autograd (a decode step): concatenating would copy every row's keys/values each step."""
    return query.shape[2] <= 8 and not torch.is_grad_enabled() and not kwargs.get("dropout")


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Our kernels under their names in transformers' public registries: done at the first attach, not at import.
    They stay registered afterwards (the registries have no public removal); only a model whose config names them
    runs them, and `attention_owner` names the model's own kernel again."""
    for kernel_name in _KERNELS:
        function, mask_fn = _dispatched(kernel_name)
        AttentionInterface.register(registered_name(kernel_name), function)
        AttentionMaskInterface.register(registered_name(kernel_name), mask_fn)


def registered_name(kernel_name: str) -> str:
    # transformers treats any implementation named "*flash*" as a kernel it loads itself: ours go by "fa2"/"fa3".
    return PREFIX + kernel_name.replace("flash_attention_", "fa")


def is_installed(config) -> bool:
    """Whether `config` names one of our kernels (an adapter is attached and enabled)."""
    return str(getattr(config, "_attn_implementation", None) or "").startswith(PREFIX)


@functools.lru_cache(maxsize=None)
def log_once(message: str) -> None:
    logger.warning(message)
