"""`generate()` with a soft prompt. The result looks exactly like the base model's `generate`: the input ids followed
by the new tokens.

On the attention path the prompt's keys/values are computed once per adapter, reused across calls until the prompt
changes, and read by every decode step at the attention: the cache holds the text alone. Families whose attention we
can't reach generate from `inputs_embeds` with the prompt in front.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import torch
from torch import nn

from . import attention, kv_pass, semantics, validation
from . import paths as forward_paths
from .prompt_kv import PromptKV


class PromptKVStore:
    """Each adapter's prompt pass for inference (keys/values, last output), kept while the prompt's values stay the
    same. The values themselves are compared (`[N, D]`, cheap next to a forward): fused optimizers update a
    parameter without bumping its version counter."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[torch.Tensor, tuple[PromptKV, torch.Tensor]]] = {}

    def get(self, adapter: str, model: nn.Module, prompt: torch.Tensor):
        """`(PromptKV, last output [1, D])` of `prompt` `[N, D]`, computed without autograd."""
        cached = self._entries.get(adapter)
        if cached is not None and not model.training and _same(cached[0], prompt):
            return cached[1]
        with torch.no_grad():
            computed = forward_paths.prompt_pass(model, forward_paths.RowPrompts([prompt]), in_text=0)
        if not model.training:  # dropout makes a training-mode prompt pass single-use
            self._entries[adapter] = (prompt.detach().clone(), computed)
        return computed

    def stacked(self, adapters, model: nn.Module, row_prompts: forward_paths.RowPrompts, layout):
        """The passes of several adapters as one `(PromptKV, [A, D] or None)`, read by `row_prompts.rows`: each input
        prompt's stored pass, each KV prompt's stored keys/values."""
        names, inputs = row_prompts.input_names(adapters), row_prompts.inputs()
        computed = [self.get(a, model, x) for a, x in zip(names, inputs.prompts, strict=True)]
        done = None
        if computed:
            lasts = torch.cat([last for _, last in computed])  # [A_in, D]
            done = PromptKV.stack([kv for kv, _ in computed], row_prompts.rows), lasts
        return kv_pass.prompt_passes(model, row_prompts, 0, layout, done)

    def drop(self, adapter: Optional[str] = None) -> None:
        if adapter is None:
            self._entries.clear()
        else:
            self._entries.pop(adapter, None)


def _same(kept: torch.Tensor, prompt: torch.Tensor) -> bool:
    return kept.dtype == prompt.dtype and kept.device == prompt.device and torch.equal(kept, prompt)


def _inputs(model: nn.Module, num_prompt: int, args: tuple, kwargs: dict):
    """The call's token ids and `[B, L]` mask, checked; `kwargs` keeps the rest."""
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
    validation.refuse_owned(
        kwargs, "`generate()` with a soft prompt", "the prompt's keys/values are the cache's start"
    )
    input_ids = validation.check_ids("input_ids", input_ids, model.get_input_embeddings().num_embeddings)
    batch, length = input_ids.shape
    validation.check_mask(kwargs.get("attention_mask"), batch, length)
    validation.check_generate_fits(model, num_prompt, length, kwargs)
    mask = semantics.text_mask(kwargs.pop("attention_mask", None), batch, length, input_ids.device)  # [B, L]
    return input_ids, mask


# The `generate` call in flight in this thread (or task): its model and its prompt's keys/values. Per call, so calls
# on several threads at once each read their own prompt.
_GENERATING: contextvars.ContextVar[Optional[tuple[nn.Module, PromptKV]]] = contextvars.ContextVar(
    "softprompt_plus_generating", default=None
)


def _inject_prompt(module: nn.Module, args: tuple, kwargs: dict):
    """The forward pre-hook `install_hook` puts on the model: inside this thread's `generate`, every forward reads the
    prompt's keys/values; a decode step's queries follow the text its cache has seen (the cache holds the text alone).
    A module-level function, so a model with the hook still pickles."""
    current = _GENERATING.get()
    if current is None or current[0] is not module:
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    seen = cache.get_seq_length() if cache is not None else 0
    return args, {**kwargs, attention.KWARG: current[1].at(int(seen), kwargs.get("position_ids"))}


def install_hook(model: nn.Module):
    """Once per attach: the hook that hands `generate`'s forwards the prompt (a handle to remove on unload)."""
    return model.register_forward_pre_hook(_inject_prompt, with_kwargs=True)


@contextlib.contextmanager
def _prompt_at_attention(model: nn.Module, prompt_kv: PromptKV):
    token = _GENERATING.set((model, prompt_kv))
    try:
        yield
    finally:
        _GENERATING.reset(token)


def generate(model: nn.Module, prompt_kv: PromptKV, args: tuple, kwargs: dict):
    """Run `model.generate` as if the prompt behind `prompt_kv` preceded every row."""
    kwargs = dict(kwargs)
    input_ids, mask = _inputs(model, int(prompt_kv.text_starts.max()), args, kwargs)
    offsets = prompt_kv.row_starts(input_ids.shape[0], input_ids.device)  # [B] where each row's text starts
    with _prompt_at_attention(model, prompt_kv):
        return model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=semantics.positions(mask, offsets),  # [B, L]; generate extends them by one a step
            **kwargs,
        )


def generate_concat(model: nn.Module, prompt: torch.Tensor, args: tuple, kwargs: dict):
    """`[prompt; text]` as `inputs_embeds` at prefill; `input_ids` keep the text, so the output and the logits
    processors see token ids only."""
    kwargs = dict(kwargs)
    num_prompt = prompt.shape[0]
    input_ids, mask = _inputs(model, num_prompt, args, kwargs)
    embeds = model.get_input_embeddings()(input_ids)  # [B, L, D]
    head = prompt.to(embeds.dtype).unsqueeze(0).expand(input_ids.shape[0], -1, -1)  # [B, N, D]
    return model.generate(
        input_ids=input_ids,
        inputs_embeds=torch.cat([head, embeds], dim=1),  # [B, N+L, D]
        attention_mask=semantics.extended_mask(mask, num_prompt),  # [B, N+L]
        **kwargs,
    )
