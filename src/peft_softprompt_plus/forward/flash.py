"""The flash path: a model loaded with `flash_attention_2` or `flash_attention_3` keeps flash while a prompt is
attached. flash-attn (>= 2.1) aligns `causal=True` to the lower right when a sequence has more keys than queries, so
`[prompt; text]` keys with the text's queries are our pattern exactly: every prompt key, then causal text. One prompt
and no padding runs the dense kernel; padding or per-row prompts run the varlen kernel over each row's real prompt
positions and real text, unpadded once per forward. Which kernel package a model named is transformers' own mapping;
this module only reads the packages' public functions, so a pure-torch stand-in checks it on a CPU."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Optional

import torch
from torch import nn

# The model's implementation -> the package that holds its kernels (`flash_attn_func`, `flash_attn_varlen_func`)
LIBRARIES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def library_for(implementation: Optional[str]) -> Optional[str]:
    """The kernel package for `implementation` when it is one of `LIBRARIES` and imports, else None (sdpa then)."""
    library = LIBRARIES.get(implementation or "")
    if library is None:
        return None
    try:
        importlib.import_module(library)
    except ImportError:
        return None
    return library


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _call(fn, *args, **options):
    # flash_attn_interface (FA3) takes no `dropout_p` and may return `(out, lse)`: pass what the kernel names.
    taken = _parameters(fn)
    refused = [name for name, value in options.items() if name not in taken and value]
    if refused:
        raise NotImplementedError(f"{fn.__module__}.{fn.__name__} takes no {refused}; use sdpa for this model.")
    out = fn(*args, **{name: value for name, value in options.items() if name in taken})
    return out[0] if isinstance(out, tuple) else out


def attention(library: str, module: nn.Module, query, key, value, key_valid, kwargs: dict, unpadded=None):
    """Causal attention aligned to the lower right with the kernels of `library`. `query` `[B, H, q, hd]`; `key`,
    `value` `[B, Hkv, K, hd]`, K >= q; `key_valid` `[B, K]` bool (None: every key, the dense kernel), whose last q
    columns say which queries are real. `unpadded`: `key_valid`'s indices from `unpad`, shared by the layers.
    Returns `([B, q, H, hd], None)`, zeros at padded queries (as transformers' flash path leaves them)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (`s_aux`) with a soft prompt: use sdpa for this model.")
    window = kwargs.get("sliding_window")
    options = {
        "softmax_scale": kwargs.get("scaling"),
        "causal": True,
        "window_size": (window - 1, 0) if window else None,  # key j is read when the query's distance to it < W
        "softcap": kwargs.get("softcap") or None,
        "dropout_p": kwargs.get("dropout") or None,
    }
    options = {name: value for name, value in options.items() if value is not None}
    batch, q = query.shape[0], query.shape[2]
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H(kv), hd]
    target = _half_dtype(query, module)
    if target is not None:
        query, key, value = query.to(target), key.to(target), value.to(target)
    package = importlib.import_module(library)
    if key_valid is None:
        return _call(package.flash_attn_func, query, key, value, **options), None  # [B, q, H, hd]
    q_index, k_index, cu_q, cu_k, max_q, max_k = unpadded if unpadded is not None else unpad(key_valid, q)
    out = _call(
        package.flash_attn_varlen_func,
        query.flatten(0, 1).index_select(0, q_index),  # [Tq, H, hd]
        key.flatten(0, 1).index_select(0, k_index),  # [Tk, Hkv, hd]
        value.flatten(0, 1).index_select(0, k_index),
        cu_q,
        cu_k,
        max_q,
        max_k,
        **options,
    )  # [Tq, H, hd]
    full = out.new_zeros(batch * q, *out.shape[1:]).index_copy(0, q_index, out)
    return full.view(batch, q, *out.shape[1:]), None  # [B, q, H, hd]


def _half_dtype(query: torch.Tensor, module: nn.Module) -> Optional[torch.dtype]:
    """Flash takes half precision: a float32 query (a layer norm kept in float32) is cast to the autocast dtype, or
    the dtype the layer's weights are in (a quantized model's config dtype). None: leave it. transformers' helper
    for this looks for `nn.Linear` only, which GPT-2's `Conv1D` layers are not."""
    if query.dtype != torch.float32:
        return None
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    if hasattr(module.config, "_is_quantized"):
        return module.config.dtype
    weight = next((p for p in module.parameters() if p.dim() == 2), None)
    return weight.dtype if weight is not None and weight.dtype != torch.float32 else None


def unpad(key_valid: torch.Tensor, q: int) -> tuple:
    """`key_valid` `[B, K]` -> the real queries' and keys' flat indices, their cumulative lengths `[B+1]` (int32) and
    longest row, as the varlen kernel takes them. The queries are the last `q` key positions of each row."""

    def flat(valid):  # [B, S] bool
        lengths = valid.sum(dim=1, dtype=torch.int32)  # [B]
        cumulative = nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # [B+1]
        return valid.flatten().nonzero().squeeze(1), cumulative, int(lengths.max())

    q_index, cu_q, max_q = flat(key_valid[:, -q:])
    k_index, cu_k, max_k = flat(key_valid)
    return q_index, k_index, cu_q, cu_k, max_q, max_k
