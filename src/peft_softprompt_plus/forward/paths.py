"""How the prompt reaches the model: at the attention (fast) or concatenated to every row (the reference).

Both build the wrapped model's keyword arguments over the same semantics (`semantics.py`). The attention path runs
the prompts once, at batch A (one row per adapter in the batch), and hands their keys/values to every attention layer
through `attention.KWARG`; the text then runs alone. The concatenation path sends `[prompt; text]` as `inputs_embeds`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from . import attention, semantics
from .prompt_kv import PromptKV, gather_rows


@dataclass
class RowPrompts:
    """The prompts of one forward, in the embedding's dtype: an input prompt's `[N_a, D]` rows, or a KV prompt's
    `[layers, 2, Hkv, N_a, hd]` keys/values (`kv[a]`, its text at `starts[a]`); `rows[b]` picks row b's prompt, -1 for
    none. `rows=None`: every row reads prompt 0."""

    prompts: list[torch.Tensor]
    rows: Optional[torch.Tensor] = None  # [B]
    names: Optional[list[str]] = None  # each row's adapter name, for per-adapter heads (mixed batches only)
    kv: Optional[list[bool]] = None  # which prompts are KV prompts (None: none)
    text_starts: Optional[list[int]] = None  # where each prompt's text starts (None: at its length)

    def per_row(self, values: torch.Tensor, batch: int) -> torch.Tensor:
        """`[A, ...]` -> `[B, ...]`; rows without a prompt get row 0's values (callers mask them)."""
        return gather_rows(values, self.rows, batch)

    def has_prompt(self, batch: int, device) -> torch.Tensor:
        return torch.ones(batch, dtype=torch.bool, device=device) if self.rows is None else self.rows.to(device) >= 0

    def lengths(self, device) -> torch.Tensor:
        return torch.tensor([p.shape[-2] for p in self.prompts], device=device)  # [A]

    def starts(self, device) -> torch.Tensor:
        return self.lengths(device) if self.text_starts is None else torch.tensor(self.text_starts, device=device)

    @property
    def kv_flags(self) -> list[bool]:
        return self.kv or [False] * len(self.prompts)

    def is_kv(self, device) -> torch.Tensor:
        return torch.tensor(self.kv_flags, dtype=torch.bool, device=device)  # [A]

    def predicts_first(self, batch: int, device) -> torch.Tensor:
        """`[B]`: the rows whose prompt's last position predicts text token 0 (an input prompt's; a KV prompt has no
        last position, and a row without a prompt no prompt)."""
        return self.has_prompt(batch, device) & ~self.per_row(self.is_kv(device), batch)

    def inputs(self) -> "RowPrompts":
        """The input prompts alone (the ones a prompt pass runs), in order."""
        return RowPrompts(self.input_names(self.prompts))

    def input_names(self, entries: list) -> list:
        """The entries of `entries` (one per prompt) that belong to input prompts."""
        return [e for e, kv in zip(entries, self.kv_flags, strict=True) if not kv]


@dataclass
class PromptedBatch:
    kwargs: dict  # inputs for the wrapped model / its backbone
    in_text: int  # leading prompt positions in its outputs, to strip
    mask: torch.Tensor  # [B, L] the text's own mask
    row_prompts: RowPrompts
    prompt_last: Optional[torch.Tensor] = None  # [A, D] each prompt's last output, when no prompt position rides


# ---------------------------------------------------------------------------------------------- checkpointing


def _checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def _reentrant(layer: nn.Module) -> bool:
    """Whether the layer's checkpoint function re-enters autograd (`use_reentrant=True`, or one we can't read)."""
    fn = getattr(layer, "_gradient_checkpointing_func", None)
    keywords = getattr(fn, "keywords", None)
    if keywords is None or getattr(fn, "func", None) is not torch.utils.checkpoint.checkpoint:
        return True
    return keywords.get("use_reentrant") is not False  # torch's default (None) is reentrant


@contextlib.contextmanager
def _not_checkpointed(layers: list[nn.Module]):
    # The prompt pass is batch A and cheap; recomputing it in backward would run a second capture.
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


