"""The `selected` start of a KV student (`distill_prompt(prompt_level="kv", prompt_init="selected")`): N of the whole
system turn's cached positions per layer and key/value head, chosen by the attention the student's own training text
pays them (as SnapKV and H2O select a cache).

The keys stay as they were computed, rotary positions included, and the text starts after the whole system turn
(`kv_text_start` = its length): with N equal to that length the student is the teacher exactly. The first
`kv_frozen_positions` positions (the attention sink) are always kept.
"""

from __future__ import annotations

import torch

from ..method.demonstrations import attention_received
from ..method.kv_prompt import run_once


@torch.no_grad()
def prompt_cache(model, prefix_ids: list[int]) -> torch.Tensor:
    """The keys/values every layer makes of the system turn `prefix_ids` (P tokens) in the frozen base of `model` (a
    PeftModel with a KV adapter): `[layers, 2, Hkv, P, hd]` float32, what the teacher reads."""
    tuner = model.base_model
    embedding = tuner.model.get_input_embeddings()
    rows = embedding(torch.tensor(prefix_ids, device=embedding.weight.device))  # [P, D], as the teacher's prompt
    return run_once(tuner.model, rows, tuner.forward_state.kv_layout)


def attention_scores(model, prefix_ids: list[int], texts: list[tuple[list[int], int]], kv_heads: int) -> torch.Tensor:
    """How much attention the queries of `texts` (each `(ids, first)`, read after the system turn; its queries from
    index `first` on: the reply's, where the system prompt's facts are read) pay each system-turn position, summed
    over queries, texts and the query heads that share a key/value head: `[layers, Hkv, P]` (`model` a PeftModel)."""
    owner = model.base_model.forward_state.attention
    return attention_received(model.get_base_model(), owner, prefix_ids, texts, kv_heads)


def selected(cache: torch.Tensor, scores: torch.Tensor, n: int, frozen: int) -> torch.Tensor:
    """The `n` best-scored positions of `cache` (`[layers, 2, Hkv, P, hd]`) per layer and head, in position order,
    the first `frozen` always among them: `[layers, 2, Hkv, n, hd]`."""
    layers, _, heads, p, hd = cache.shape
    if not frozen <= n <= p:
        raise ValueError(f"`num_virtual_tokens` must be in [{frozen}, {p}] (the system turn's positions), got {n}.")
    ranked = scores.to(cache.device).clone()  # [layers, Hkv, P]
    ranked[..., :frozen] = float("inf")
    keep = ranked.topk(n, dim=-1).indices.sort(dim=-1).values  # [layers, Hkv, n]
    index = keep[:, None, :, :, None].expand(layers, 2, heads, n, hd)
    return cache.gather(3, index)


@torch.no_grad()
def install(model, name: str, values: torch.Tensor) -> None:
    """`values` (`[layers, 2, Hkv, N, hd]`) as adapter `name`'s keys/values: its frozen sink, then its trained part."""
    bank = model.base_model.prompt_bank
    frozen = bank.sinks[name].shape[-2] if name in bank.sinks else 0
    if frozen:
        bank.sinks[name].copy_(values[..., :frozen, :])
    bank.prompts[name].copy_(values[..., frozen:, :])
