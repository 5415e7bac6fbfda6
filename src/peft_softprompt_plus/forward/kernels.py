"""The two ways our attention reads the prompt other than one explicit mask over concatenated keys: the lower-right
causal bias (one prompt, no padding: no mask tensor, so a GPU can run the flash kernel) and the split decode step
(the prompt's scores from one product with the single prompt copy). `attention.py` chooses, per layer call."""

from __future__ import annotations

import torch
from torch import nn


def lower_right_fits(prompt_kv, query, key, attention_mask, window, kwargs) -> bool:
    """One prompt for every row, no padding (sdpa skipped the mask), the whole text as queries, no window the prompt
    could fall out of: then the pattern needs no mask tensor (`lower_right`)."""
    q, kv = query.shape[2], key.shape[2]
    return (
        prompt_kv.rows is None
        and prompt_kv.keep is None
        and attention_mask is None
        and prompt_kv.query_offset == 0
        and q == kv
        and q > 1
        and (window is None or window > prompt_kv.max_length + kv)
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions")
    )


def lower_right(query, key, value, kwargs):
    """`[prompt; text]` attention without a mask tensor: with one prompt and no padding, key j is visible to query i
    iff j <= i + N, the causal pattern aligned to the lower right. On CUDA SDPA runs it with the flash kernel (with
    autograd); on the CPU it builds the same mask as the explicit path. `query` `[B, H, q, hd]`; `key`, `value`
    `[B, Hkv, N+q, hd]`, the prompt's in front. Returns the kernel's `([B, q, H, hd], None)`, or None where the bias
    can't be made (under a TorchDispatchMode: a FLOP counter, a memory watcher), for the mask path."""
    from torch.nn.attention.bias import causal_lower_right

    heads, q = query.shape[1], query.shape[2]
    try:
        bias = causal_lower_right(q, key.shape[2])
    except RuntimeError:  # "Creating a new Tensor subclass CausalBias ..." inside a dispatch mode
        return None
    if key.shape[1] != heads:  # GQA: the bias takes no `enable_gqa`, so the key/value heads are repeated
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    out = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling")
    )  # [B, H, q, hd]
    return out.transpose(1, 2).contiguous(), None


def split_attention(prompt_kv, query, prompt: tuple, text: tuple, mask, scaling):
    """Softmax attention over `[prompt; text]` keys without building them: the prompt's scores come from one batched
    product of every row's queries with the single prompt copy (Hydragen's split); one softmax covers both parts.

    `query` `[B, H, q, hd]`; `prompt` `[A, Hkv, N, hd]` pair; `text` `[B, Hkv, kv, hd]` pair; `mask` bool
    `[b, 1, q, N+kv]` (or `[b, H, q, N+kv]` per head). Returns the kernel's `([B, q, H, hd], None)`.
    """
    (prompt_k, prompt_v), (key, value) = prompt, text
    batch, heads, q, dim = query.shape
    kv_heads, width = key.shape[1], prompt_k.shape[2]
    rows = heads // kv_heads * q  # query rows per key/value head (GQA groups x queries)
    grouped = query.reshape(batch, kv_heads, rows, dim)  # [B, Hkv, G*q, hd]

    def times_prompt(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:  # [B, Hkv, G*q, .] @ [A, Hkv, ., .]
        if prompt_kv.rows is not None:
            return left @ prompt_kv.for_rows(right, batch)  # per-row prompts: a gathered copy each
        folded = left.transpose(0, 1).reshape(kv_heads, batch * rows, left.shape[-1])  # [Hkv, B*G*q, .]
        return (folded @ right[0]).view(kv_heads, batch, rows, -1).transpose(0, 1)  # [B, Hkv, G*q, .]

    scale = scaling if scaling is not None else dim**-0.5
    scores = torch.cat([times_prompt(grouped, prompt_k.transpose(-1, -2)), grouped @ key.transpose(-1, -2)], dim=-1)
    scores = scores.view(batch, kv_heads, -1, q, scores.shape[-1])  # [B, Hkv, G, q, N+kv]
    # The dtype's lowest value, not -inf, as in eager attention: a query that may attend to nothing (a left pad of
    # a row without a prompt) gets finite weights instead of NaN that its value would spread.
    blocked = prompt_kv.blocked(mask, kv_heads)  # [b, 1|Hkv, 1|G, q, N+kv]
    scores = scores.float().mul_(scale).masked_fill_(blocked, torch.finfo(torch.float32).min)
    weights = scores.softmax(dim=-1).to(value.dtype).reshape(batch, kv_heads, rows, -1)
    out = times_prompt(weights[..., :width], prompt_v) + weights[..., width:] @ value  # [B, Hkv, G*q, hd]
    return out.reshape(batch, heads, q, dim).transpose(1, 2), None  # [B, q, H, hd]
