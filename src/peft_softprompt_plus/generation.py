"""`generate()` with a soft prompt: the prompt's keys/values are computed once per adapter, reused across calls
until the prompt changes, and poured into HF's cache at prefill. The result looks exactly like the base model's
`generate`: the input ids followed by the new tokens.

HF generation treats a cache as covering the first tokens of `input_ids`, so N placeholder ids stand in for the
prompt during the call and are stripped from the output.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from . import forward_paths, semantics


class PromptKVStore:
    """Batch-1 prompt keys/values per adapter, keyed on the prompt's version counter so that an optimizer step,
    a load or `set_adapter` invalidates them."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple, list]] = {}

    def get(self, adapter: str, param: torch.Tensor, backbone: nn.Module, prompt: torch.Tensor) -> list:
        key = (param._version, param.data_ptr(), prompt.dtype, prompt.device)
        cached = self._entries.get(adapter)
        if cached is not None and cached[0] == key and not backbone.training:
            return cached[1]
        with torch.no_grad():
            layers = [(k, v) for k, v, *_ in forward_paths.prompt_pass(backbone, prompt).cache]  # each [1, H, N, hd]
        if not backbone.training:  # dropout makes a training-mode prompt KV single-use
            self._entries[adapter] = (key, layers)
        return layers

    def drop(self, adapter: Optional[str] = None) -> None:
        if adapter is None:
            self._entries.clear()
        else:
            self._entries.pop(adapter, None)


def _generation_value(model: nn.Module, kwargs: dict, key: str):
    """A generation setting as `generate` would resolve it: call kwargs, then the passed config, then the model's."""
    if kwargs.get(key) is not None:
        return kwargs[key]
    for gen in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if getattr(gen, key, None) is not None:
            return getattr(gen, key)
    return None


def _placeholder_id(model: nn.Module, kwargs: dict) -> int:
    # Not the pad id: HF drops an all-ones mask and would then warn about pad tokens it sees in `input_ids`.
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = _generation_value(model, kwargs, key)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0


def _shift_total_lengths(model: nn.Module, kwargs: dict, num_prompt: int) -> None:
    """An explicit `max_length`/`min_length` counts the whole sequence; the placeholders must not eat into it.

    (With neither set, HF generates 20 new tokens after whatever the input is, placeholders included.)
    """
    for total, new in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
        if _generation_value(model, kwargs, new) is None and _generation_value(model, kwargs, total):
            kwargs[total] = _generation_value(model, kwargs, total) + num_prompt


@contextlib.contextmanager
def _prompt_injected(model: nn.Module, prompt: torch.Tensor, prompt_kv: list):
    """While active, each forward of `model` sees `[prompt; text]` in place of `[placeholders; text]`."""
    num_prompt = prompt.shape[0]

    def pre_hook(module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is not None and cache.get_seq_length() >= num_prompt:
            return None  # a decode step: the prompt already lives in the cache
        ids = kwargs["input_ids"]
        batch = ids.shape[0]
        kwargs = dict(kwargs)
        if cache is not None:
            for layer_idx, (k, v) in enumerate(prompt_kv):
                cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), layer_idx)  # [B, H, N, hd]
            kwargs["input_ids"] = ids[:, num_prompt:]
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = kwargs["position_ids"][:, num_prompt:]
        else:
            # use_cache=False: every step re-runs the whole sequence, so the prompt rides along as embeddings.
            text = module.get_input_embeddings()(ids[:, num_prompt:])  # [B, T, D]
            head = prompt.to(text.dtype).unsqueeze(0).expand(batch, -1, -1)  # [B, N, D]
            kwargs["input_ids"] = None
            kwargs["inputs_embeds"] = torch.cat([head, text], dim=1)  # [B, N+T, D]
        return args, kwargs

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def generate(model: nn.Module, prompt: torch.Tensor, prompt_kv: list, args: tuple, kwargs: dict):
    """Run `model.generate` as if `prompt` `[N, D]` preceded every row; returns what the base model would return."""
    kwargs = dict(kwargs)
    if args:
        kwargs["input_ids"] = args[0]
    input_ids = kwargs.pop("input_ids", None)
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "`input_ids` is required for `generate()` with a soft prompt, got "
            f"input_ids={None if input_ids is None else 'a tensor'} and inputs_embeds="
            f"{'a tensor' if kwargs.get('inputs_embeds') is not None else None}. Pass token ids; the prompt is added "
            "for you."
        )
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError("`cache`/`past_key_values` can't be passed to `generate()`: the soft prompt owns the cache.")
    num_prompt = prompt.shape[0]
    batch, length = input_ids.shape
    semantics.check_fits(num_prompt, length, getattr(model.config, "n_positions", None))
    mask = semantics.text_mask(kwargs.pop("attention_mask", None), batch, length, input_ids.device)  # [B, T]
    placeholders = input_ids.new_full((batch, num_prompt), _placeholder_id(model, kwargs))
    _shift_total_lengths(model, kwargs, num_prompt)
    with _prompt_injected(model, prompt, prompt_kv):
        out = model.generate(
            input_ids=torch.cat([placeholders, input_ids], dim=1),  # [B, N+T]
            attention_mask=semantics.extended_mask(mask, num_prompt),  # [B, N+T]
            **kwargs,
        )
    if isinstance(out, torch.Tensor):
        return out[:, num_prompt:]  # [B, T+new]
    out.sequences = out.sequences[:, num_prompt:]
    return out