class _HandBack(torch.autograd.Function):
    """Reentrant checkpointing runs each layer's backward in a nested autograd call that leaves the prompt's gradient
    on the leaf copies the layers read. This node sits where the text enters the model, so it runs after every layer's
    backward, and hands those gradients on to the prompt pass."""

    @staticmethod
    def forward(ctx, leaves, hidden, *connected):
        ctx.leaves = leaves
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        grads = []
        for leaf in ctx.leaves:
            grads.append(leaf.grad)
            leaf.grad = None
        return (None, grad, *grads)


# ---------------------------------------------------------------------------------------------- the prompt pass


def prompt_pass(model: nn.Module, row_prompts: RowPrompts, in_text: int) -> tuple[PromptKV, torch.Tensor]:
    """Run the shared prompt positions once, one row per prompt: `[A, N, D]`, right-padded to the longest.

    Under causal attention a prompt position never sees the text, so its keys/values are the same for every row that
    reads it. Returns the recorded `PromptKV` and each prompt's last output `[A, D]` (it predicts text token 0).
    """
    shared = [p[: p.shape[0] - in_text] for p in row_prompts.prompts]
    width = max(p.shape[0] for p in shared)
    stack = torch.stack([nn.functional.pad(p, (0, 0, 0, width - p.shape[0])) for p in shared])  # [A, N, D]
    lengths = torch.tensor([p.shape[0] for p in shared], device=stack.device)  # [A]
    record = PromptKV(lengths=lengths, rows=row_prompts.rows, capturing=True)
    pos = torch.arange(width, device=stack.device).expand(len(shared), width)  # [A, N]
    # Reentrant checkpointing runs a layer's forward without autograd, which would cut the keys/values it records
    # from the prompt; other checkpointing recomputes the pass in backward like the text's.
    layers = [layer for layer in _checkpointed_layers(model) if _reentrant(layer)]
    with _not_checkpointed(layers):
        out = model.base_model(inputs_embeds=stack, position_ids=pos, use_cache=False, **{attention.KWARG: record})
    if not record.layers:
        raise RuntimeError(f"{type(model).__name__}'s attention never ran through the attention registry.")
    hidden = out.last_hidden_state  # [A, N, D]
    return record.at(0), hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]  # [A, D]


OUTSIDE_REGISTRY = "it computes attention outside transformers' attention registry"
FSDP2_BLOCKS = "FSDP2 `fully_shard` wraps its blocks"


def shared_kv_refused(model: nn.Module, reason: str) -> ValueError:
    """The error for `forward_path='shared_kv'` on a model whose attention layers can't read the prompt's keys/values
    (`reason`: OUTSIDE_REGISTRY at attach, FSDP2_BLOCKS at forward)."""
    return ValueError(
        f"`forward_path`='shared_kv' needs a model whose attention layers read the prompt's keys/values through "
        f"transformers' attention registry; {type(model).__name__} can't, since {reason}. Use forward_path='auto' "
        "(it concatenates here) or 'concat'."
    )


def fsdp2_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 `fully_shard` wraps a module inside `model`. Its pre-forward rebuilds every dataclass argument
    that holds grad-requiring tensors, so each sharded block would record the prompt's keys/values into a copy of
    the prompt pass's `PromptKV`, and its backward can't regather the blocks' weights for that pass."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()  # `fully_shard` needs it
    if not distributed:  # the common case costs no walk over the modules on the forward path
        return False
    fsdp_module = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules())


# ---------------------------------------------------------------------------------------------- building a batch


@functools.lru_cache(maxsize=None)
def _takes_position_ids(model_cls: type) -> bool:
    return "position_ids" in inspect.signature(model_cls.forward).parameters


def _text_embeddings(model, input_ids, inputs_embeds):
    return inputs_embeds if inputs_embeds is not None else model.get_input_embeddings()(input_ids)  # [B, L, D]


