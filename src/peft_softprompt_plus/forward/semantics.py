"""The exact prompted semantics as tensors: extended attention mask, position ids, prefixed labels.

The prompt occupies positions `0..N-1`; text token `i` sits at `N + (real tokens before it)`, so left or right
padding never moves a real token.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100


def text_mask(attention_mask: Optional[torch.Tensor], batch: int, length: int, device) -> torch.Tensor:
    """The user's 2-D mask, or all ones (`validation.check_mask` has refused every other shape before this)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.long, device=device)  # [B, L]
    return attention_mask.to(device)


def pad_id(source) -> int:
    """A tokenizer's or a config's pad id, else its end-of-text id (GPT-2 has no pad token)."""
    return source.pad_token_id if source.pad_token_id is not None else source.eos_token_id


def left_padded(rows: list[list[int]], pad: int, labels: Optional[list[list[int]]] = None) -> dict:
    """`input_ids`, `attention_mask` (and `labels`, IGNORE_INDEX on padding) `[B, L]`, padded on the left as
    generation wants."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [B, L]
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [B, L]
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if labels is not None:
        out["labels"] = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for i, row in enumerate(labels):
            out["labels"][i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
    return out


def extended_mask(mask: torch.Tensor, num_prompt: int) -> torch.Tensor:
    ones = mask.new_ones(mask.shape[0], num_prompt)
    return torch.cat([ones, mask], dim=1)  # [B, N+L]


def positions(mask: torch.Tensor, offset) -> torch.Tensor:
    """Position ids for a sequence whose first real token sits at `offset` (an int or one per row, `[B]`): each token
    takes `offset + (real tokens before it)`, padding its neighbour's, which attention never reads."""
    real_before = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, S]
    offset = torch.as_tensor(offset, device=mask.device)
    return real_before + (offset[:, None] if offset.dim() else offset)  # [B, S]


def prompted_positions(mask: torch.Tensor, num_prompt: int) -> torch.Tensor:
    """Position ids for `[prompt; text]`: the prompt's `0..N-1`, then the text's from `N`."""
    prompt = torch.arange(num_prompt, device=mask.device).expand(mask.shape[0], num_prompt)  # [B, N]
    return torch.cat([prompt, positions(mask, num_prompt)], dim=1)  # [B, N+L]


def prefixed_labels(labels: Optional[torch.Tensor], count: int) -> Optional[torch.Tensor]:
    """Labels for `count` leading prompt positions are ignored; the last of them still predicts text token 0."""
    if labels is None or count == 0:
        return labels
    pad = labels.new_full((labels.shape[0], count), IGNORE_INDEX)
    return torch.cat([pad, labels], dim=1)  # [B, count+L]


def targets(labels: torch.Tensor, prompted: torch.Tensor) -> torch.Tensor:
    """How many labels the loss averages over: every label of a prompted row (its last prompt position predicts label
    0), labels 1.. of a row without a prompt. At least 1, so a batch with no target gives a zero loss, not NaN."""
    counted = labels != IGNORE_INDEX  # [B, L]
    counted[:, 0] &= prompted.to(labels.device)
    return counted.sum().clamp(min=1)


def last_real_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token, for pooling under left or right padding."""
    length = mask.shape[1]
    idx = torch.arange(length, device=mask.device).expand_as(mask)  # [B, L]
    return torch.where(mask.bool(), idx, torch.full_like(idx, -1)).max(dim=1).values.clamp(min=0)  # [B]


def max_positions(config) -> Optional[int]:
    """The model's position limit: `n_positions` (GPT-2 style) or `max_position_embeddings`; None (ALiBi) for none."""
    for name in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def check_fits(num_prompt: int, length: int, max_positions: Optional[int]) -> None:
    if max_positions is not None and num_prompt + length > max_positions:
        raise ValueError(
            f"The prompt (num_virtual_tokens N={num_prompt}) plus the text (L={length} tokens) needs "
            f"{num_prompt + length} positions, but the model has {max_positions} positions. Truncate the text to "
            f"at most {max_positions - num_prompt} tokens or use fewer virtual tokens."
        )
