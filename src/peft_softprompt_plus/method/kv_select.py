"""Which of a context's cached positions a KV prompt keeps, in one place for the demonstrations start (context
tuning) and a KV student's `selected` start (distillation): the attention a set of reading rows pays each position
(`attention_received`, the scorer), the top n of it shared by every layer and head or per layer and key/value head
(as SnapKV and H2O select a cache; optionally pooled over neighbours first, as SnapKV pools), the cache gathered at
them, and each kept entry's origin (its context position).
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
from torch import nn

from ..forward.kv_pass import KVLayout


@torch.no_grad()
def attention_received(
    model: nn.Module, owner, ids: list[int], rows: Sequence[tuple[list[int], int]], layout: KVLayout
):
    """How much attention the queries of `rows` (each `(ids, first)`: read after `ids`, its queries from index `first`
    on) pay each position of `ids` in the frozen `model`, summed over queries, rows and the query heads that share a
    key/value head: `[layers, Hkv, P]` (`layout`: the attention modules, in order, and their Hkv). Eager computes it
    for this thread's calls alone (`owner.running`); the base model is called without the prompt keyword, so it
    computes the base model. Each layer's weights are summed as that layer returns them and dropped (a hook on each
    attention module, reading this thread's calls alone), so only one layer's `[H, T, T]` is alive at a time, not
    every layer's (`output_attentions=True` would keep them all)."""
    p, heads = len(ids), layout.heads
    device = model.get_input_embeddings().weight.device
    total = torch.zeros(len(layout.modules), heads, p, device=device)  # [layers, Hkv, P]
    start, caller = [0], threading.get_ident()  # the current row's first query index, and whose calls are read

    def summed(index: int):
        def hook(module, args, output):
            if threading.get_ident() != caller:  # another thread's forward (its own kernel) shares the modules
                return
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [1, H, T, T]
            if weights is None:
                raise RuntimeError(f"{type(module).__name__} returned no attention weights under eager attention.")
            paid = weights[0, :, p + start[0] :, :p].float().sum(1)  # [H, P]
            total[index] += paid.view(heads, -1, p).sum(1)  # [Hkv, P]: query head q reads key/value head q // group

        return hook

    handles = [m.register_forward_hook(summed(i)) for i, m in enumerate(layout.modules)]
    try:
        with owner.running(model, "eager"):
            for text, first in rows:
                start[0] = first
                model(input_ids=torch.tensor([list(ids) + list(text)], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return total


def _checked_n(n: int, forced: Sequence[int], p: int) -> None:
    if not len(forced) <= n <= p:
        raise ValueError(
            f"`num_virtual_tokens` must be in [{len(forced)}, {p}] (the context's positions, the ones always kept "
            f"included), got {n}."
        )


def shared_positions(scores: torch.Tensor, n: int, forced: Sequence[int] = ()) -> torch.Tensor:
    """The `n` positions, shared by every layer and head, that `scores` `[layers, Hkv, P]` rank highest summed, in
    order, the positions `forced` (the sink) always among them: `[n]`."""
    _checked_n(n, forced, scores.shape[-1])
    ranked = scores.sum((0, 1)).clone()  # [P]
    ranked[list(forced)] = float("inf")
    return ranked.topk(n).indices.sort().values


def pooled(scores: torch.Tensor, width: int) -> torch.Tensor:
    """`scores` (`[..., P]`) max-pooled over `width` neighbouring positions (odd; 1: unchanged), as SnapKV pools
    before its top-k: a position next to a much-read one ranks with it, so a fact's few tokens are kept together."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1 or width % 2 == 0:
        raise ValueError(f"`width` must be an odd int >= 1 (1: no pooling), got {width!r}.")
    if width == 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])  # [rows, 1, P]
    return nn.functional.max_pool1d(flat, width, stride=1, padding=width // 2).reshape(scores.shape)


def per_head_positions(scores: torch.Tensor, n: int, forced: Sequence[int] = (), pool: int = 1) -> torch.Tensor:
    """The `n` best-scored positions of `scores` (`[layers, Hkv, P]`) per layer and head, in position order, the
    positions `forced` (the sink, a kept passage) always among them: `[layers, Hkv, n]`. `pool`: the scores
    max-pooled over that many neighbours first (`pooled`)."""
    _checked_n(n, forced, scores.shape[-1])
    ranked = pooled(scores, pool).clone()  # [layers, Hkv, P]
    ranked[..., list(forced)] = float("inf")
    return ranked.topk(n, dim=-1).indices.sort(dim=-1).values


def gathered(cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`cache` (`[layers, 2, Hkv, P, hd]`) at `positions`, shared (`[n]`) or per layer and head (`[layers, Hkv, n]`):
    `[layers, 2, Hkv, n, hd]`."""
    layers, _, heads, _, hd = cache.shape
    positions = positions.to(cache.device)
    if positions.dim() == 1:
        return cache[..., positions, :]
    index = positions[:, None, :, :, None].expand(layers, 2, heads, positions.shape[-1], hd)
    return cache.gather(3, index)


def origins(positions: torch.Tensor, layers: int, heads: int) -> torch.Tensor:
    """Each kept entry's context position, `[layers, Hkv, n]` long, from shared (`[n]`) or per-head positions."""
    return positions.long().expand(layers, heads, positions.shape[-1]).clone()


def kept_mask(positions: torch.Tensor, frozen: int, kept: Sequence[int]) -> torch.Tensor:
    """Which entries of the trained part of a per-head selection (its positions `[layers, Hkv, n]` after the first
    `frozen`) hold a `kept` position: `[layers, 1, Hkv, n - frozen, 1]` bool, the shape of a gradient mask over the
    prompt leaf `[layers, 2, Hkv, n - frozen, hd]`. Selection differs per head, so kept positions sit at other
    indices in each head."""
    trained = positions[..., frozen:]  # [layers, Hkv, n - frozen]
    return torch.isin(trained, torch.tensor(list(kept), dtype=trained.dtype, device=trained.device))[
        :, None, ..., None
    ]