def attention_inputs(
    model: nn.Module,
    row_prompts: RowPrompts,
    in_text: int,
    input_ids,
    inputs_embeds,
    attention_mask,
    passes: Callable[[], tuple[PromptKV, Optional[torch.Tensor]]],
) -> PromptedBatch:
    """The text alone, reading the prompts' keys/values at the attention; `in_text` last prompt positions (0 or 1)
    run with the text instead (their outputs then come from the model itself, loss included). `passes()` gives the
    prompts' `PromptKV` and last outputs (a prompt pass, stored passes, stored keys/values); it is called only when
    some prompt position is left for it (a one-token input prompt riding with the text leaves none)."""
    text = input_ids if input_ids is not None else inputs_embeds
    batch, length = text.shape[0], text.shape[1]
    mask = semantics.text_mask(attention_mask, batch, length, text.device)  # [B, L]
    has_prompt = row_prompts.has_prompt(batch, text.device)  # [B]
    heads_ride = row_prompts.predicts_first(batch, text.device) if in_text else has_prompt  # [B]
    starts = row_prompts.per_row(row_prompts.starts(text.device), batch)  # [B]
    shared = (starts - in_text * heads_ride.long()) * has_prompt  # [B] prompt positions before the text pass
    kwargs: dict = {}
    prompt_last = None
    layers = _checkpointed_layers(model) if model.training and torch.is_grad_enabled() else []
    hand_back: Optional[tuple[list, list]] = None  # (leaf copies the layers read, the prompt pass's tensors)
    if max(p.shape[-2] for p in row_prompts.prompts) > in_text or any(row_prompts.kv_flags):
        prompt_kv, last = passes()
        if layers and any(_reentrant(layer) for layer in layers):
            connected = [t for kv in prompt_kv.layers.values() for t in kv]
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in connected]
            prompt_kv.layers = {m: (leaves[2 * i], leaves[2 * i + 1]) for i, m in enumerate(prompt_kv.layers)}
            hand_back = (leaves, connected)
        kwargs[attention.KWARG] = prompt_kv
        prompt_last = last if in_text == 0 else None
    if in_text:
        embeds = _text_embeddings(model, input_ids, inputs_embeds)
        # A KV prompt has no last position: its rows' head is a masked zero row, as a row without a prompt's is.
        flags = zip(row_prompts.prompts, row_prompts.kv_flags, strict=True)
        heads = torch.stack([embeds.new_zeros(embeds.shape[-1]) if kv else p[-1] for p, kv in flags])  # [A, D]
        head = row_prompts.per_row(heads.to(embeds.dtype), batch).unsqueeze(1)  # [B, 1, D]
        kwargs["inputs_embeds"] = torch.cat([head, embeds], dim=1)  # [B, 1+L, D]
        text_mask = torch.cat([heads_ride.to(mask.dtype).unsqueeze(1), mask], dim=1)  # [B, 1+L]
    else:
        text_mask = mask
        if hand_back is not None or input_ids is None:
            kwargs["inputs_embeds"] = _text_embeddings(model, input_ids, inputs_embeds)
        else:
            # Token ids go in untouched, so the model's own id-based logic still applies.
            kwargs["input_ids"] = input_ids
    if hand_back is not None:
        kwargs["inputs_embeds"] = _HandBack.apply(hand_back[0], kwargs["inputs_embeds"], *hand_back[1])
    kwargs["attention_mask"] = text_mask if attention_mask is not None or in_text else None
    kwargs["position_ids"] = semantics.positions(text_mask, shared)  # [B, in_text+L]
    if attention.KWARG in kwargs:
        kwargs[attention.KWARG] = kwargs[attention.KWARG].at(0, kwargs["position_ids"])
    return PromptedBatch(kwargs, in_text, mask, row_prompts, prompt_last)


def concat_inputs(
    model: nn.Module, row_prompts: RowPrompts, input_ids, inputs_embeds, attention_mask
) -> PromptedBatch:
    """`[prompt; text]` through `inputs_embeds`: the textbook way, for families whose attention we can't reach."""
    (prompt,) = row_prompts.prompts
    num_prompt = prompt.shape[0]
    embeds = _text_embeddings(model, input_ids, inputs_embeds)
    batch, length = embeds.shape[0], embeds.shape[1]
    mask = semantics.text_mask(attention_mask, batch, length, embeds.device)  # [B, L]
    full_mask = semantics.extended_mask(mask, num_prompt)  # [B, N+L]
    head = prompt.to(embeds.dtype).unsqueeze(0).expand(batch, -1, -1)  # [B, N, D]
    kwargs = {"inputs_embeds": torch.cat([head, embeds], dim=1), "attention_mask": full_mask}  # [B, N+L, D]
    if _takes_position_ids(type(model)):
        kwargs["position_ids"] = semantics.prompted_positions(mask, num_prompt)  # [B, N+L]
    return PromptedBatch(kwargs, num_prompt, mask, row_prompts)
