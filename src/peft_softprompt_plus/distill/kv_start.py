"""The `selected` start of a KV student (`distill_prompt(prompt_level="kv", prompt_init="selected")`): N of the whole
system turn's cached positions per layer and key/value head, chosen by the attention the student's own training text
pays them (as SnapKV and H2O select a cache).

The keys stay as they were computed, rotary positions included, and the text starts after the whole system turn
(`kv_text_start` = its length): with N equal to that length the student is the teacher exactly. The first
`kv_frozen_positions` positions (the attention sink) are always kept, and so are the positions of a kept passage
(`keep_text`): they keep the teacher's own keys/values, and training leaves them as they are (`kept_mask`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..method.demonstrations import attention_received
from ..method.kv_init import run_once


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
    state = model.base_model.forward_state
    if kv_heads != state.kv_layout.heads:
        raise ValueError(f"`kv_heads`={kv_heads} is not the model's {state.kv_layout.heads} key/value heads.")
    return attention_received(model.get_base_model(), state.attention, prefix_ids, texts, state.kv_layout)


def chosen(scores: torch.Tensor, n: int, forced: Sequence[int]) -> torch.Tensor:
    """The `n` best-scored positions of `scores` (`[layers, Hkv, P]`) per layer and head, in position order, the
    positions `forced` (the sink, a kept passage) always among them: `[layers, Hkv, n]`."""
    p = scores.shape[-1]
    if not len(forced) <= n <= p:
        raise ValueError(
            f"`num_virtual_tokens` must be in [{len(forced)}, {p}] (the system turn's positions), got {n}."
        )
    ranked = scores.clone()  # [layers, Hkv, P]
    ranked[..., list(forced)] = float("inf")
    return ranked.topk(n, dim=-1).indices.sort(dim=-1).values


def gathered(cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`cache` (`[layers, 2, Hkv, P, hd]`) at `positions` (`[layers, Hkv, n]`): `[layers, 2, Hkv, n, hd]`."""
    layers, _, heads, _, hd = cache.shape
    index = positions.to(cache.device)[:, None, :, :, None].expand(layers, 2, heads, positions.shape[-1], hd)
    return cache.gather(3, index)


def selected(cache: torch.Tensor, scores: torch.Tensor, n: int, frozen: int, kept: Sequence[int] = ()) -> torch.Tensor:
    """The `n` best-scored positions of `cache` (`[layers, 2, Hkv, P, hd]`) per layer and head, in position order,
    the first `frozen` and the `kept` ones always among them: `[layers, 2, Hkv, n, hd]`."""
    forced = sorted(set(range(frozen)) | set(kept))
    return gathered(cache, chosen(scores.to(cache.device), n, forced))


def kept_mask(positions: torch.Tensor, frozen: int, kept: Sequence[int]) -> torch.Tensor:
    """Which entries of the trained part of a `selected` start (its positions `[layers, Hkv, n]` after the first
    `frozen`) hold a `kept` position: `[layers, 1, Hkv, n - frozen, 1]` bool, the shape of a gradient mask over the
    prompt leaf `[layers, 2, Hkv, n - frozen, hd]`. Selection differs per head, so kept positions sit at other
    indices in each head."""
    trained = positions[..., frozen:]  # [layers, Hkv, n - frozen]
    return torch.isin(trained, torch.tensor(list(kept), dtype=trained.dtype, device=trained.device))[
        :, None, ..., None
    ]


@torch.no_grad()
def install(model, name: str, values: torch.Tensor) -> None:
    """`values` (`[layers, 2, Hkv, N, hd]`) as adapter `name`'s keys/values: its frozen sink, then its trained part."""
    bank = model.base_model.prompt_bank
    frozen = bank.sinks[name].shape[-2] if name in bank.sinks else 0
    if frozen:
        bank.sinks[name].copy_(values[..., :frozen, :])
    bank.prompts[name].copy_(values[..., frozen:, :])
