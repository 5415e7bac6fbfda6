"""The exact prompted semantics as tensors: extended attention mask, position ids, prefixed labels.

The prompt occupies positions `0..N-1`; text token `i` sits at `N + (real tokens before it)`, so left or right
padding never moves a real token.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100


def text_mask(attention_mask: Optional[torch.Tensor], batch: int, length: int, device) -> torch.Tensor:
    """The user's 2-D mask, or all ones; validated so a wrong shape fails here rather than deep in attention."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.long, device=device)  # [B, L]
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        raise ValueError(
            f"`attention_mask` must have shape [batch, seq_len] = [{batch}, {length}] to match the inputs, got "
            f"{list(attention_mask.shape)}. 4-D masks are not supported with a soft prompt."
        )
    return attention_mask.to(device)


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
