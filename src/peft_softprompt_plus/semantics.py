"""The exact prompted semantics as tensors: extended attention mask, position ids, prefixed labels.

The prompt occupies positions `0..N-1`; text token `i` sits at `N + (real tokens before it)`, so left or right
padding never moves a real token.
"""

from __future__ import annotations

from typing import Callable, Optional

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


# How each attention implementation reads a ready 4-D mask (transformers passes 4-D masks through untouched):
# sdpa takes booleans (True = attend), eager adds the mask to the scores. Others get the 2-D mask instead.
_SHARED_MASK_FORMS: dict[str, Callable[[torch.Tensor, torch.dtype], torch.Tensor]] = {
    "sdpa": lambda allowed, dtype: allowed,
    "eager": lambda allowed, dtype: torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    ),
}


def shared_mask(
    cached: int, queries: int, attn_implementation: Optional[str], dtype: torch.dtype, device
) -> Optional[torch.Tensor]:
    """One causal mask `[1, 1, queries, cached+queries]` for unpadded rows, or None for an unknown implementation.

    Rows without padding see the same pattern, so one small mask serves the batch instead of the `[B, 1, q, k]`
    one that attention would otherwise build (and, for sdpa, convert and keep for backward in every layer).
    """
    form = _SHARED_MASK_FORMS.get(attn_implementation)
    if form is None:
        return None
    allowed = torch.ones(queries, cached + queries, dtype=torch.bool, device=device).tril(diagonal=cached)  # [q, k]
    return form(allowed, dtype)[None, None]  # [1, 1, q, k]


def positions(mask: torch.Tensor, num_prompt: int) -> torch.Tensor:
    """Position ids for `[prompt; text]`; padding takes its neighbour's position, which attention never reads."""
    batch = mask.shape[0]
    real_before = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, L]
    prompt = torch.arange(num_prompt, device=mask.device).expand(batch, num_prompt)  # [B, N]
    return torch.cat([prompt, real_before + num_prompt], dim=1)  # [B, N+L]


def prefixed_labels(labels: Optional[torch.Tensor], count: int) -> Optional[torch.Tensor]:
    """Labels for `count` leading prompt positions are ignored; the last of them still predicts text token 0."""
    if labels is None or count == 0:
        return labels
    pad = labels.new_full((labels.shape[0], count), IGNORE_INDEX)
    return torch.cat([pad, labels], dim=1)  # [B, count+L]


def last_real_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token, for pooling under left or right padding."""
    length = mask.shape[1]
    idx = torch.arange(length, device=mask.device).expand_as(mask)  # [B, L]
    return torch.where(mask.bool(), idx, torch.full_like(idx, -1)).max(dim=1).values.clamp(min=0)  # [B]


def check_fits(num_prompt: int, length: int, max_positions: Optional[int]) -> None:
    if max_positions is not None and num_prompt + length > max_positions:
        raise ValueError(
            f"The prompt (num_virtual_tokens N={num_prompt}) plus the text (L={length} tokens) needs "
            f"{num_prompt + length} positions, but the model has n_positions={max_positions}. Truncate the text to "
            f"at most {max_positions - num_prompt} tokens or use fewer virtual tokens."
        )
