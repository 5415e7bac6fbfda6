"""Per-row masks over KV prompt positions while training, context tuning's regularisers: leave-one-out (a row that is
one of an adapter's demonstrations reads none of that demonstration's positions) and position dropout (each position
dropped for each row with probability `kv_position_dropout`); frozen positions are never masked. Only while training
(the model in training mode, gradients on), never in the gradient probe: eval and `generate` read every position.
Built once per forward into the `PromptKV` (`keep`), so a checkpointed layer's recomputation reads the same mask.

An adapter whose positions were chosen per layer and key/value head (`kv_selection='per_head'`) is masked per entry:
the mask gains those axes, `[B, layers, Hkv, N]`, and leave-one-out reads each entry's origin (its context position)
against the demonstration's span in the context."""

from __future__ import annotations

from typing import Optional

import torch

from . import routing


def _indices(demonstration_index, batch: int, device) -> Optional[torch.Tensor]:
    """The `demonstration_index` column as `[B]` long (-1: not a demonstration), checked; None when not given."""
    if demonstration_index is None:
        return None
    index = torch.as_tensor(demonstration_index, device=device)
    if index.dtype.is_floating_point or index.dtype == torch.bool or index.shape != (batch,):
        raise ValueError(
            f"`demonstration_index` must hold one int per row ({batch}; -1: not a demonstration), got "
            f"{type(demonstration_index).__name__} of shape {tuple(index.shape)} and dtype {index.dtype}."
        )
    return index.long()


def _matched(own: dict, ids: Optional[torch.Tensor], mask: Optional[torch.Tensor], b: int) -> int:
    """Which demonstration row `b`'s real ids are (`own`: ids -> index; -1: none, or no ids to compare)."""
    if ids is None:
        return -1
    real = ids[b] if mask is None else ids[b][mask[b].bool()]
    return own.get(tuple(real.tolist()), -1)


def _regularising(tuner, entry) -> bool:
    """Whether adapter `entry` masks anything while training (a single KV adapter with spans or dropout)."""
    if isinstance(entry, tuple) or not tuner.is_kv(entry):
        return False  # an input prompt or a composition: nothing to mask
    config = tuner.peft_config[entry]
    return bool((config.demonstration_spans and config.kv_leave_one_out) or config.kv_position_dropout)


def _owners(config, origins: torch.Tensor) -> torch.Tensor:
    """`[layers, Hkv, N]` the demonstration each entry came from (-1: a separator or a BOS), from its origin and the
    demonstrations' spans in the context."""
    owner = torch.full_like(origins, -1)
    for i, (start, end) in enumerate(config.demonstration_spans):
        owner[(origins >= start) & (origins < end)] = i
    return owner


def _per_entry(tuner, regularising: set, route) -> bool:
    return any(route.adapters[a] in tuner.prompt_bank.origins for a in regularising)


def row_keep(tuner, route: routing.Route, input_ids, attention_mask, demonstration_index, width: int, batch: int):
    """The prompt entries each row reads while training: `[B, width]` bool (whole positions), `[B, layers, Hkv,
    width]` where a row's adapter was chosen per head; None (every entry: not training, or no row's adapter
    regularises)."""
    device = tuner.model.get_input_embeddings().weight.device
    index = _indices(demonstration_index, batch, device)
    if not (tuner.model.training and torch.is_grad_enabled() and tuner.forward_state.regularizing):
        return None
    regularising = {a for a, entry in enumerate(route.adapters) if _regularising(tuner, entry)}
    if not regularising:  # the common training step: no per-row work
        return None
    rows = route.rows.tolist() if route.rows is not None else [0] * batch  # -1: a row without a prompt
    layout = tuner.forward_state.kv_layout
    entries = (len(layout.modules), layout.heads) if _per_entry(tuner, regularising, route) else ()
    keep = torch.ones(batch, *entries, width, dtype=torch.bool, device=device)  # [B, (layers, Hkv,) width]
    draws, tables, owners, matched, unmatched = {}, {}, {}, 0, 0
    for b, a in enumerate(rows):
        if a not in regularising:
            continue
        entry = route.adapters[a]
        config = tuner.peft_config[entry]
        origins = tuner.prompt_bank.origins[entry] if entry in tuner.prompt_bank.origins else None
        frozen, n = config.kv_frozen_positions or 0, config.num_virtual_tokens
        spans = config.demonstration_spans if config.kv_leave_one_out else None
        if spans:
            if index is None and a not in tables:  # ids -> demonstration, once per adapter and forward
                tables[a] = {tuple(d): i for i, d in enumerate(config.demonstration_ids)}
            i = int(index[b]) if index is not None else _matched(tables[a], input_ids, attention_mask, b)
            if not -1 <= i < len(spans):
                raise ValueError(
                    f"`demonstration_index`[{b}]={i} is out of range for adapter {entry!r}, which holds "
                    f"{len(spans)} demonstrations: pass -1 (not a demonstration) or 0..{len(spans) - 1}."
                )
            matched, unmatched = matched + (i >= 0), unmatched + (i < 0)
            if i >= 0 and origins is not None:
                if a not in owners:
                    owners[a] = _owners(config, origins.to(device))  # [layers, Hkv, N]
                keep[b, ..., :n] &= owners[a] != i
            elif i >= 0:
                keep[b, ..., spans[i][0] : spans[i][1]] = False
            keep[b, ..., :frozen] = True  # a frozen sink is read by every row
        if config.kv_position_dropout:
            shape = keep.shape[1:] if origins is not None else (width,)  # per entry, or per whole position
            if shape not in draws:  # one draw per forward and shape
                draws[shape] = torch.rand(batch, *shape, device=device)
            kept = draws[shape][b, ..., frozen:n] >= config.kv_position_dropout
            keep[b, ..., frozen:n] &= kept
    tuner.forward_state.count_leave_one_out(matched, unmatched)
    return keep
