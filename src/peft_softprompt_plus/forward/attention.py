"""The prompt at the attention: each layer's attention reads the prompt's keys/values from a forward keyword.

While an adapter is attached, the model's `config._attn_implementation` names one of our registered functions
(`softprompt_plus_sdpa` or `softprompt_plus_eager`). Given a `PromptKV` under the keyword `KWARG`, it either records
the layer's keys/values (the prompt pass) or puts the prompt's in front of the text's (the text pass and every
`generate` step). Without the keyword it is the plain kernel, so a disabled adapter computes the base model.
The keyword travels with the layer's other arguments, so a checkpointed layer's recomputation reads the same tensors.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from . import kernels

logger = logging.getLogger(__name__)

KWARG = "softprompt_plus_kv"
PREFIX = "softprompt_plus_"


@dataclass
class PromptKV:
    """One forward's prompt keys/values for every attention layer, and which rows read which prompt.

    `layers[module]` holds `([A, Hkv, N, hd], [A, Hkv, N, hd])` for A prompts of at most N positions; prompt `a` has
    `lengths[a]` real positions (the rest is padding no query reads). `rows[b]` is the prompt row `b` reads (-1: none);
    None means every row reads prompt 0. `query_offset` is the index of the first query in the text (decode steps);
    `positions` `[B, q]` are the queries' position ids, which count real tokens only (a sliding window measures the
    prompt-to-text distance with them, so left padding never pushes the prompt out of a window).
    """

    lengths: torch.Tensor  # [A]
    rows: Optional[torch.Tensor] = None  # [B]
    capturing: bool = False
    query_offset: int = 0
    layers: dict = field(default_factory=dict)
    positions: Optional[torch.Tensor] = None  # [B, q]
    kernels: set = field(default_factory=set)  # which attention ran, for the record: see `_attention_function`
    _masks: dict = field(default_factory=dict)

    @classmethod
    def stack(cls, single: list["PromptKV"], rows: Optional[torch.Tensor]) -> "PromptKV":
        """One `PromptKV` over several one-prompt ones (right-padded to the longest), read by `rows`."""
        if len(single) == 1:
            return cls(single[0].lengths, rows, layers=single[0].layers)
        width = max(kv.max_length for kv in single)

        def padded(tensors):  # each [1, Hkv, N_a, hd] -> [A, Hkv, N, hd]
            return torch.cat([nn.functional.pad(t, (0, 0, 0, width - t.shape[2])) for t in tensors])

        layers = {
            module: (padded([kv.layers[module][0] for kv in single]), padded([kv.layers[module][1] for kv in single]))
            for module in single[0].layers
        }
        return cls(torch.cat([kv.lengths for kv in single]), rows, layers=layers)

    def row_lengths(self, batch: int, device) -> torch.Tensor:
        """`[B]` prompt positions each row reads (0 for a row without a prompt)."""
        lengths = self.lengths.to(device)
        if self.rows is None:
            return lengths.expand(batch)
        return torch.where(self.rows_mask(batch, device), self.for_rows(lengths, batch), 0)

    def at(self, query_offset: int, positions: Optional[torch.Tensor] = None) -> "PromptKV":
        """The same prompt keys/values for a forward whose first query sits at `query_offset` (a decode step), its
        queries at `positions` `[B, q]`."""
        return PromptKV(self.lengths, self.rows, False, query_offset, self.layers, positions, self.kernels)

    def for_rows(self, tensor: torch.Tensor, batch: int) -> torch.Tensor:
        return gather_rows(tensor, self.rows, batch)

    def mask(self, text_mask, query: torch.Tensor, key: torch.Tensor, window: Optional[int], additive: bool):
        """`[b, 1, q, N+kv]`: the prompt's columns in front of the text's mask, in the kernel's form; once per forward
        for each distinct text mask (layers share it)."""
        cache_key = (id(text_mask) if text_mask is not None else None, query.shape[2], key.shape[2], window, additive)
        if cache_key not in self._masks:
            self._masks[cache_key] = self._build_mask(text_mask, query, key, window, additive)
        return self._masks[cache_key]

    def blocked(self, mask: torch.Tensor) -> torch.Tensor:
        """`~mask` as `[b, 1, 1, q, N+kv]`, for the split form's grouped scores; once per forward."""
        cache_key = ("blocked", id(mask))
        if cache_key not in self._masks:
            self._masks[cache_key] = ~mask[:, :, None]
        return self._masks[cache_key]

    def _build_mask(self, text_mask, query, key, window, additive):
        device, (batch, q, kv), width = query.device, (query.shape[0], query.shape[2], key.shape[2]), self.max_length
        t = torch.arange(q, device=device) + self.query_offset  # [q] each query's index in the text
        if text_mask is None:  # sdpa skipped an all-causal mask: the text part is causal (and windowed)
            s = torch.arange(kv, device=device) + (self.query_offset + q - kv)  # [kv] each text key's index
            allowed = (s[None] <= t[:, None]) & ((t[:, None] - s[None] < window) if window else True)
            text = allowed[None, None]  # [1, 1, q, kv]
        else:
            text = text_mask == 0 if additive else text_mask  # [b, 1, q, kv] True = attend
        lengths = self.lengths.to(device) if self.rows is None else self.row_lengths(batch, device)  # [1] or [B]
        j = torch.arange(width, device=device)  # [N] prompt key index
        prompt = j[None, None, None, :] < lengths[:, None, None, None]  # [b', 1, 1, N]
        if window:
            # Prompt key j is inside a query's window when their distance is < W; a query's position id is its
            # distance from the prompt's start counting real tokens only (as in the row alone). Without position
            # ids, query t sits at index length + t.
            if self.positions is not None:
                distance = self.positions.to(device)[:, None, :, None] - j  # [B, 1, q, N]
            else:
                distance = lengths[:, None, None, None] + t[None, None, :, None] - j  # [b', 1, q, N]
            prompt = prompt & (distance < window)
        rows = max(prompt.shape[0], text.shape[0])
        allowed = torch.cat([prompt.expand(rows, 1, q, width), text.expand(rows, 1, q, kv)], dim=-1)  # [b, 1, q, N+kv]
        if not additive:
            return allowed
        zero = torch.zeros((), dtype=query.dtype, device=device)
        return zero.masked_fill(~allowed, torch.finfo(query.dtype).min)

    def rows_mask(self, batch: int, device) -> torch.Tensor:
        rows = self.rows.to(device)
        return (rows >= 0).repeat_interleave(batch // rows.shape[0])  # [batch]

    @property
    def max_length(self) -> int:
        return next(iter(self.layers.values()))[0].shape[2]


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


# Our name -> (the kernel it calls, whether its mask is additive, the mask builder transformers uses for it)
_KERNELS: dict[str, tuple[Callable[[nn.Module], Callable], bool, Callable]] = {
    "sdpa": (lambda module: sdpa_attention_forward, False, sdpa_mask),
    "eager": (_family_eager, True, eager_mask),
}


def _attention_function(kernel_name: str) -> Callable:
    kernel_of, additive, _ = _KERNELS[kernel_name]

    def attend(module, query, key, value, attention_mask, **kwargs):
        prompt_kv: Optional[PromptKV] = kwargs.pop(KWARG, None)
        kernel = kernel_of(module)
        if prompt_kv is None:
            return kernel(module, query, key, value, attention_mask, **kwargs)
        if prompt_kv.capturing:
            # The first record stands: a checkpointed prompt pass records again when backward recomputes it.
            prompt_kv.layers.setdefault(module, (key, value))  # [A, Hkv, N, hd] each
            return kernel(module, query, key, value, attention_mask, **kwargs)
        if module not in prompt_kv.layers:
            raise RuntimeError(
                f"{type(module).__name__} attends to text but recorded no prompt keys/values in the prompt pass; the "
                "model's layers don't all route attention alike. Use `forward_path='concat'` for this model."
            )
        prompt_k, prompt_v = prompt_kv.layers[module]
        window = kwargs.get("sliding_window") or None
        lower_right = not additive and kernels.lower_right_fits(prompt_kv, query, key, attention_mask, window, kwargs)
        if not lower_right and not additive and _decoding(query, kwargs):
            prompt_kv.kernels.add("sdpa_split")
            mask = prompt_kv.mask(attention_mask, query, key, window, additive)
            return kernels.split_attention(
                prompt_kv, query, (prompt_k, prompt_v), (key, value), mask, kwargs.get("scaling")
            )
        batch, text_key = query.shape[0], key
        key = torch.cat([prompt_kv.for_rows(prompt_k, batch).to(key.dtype), key], dim=2)  # [B, Hkv, N+kv, hd]
        value = torch.cat([prompt_kv.for_rows(prompt_v, batch).to(value.dtype), value], dim=2)
        if lower_right:
            out = kernels.lower_right(query, key, value, kwargs)
            if out is not None:
                prompt_kv.kernels.add("sdpa_lower_right")
                return out
        prompt_kv.kernels.add(f"{kernel_name}_mask")
        mask = prompt_kv.mask(attention_mask, query, text_key, window, additive)
        return kernel(module, query, key, value, mask, **kwargs)

    return attend


def _decoding(query: torch.Tensor, kwargs: dict) -> bool:
    """A few queries without autograd (a decode step): concatenating would copy every row's keys/values each step."""
    return query.shape[2] <= 8 and not torch.is_grad_enabled() and not kwargs.get("dropout")


def gather_rows(values: torch.Tensor, rows: Optional[torch.Tensor], batch: int) -> torch.Tensor:
    """`[A, ...]` -> `[batch, ...]`: row b reads `values[rows[b]]` (-1, a row without a prompt, reads entry 0, which
    callers mask); `batch` may be a multiple of `len(rows)` (beams, `num_return_sequences`). `rows=None`: every row
    reads entry 0, as a view (no copy until the kernel's cat)."""
    if rows is None:
        return values.expand(batch, *values.shape[1:])
    rows = rows.to(values.device).clamp(min=0)
    return values.index_select(0, rows.repeat_interleave(batch // rows.shape[0]))


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Our kernels under their names in transformers' public registries: done at the first attach, not at import.
    They stay registered afterwards (the registries have no public removal); only a model whose config names them
    runs them, and `uninstall` names the model's own kernel again."""
    for kernel_name, (_, _, mask_fn) in _KERNELS.items():
        AttentionInterface.register(PREFIX + kernel_name, _attention_function(kernel_name))
        AttentionMaskInterface.register(PREFIX + kernel_name, mask_fn)


# ---------------------------------------------------------------------------------------------- model switch


def _kernel_for(implementation: Optional[str]) -> str:
    # Eager keeps the family's own eager code (soft-capping, `output_attentions`); every other kernel (flash, flex, a
    # user's own) can't take a prompt that differs per row, so sdpa computes the same attention instead.
    return "eager" if implementation == "eager" else "sdpa"


def is_installed(config) -> bool:
    return str(config._attn_implementation or "").startswith(PREFIX)


def install(model: nn.Module) -> str:
    """Point `model`'s attention at ours; returns the implementation to restore with `uninstall`."""
    register()
    own = model.config._attn_implementation
    kernel = _kernel_for(own)
    if kernel != own:
        log_once(f"The soft prompt enters attention through sdpa; the model's `{own}` comes back on unload().")
    _switch(model, PREFIX + kernel)
    return own


def uninstall(model: nn.Module, own: Optional[str]) -> None:
    if not is_installed(model.config):
        return
    if own is None:  # a config that named no implementation: leave it naming none again
        model.config._attn_implementation = None
    else:
        _switch(model, own)


def _switch(model: nn.Module, implementation: str) -> None:
    # transformers' public switch (it also reaches the sub-configs of composite models); a bare module without it
    # (never a transformers model) gets the config field written.
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:
        model.config._attn_implementation = implementation


@functools.lru_cache(maxsize=None)
def log_once(message: str) -> None:
    logger.warning(message)
