"""A KV prompt started from demonstrations (`prompt_init='demonstrations'`, context tuning): k training rows, each
tokenized alone and followed by the separator, run once through the frozen model; the context's keys/values are the
start, each kept position where it was computed (`kv_text_start` = the context's length). The config records each
demonstration's ids and its span among the kept positions, which leave-one-out reads (forward/kv_regularize.py).
`pick_demonstrations` picks k of a task's rows."""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..forward import semantics
from ..forward.kv_pass import KVLayout
from ..forward.windows import smallest_window
from . import kv_select
from .enums import KVSelection
from .prompt_init import load_tokenizer

Config = Any  # a SoftPromptPlusConfig


def _context(config: Config, tokenizer) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """The joined context's ids, each demonstration's ids, and each one's `[start, end)` in the context."""
    separator = tokenizer(config.demonstration_separator, add_special_tokens=False)["input_ids"]
    ids, demos, spans = [], [], []
    for i, text in enumerate(config.prompt_init_texts):
        own = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not own:
            raise ValueError(
                f"`prompt_init_texts`[{i}]={text!r} tokenizes to no tokens: drop it, or write the demonstration out."
            )
        spans.append([len(ids), len(ids) + len(own)])
        demos.append(list(own))
        ids += own + separator
    return ids, demos, spans


def _check_fits(config: Config, model: nn.Module, length: int) -> None:
    limit = semantics.max_positions(model.config)
    if limit is not None and length >= limit:
        raise ValueError(
            f"`prompt_init_texts` join to {length} tokens, and {type(model).__name__} reads {limit} positions: no "
            "room for text after them. Pass fewer or shorter demonstrations."
        )
    window = smallest_window(model.config)
    if window and length >= window:
        raise ValueError(
            f"`prompt_init_texts` join to {length} tokens, and {type(model).__name__}'s sliding window is {window}: a "
            "row after them would read none of the first demonstrations. Pass fewer or shorter demonstrations."
        )
    n = config.num_virtual_tokens
    if n is not None and n > length:
        raise ValueError(
            f"`num_virtual_tokens`={n} is more than the demonstrations' {length} positions; pass at most {length}, "
            "or None for all of them."
        )
    if config.kv_selection == KVSelection.PER_HEAD.value and n is not None and n >= length:
        raise ValueError(
            f"`kv_selection='per_head'` keeps N of the demonstrations' {length} positions per layer and head, got "
            f"num_virtual_tokens={n}: nothing to choose. Pass an N below {length}, or kv_selection='shared'."
        )


def resolve(config: Config, model: nn.Module) -> list[int]:
    """At attach: the context's ids; the config's `demonstration_ids`, N (None: all) and `kv_text_start` filled
    (`demonstration_spans` once the positions are kept). Every problem is raised before a value is computed."""
    ids, demos, spans = _context(config, load_tokenizer(config, "`prompt_init='demonstrations'`"))
    vocab = model.get_input_embeddings().num_embeddings
    if max(ids) >= vocab:
        raise ValueError(
            f"`tokenizer_name_or_path`={config.tokenizer_name_or_path!r} gives ids up to {max(ids)} for "
            f"`prompt_init_texts`, outside the model's vocabulary of {vocab}: the tokenizer does not belong to it."
        )
    _check_fits(config, model, len(ids))
    config.demonstration_ids, config.demonstration_spans = demos, spans
    if config.num_virtual_tokens is None:
        config.num_virtual_tokens = len(ids)
    if config.kv_text_start is None:
        config.kv_text_start = len(ids)
    return ids


def kept_spans(spans: list[list[int]], kept: torch.Tensor) -> list[list[int]]:
    """Each span `[start, end)` of the context as a span among the kept positions `kept` (sorted context indices):
    a demonstration's kept positions stay contiguous, as the selection keeps their order."""
    out = []
    for start, end in spans:
        inside = ((kept >= start) & (kept < end)).nonzero().flatten()  # [m]
        first = int(inside[0]) if inside.numel() else int((kept < start).sum())
        out.append([first, first + int(inside.numel())])
    return out


def initial_values(
    config: Config, model: nn.Module, layout: KVLayout, owner, run_once
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The start: the context's `[layers, 2, Hkv, P, hd]` keys/values, all P positions or the N that the
    demonstrations, each read again after the whole context, attend to most (whole positions, or per layer and head
    with `kv_selection='per_head'`); and with 'per_head' each entry's origin, `[layers, Hkv, N]` context positions."""
    ids = resolve(config, model)
    embedding = model.get_input_embeddings()
    rows = embedding(torch.tensor(ids, device=embedding.weight.device))  # [P, D]
    values = run_once(model, rows, layout)  # [layers, 2, Hkv, P, hd]
    if config.num_virtual_tokens == len(ids):
        return values, None
    readers = [(demo, 0) for demo in config.demonstration_ids]
    scores = kv_select.attention_received(model, owner, ids, readers, layout)  # [layers, Hkv, P]
    sink = range(config.kv_frozen_positions or 0)
    if config.kv_selection == KVSelection.PER_HEAD.value:
        positions = kv_select.per_head_positions(scores, config.num_virtual_tokens, sink)  # [layers, Hkv, N]
        return kv_select.gathered(values, positions), positions.long().cpu()  # spans stay the context's
    kept = kv_select.shared_positions(scores, config.num_virtual_tokens, sink)  # [N]
    config.demonstration_spans = kept_spans(config.demonstration_spans, kept)
    return kv_select.gathered(values, kept), None


def pick_demonstrations(
    rows: Sequence[Any], k: int, seed: int = 0, labels: Optional[Sequence[Any]] = None
) -> list[int]:
    """The indices of `k` of `rows`, a seeded draw: with `labels` (one per row), one row of each label first (as
    many labels as `k` allows), then the rest of the draw. Whether the picked rows stay among the
    training rows is the caller's choice."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(rows):
        raise ValueError(f"`k` must be an int in [1, len(rows)] = [1, {len(rows)}], got {k!r}.")
    if labels is not None and len(labels) != len(rows):
        raise ValueError(f"`labels` must hold one label per row ({len(rows)}), got {len(labels)}.")
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    first: list[int] = []
    if labels is not None:
        seen: dict = {}
        for i in order:
            seen.setdefault(labels[i], i)
        first = list(seen.values())[:k]
    rest = [i for i in order if i not in set(first)]
    return first + rest[: k - len(first)]
