"""The `selected` start of a KV student (`distill_prompt(prompt_level="kv", prompt_init="selected")`): N of the whole
system turn's cached positions per layer and key/value head, chosen by the attention the student's own training text
pays them (as SnapKV and H2O select a cache).

The keys stay as they were computed, rotary positions included, and the text starts after the whole system turn
(`kv_text_start` = its length): with N equal to that length the student is the teacher exactly. The first
`kv_frozen_positions` positions (the attention sink) are always kept, and so are the positions of a kept passage
(`keep_text`): they keep the teacher's own keys/values, and training leaves them as they are (`kept_mask`).
"""

from __future__ import annotations

import torch

from ..method import kv_select
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
    return kv_select.attention_received(model.get_base_model(), state.attention, prefix_ids, texts, state.kv_layout)


@torch.no_grad()
def install(model, name: str, values: torch.Tensor) -> None:
    """`values` (`[layers, 2, Hkv, N, hd]`) as adapter `name`'s keys/values: its frozen sink, then its trained part."""
    bank = model.base_model.prompt_bank
    frozen = bank.sinks[name].shape[-2] if name in bank.sinks else 0
    if frozen:
        bank.sinks[name].copy_(values[..., :frozen, :])
    bank.prompts[name].copy_(values[..., frozen:, :])
