"""How the prompt reaches the model: shared prompt keys/values (fast) or plain concatenation (fallback).

Both build keyword arguments for the wrapped model over the same semantics; they differ only in how many prompt
positions are computed once at batch 1 and shared through a cache (`cached`) versus run with every row (`riding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import DynamicCache

from . import semantics


@dataclass
class PromptedBatch:
    kwargs: dict  # inputs for the wrapped model / its backbone
    riding: int  # leading prompt positions in its outputs, to strip
    mask: torch.Tensor  # [B, L] the text's own mask
    prompt_tail: Optional[torch.Tensor] = None  # [1, D] last prompt position's output, when no prompt position rides


def prompt_pass(backbone: nn.Module, prompt: torch.Tensor):
    """`prompt` `[M, D]` through the backbone at batch 1: under causal attention its per-layer keys/values (`.cache`)
    and outputs (`.last_hidden_state`, `[1, M, D]`) are the same for every row."""
    count = prompt.shape[0]
    pos = torch.arange(count, device=prompt.device).unsqueeze(0)  # [1, M]
    return backbone(inputs_embeds=prompt.unsqueeze(0), position_ids=pos, use_cache=True)


def broadcast_cache(cache: DynamicCache, batch: int, config) -> DynamicCache:
    # `expand` copies nothing; the first text-side `torch.cat` materialises rows, and autograd sums row gradients back.
    layers = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v, *_ in cache]  # [B, H, M, hd]
    return DynamicCache(layers, config=config)


def build(
    model: nn.Module,
    prompt: torch.Tensor,
    cached: int,
    input_ids: Optional[torch.Tensor],
    inputs_embeds: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
) -> PromptedBatch:
    """Inputs that make `model` see `[prompt; text]`, with the first `cached` prompt positions shared via a cache."""
    num_prompt = prompt.shape[0]
    riding = num_prompt - cached
    text = input_ids if input_ids is not None else inputs_embeds
    batch, length = text.shape[0], text.shape[1]
    mask = semantics.text_mask(attention_mask, batch, length, text.device)  # [B, L]
    kwargs = {
        "attention_mask": semantics.extended_mask(mask, num_prompt),  # [B, N+L]
        "position_ids": semantics.positions(mask, num_prompt)[:, cached:],  # [B, riding+L]
    }
    tail = None
    if cached:
        # `mask.all()` syncs on a GPU and breaks a compiled graph: only asked when a mask was passed, never compiled.
        unpadded = attention_mask is None or (not torch.compiler.is_compiling() and bool(mask.all()))
        impl = getattr(model.config, "_attn_implementation", None)
        dtype = model.get_input_embeddings().weight.dtype
        shared = semantics.shared_mask(cached, riding + length, impl, dtype, text.device) if unpadded else None
        if shared is not None:
            kwargs["attention_mask"] = shared  # [1, 1, riding+L, N+L]
        shared_pass = prompt_pass(model.base_model, prompt[:cached])
        kwargs["cache"] = broadcast_cache(shared_pass.cache, batch, model.config)
        tail = shared_pass.last_hidden_state[0, -1:] if riding == 0 else None  # [1, D]
    if riding == 0 and input_ids is not None:
        # Token ids go in untouched, so the model's own id-based logic (pooling, warnings) still applies.
        kwargs["input_ids"] = input_ids
    else:
        if inputs_embeds is None:
            inputs_embeds = model.get_input_embeddings()(input_ids)  # [B, L, D]
        head = prompt[cached:].to(inputs_embeds.dtype).unsqueeze(0).expand(batch, -1, -1)  # [B, riding, D]
        kwargs["inputs_embeds"] = torch.cat([head, inputs_embeds], dim=1)  # [B, riding+L, D]
    return PromptedBatch(kwargs=kwargs, riding=riding, mask=mask, prompt_tail=tail)
