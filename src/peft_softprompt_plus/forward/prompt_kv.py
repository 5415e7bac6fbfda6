"""One forward's prompt keys/values (`PromptKV`): recorded by the prompt pass, read by every attention layer, with
the masks and unpadding the layers share (built once per forward, not per layer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from . import flash

_ALIGN = 16  # elements: the row alignment CUDA's memory-efficient attention wants of a mask (else it pads a copy)


@dataclass
class PromptKV:
    """One forward's prompt keys/values for every attention layer, and which rows read which prompt.

    `layers[module]` holds `([A, Hkv, N, hd], [A, Hkv, N, hd])` for A prompts of at most N positions; prompt `a` has
    `lengths[a]` real positions (the rest is padding no query reads). `rows[b]` is the prompt row `b` reads (-1: none);
    None means every row reads prompt 0. `query_offset` is the index of the first query in the text (decode steps);
    `positions` `[B, q]` are the queries' position ids, which count real tokens only (a sliding window measures the
    prompt-to-text distance with them, so left padding never pushes the prompt out of a window). `starts[a]` is the
    position the text takes after prompt `a` (None: its length; a KV prompt may record a later one).
    """

    lengths: torch.Tensor  # [A]
    rows: Optional[torch.Tensor] = None  # [B]
    capturing: bool = False
    query_offset: int = 0
    layers: dict = field(default_factory=dict)
    positions: Optional[torch.Tensor] = None  # [B, q]
    kernels: set = field(default_factory=set)  # which attention ran, for the record: see `_attention_function`
    starts: Optional[torch.Tensor] = None  # [A]
    # [B, N] bool: prompt positions each row may read, or [B, layers, Hkv, N] per entry (None: all; kv_regularize)
    keep: Optional[torch.Tensor] = None
    _masks: dict = field(default_factory=dict)
    _layer_index: dict = field(default_factory=dict)

    @classmethod
    def stack(cls, parts: list["PromptKV"], rows: Optional[torch.Tensor]) -> "PromptKV":
        """One `PromptKV` over several (right-padded to the longest), in order, read by `rows`."""
        starts = torch.cat([kv.text_starts for kv in parts])  # [A]
        if len(parts) == 1:
            return cls(parts[0].lengths, rows, layers=parts[0].layers, starts=starts)
        width = max(kv.max_length for kv in parts)

        def padded(tensors):  # each [A_i, Hkv, N_i, hd] -> [A, Hkv, N, hd]
            return torch.cat([nn.functional.pad(t, (0, 0, 0, width - t.shape[2])) for t in tensors])

        layers = {
            module: (padded([kv.layers[module][0] for kv in parts]), padded([kv.layers[module][1] for kv in parts]))
            for module in parts[0].layers
        }
        return cls(torch.cat([kv.lengths for kv in parts]), rows, layers=layers, starts=starts)

    def split(self) -> list["PromptKV"]:
        """One `PromptKV` per prompt (views), to interleave with others in `stack`."""
        return [
            PromptKV(
                self.lengths[a : a + 1],
                layers={m: (k[a : a + 1], v[a : a + 1]) for m, (k, v) in self.layers.items()},
                starts=self.text_starts[a : a + 1],
            )
            for a in range(self.lengths.shape[0])
        ]

    @property
    def text_starts(self) -> torch.Tensor:
        """`[A]` the position the text takes after each prompt."""
        return self.lengths if self.starts is None else self.starts

    def row_starts(self, batch: int, device) -> torch.Tensor:
        """`[B]` the position each row's text starts at (0 for a row without a prompt)."""
        starts = self.text_starts.to(device)
        if self.rows is None:
            return starts.expand(batch)
        return torch.where(self.rows_mask(batch, device), self.for_rows(starts, batch), 0)

    def row_lengths(self, batch: int, device) -> torch.Tensor:
        """`[B]` prompt positions each row reads (0 for a row without a prompt)."""
        lengths = self.lengths.to(device)
        if self.rows is None:
            return lengths.expand(batch)
        return torch.where(self.rows_mask(batch, device), self.for_rows(lengths, batch), 0)

    def at(self, query_offset: int, positions: Optional[torch.Tensor] = None) -> "PromptKV":
        """The same prompt keys/values for a forward whose first query sits at `query_offset` (a decode step), its
        queries at `positions` `[B, q]`, with a kernel record of its own (a stored pass serves calls on several
        threads at once)."""
        return PromptKV(self.lengths, self.rows, False, query_offset, self.layers, positions, starts=self.starts)

    def for_rows(self, tensor: torch.Tensor, batch: int) -> torch.Tensor:
        return gather_rows(tensor, self.rows, batch)

    def mask(
        self, text_mask, query: torch.Tensor, key: torch.Tensor, window: Optional[int], additive: bool, module=None
    ):
        """`[b, 1, q, N+kv]`: the prompt's columns in front of the text's mask (bool, or additive as transformers
        builds it for eager), once per forward for each distinct text mask (layers share it). `additive`: in the form
        a kernel takes without converting it per call, 0 or the dtype's lowest in the query's dtype, its rows
        16-element aligned (a view into a padded buffer, so CUDA's memory-efficient kernel needn't pad it again);
        else bool, True = attend (the split form). Under a per-entry `keep` the mask is `module`'s layer's own,
        `[b, H, q, N+kv]` (query head h reads key/value head h // (H / Hkv), as transformers' `repeat_kv`)."""
        layer = self.layer_of(module) if self.keep is not None and self.keep.dim() == 4 else None
        text_id = id(text_mask) if text_mask is not None else None
        cache_key = (text_id, query.shape[2], key.shape[2], window, additive, layer)
        if cache_key not in self._masks:
            self._masks[cache_key] = self._build_mask(text_mask, query, key, window, additive, layer)
        return self._masks[cache_key]

    def layer_of(self, module) -> int:
        """`module`'s index among the attention layers, in the order a forward calls them (a per-entry mask's axis)."""
        if not self._layer_index:
            self._layer_index.update({m: i for i, m in enumerate(self.layers)})
        return self._layer_index[module]

    def unpadded(self, text_valid: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor) -> tuple:
        """For the varlen kernel: which of `[prompt; text]` keys are real, `[B, N+kv]` bool (each row's prompt
        positions, then `text_valid` `[B, kv]`, None: all), and their unpadding (`flash.unpad`); once per forward for
        each distinct text mask (layers share it). `key` is the concatenated `[B, Hkv, N+kv, hd]`."""
        batch, q, total = query.shape[0], query.shape[2], key.shape[2]
        cache_key = ("unpad", id(text_valid) if text_valid is not None else None, batch, q, total)
        if cache_key not in self._masks:
            device, width = query.device, self.max_length
            prompt = torch.arange(width, device=device) < self.row_lengths(batch, device)[:, None]  # [B, N]
            if text_valid is None:
                text_valid = torch.ones(batch, total - width, dtype=torch.bool, device=device)
            valid = torch.cat([prompt, text_valid], dim=1)  # [B, N+kv]
            self._masks[cache_key] = valid, flash.unpad(valid, q)
        return self._masks[cache_key]

    def blocked(self, mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """`~mask` as `[b, 1, 1, q, N+kv]` (or per head, `[b, Hkv, G, q, N+kv]`), for the split form's grouped
        scores; once per forward."""
        cache_key = ("blocked", id(mask))
        if cache_key not in self._masks:
            b, heads, q, columns = mask.shape
            grouped = mask[:, :, None] if heads == 1 else mask.view(b, kv_heads, heads // kv_heads, q, columns)
            self._masks[cache_key] = ~grouped
        return self._masks[cache_key]

    def _build_mask(self, text_mask, query, key, window, additive, layer: Optional[int] = None):
        device, (batch, q, kv), width = query.device, (query.shape[0], query.shape[2], key.shape[2]), self.max_length
        t = torch.arange(q, device=device) + self.query_offset  # [q] each query's index in the text
        if text_mask is None:  # sdpa skipped an all-causal mask: the text part is causal (and windowed)
            s = torch.arange(kv, device=device) + (self.query_offset + q - kv)  # [kv] each text key's index
            allowed = (s[None] <= t[:, None]) & ((t[:, None] - s[None] < window) if window else True)
            text = allowed[None, None]  # [1, 1, q, kv]
        else:
            text = text_mask if text_mask.dtype == torch.bool else text_mask == 0  # [b, 1, q, kv] True = attend
        lengths = self.lengths.to(device) if self.rows is None else self.row_lengths(batch, device)  # [1] or [B]
        j = torch.arange(width, device=device)  # [N] prompt key index
        prompt = j[None, None, None, :] < lengths[:, None, None, None]  # [b', 1, 1, N]
        if self.keep is not None and layer is None:  # training's per-row regularisers: positions a row may not read
            prompt = prompt & self.keep.to(device)[:, None, None, :width]  # [B, 1, 1, N]
        elif self.keep is not None:  # per entry: this layer's own, each key/value head's read by its query heads
            own = self.keep[:, layer].to(device)[..., :width]  # [B, Hkv, N]
            own = own.repeat_interleave(query.shape[1] // own.shape[1], dim=1)  # [B, H, N]
            prompt = prompt & own[:, :, None, :]  # [B, H, 1, N]
        if window:
            # Prompt key j is inside a query's window when their distance is < W; a query's position id is its
            # distance from the prompt's start counting real tokens only (as in the row alone). Without position
            # ids, query t sits at index length + t.
            if self.positions is not None:
                distance = self.positions.to(device)[:, None, :, None] - j  # [B, 1, q, N]
            else:
                distance = lengths[:, None, None, None] + t[None, None, :, None] - j  # [b', 1, q, N]
            prompt = prompt & (distance < window)
        rows, heads = max(prompt.shape[0], text.shape[0]), prompt.shape[1]
        allowed = torch.cat(
            [prompt.expand(rows, heads, q, width), text.expand(rows, heads, q, kv)], dim=-1
        )  # [b, 1 or H, q, N+kv]
        if not additive:
            return allowed
        columns = allowed.shape[-1]
        buffer = torch.zeros(rows, heads, q, -(-columns // _ALIGN) * _ALIGN, dtype=query.dtype, device=device)
        return buffer[..., :columns].masked_fill_(~allowed, torch.finfo(query.dtype).min)  # [b, 1|H, q, N+kv] view

    def rows_mask(self, batch: int, device) -> torch.Tensor:
        rows = self.rows.to(device)
        return (rows >= 0).repeat_interleave(batch // rows.shape[0])  # [batch]

    @property
    def max_length(self) -> int:
        return next(iter(self.layers.values()))[0].shape[2]


def gather_rows(values: torch.Tensor, rows: Optional[torch.Tensor], batch: int) -> torch.Tensor:
    """`[A, ...]` -> `[batch, ...]`: row b reads `values[rows[b]]` (-1, a row without a prompt, reads entry 0, which
    callers mask); `batch` may be a multiple of `len(rows)` (beams, `num_return_sequences`). `rows=None`: every row
    reads entry 0, as a view (no copy until the kernel's cat)."""
    if rows is None:
        return values.expand(batch, *values.shape[1:])
    rows = rows.to(values.device).clamp(min=0)
    return values.index_select(0, rows.repeat_interleave(batch // rows.shape[0]))
