"""Records what vLLM's own helpers give for the KV connector's rank mapping into vllm_kv_layout.json, which
test_kv_connector_core.py checks `integrations/kv_connector_core.py` against (CI can't import vLLM: it pins an older
transformers). Rerun it in the separate venv of tests/serve/_record_vllm_fields.py when the vLLM the connector is
checked against changes, and commit the JSON:

    /tmp/vllm-venv/bin/python tests/integrations/_record_vllm_kv_layout.py

Per config (total KV heads, layers, TP and PP sizes) and per global rank (vLLM's order: DP x PP x TP):
- `kv_heads`: `ModelConfig.get_num_kv_heads`, the KV heads a rank's cache holds;
- `heads`: the global KV heads a rank computes, read back from `QKVParallelLinear`'s own weight loader given a `k`
  weight whose rows say their head (the TP rank and size patched in, as vLLM's process groups would give them);
- `layers`: `ModelConfig.get_layers_start_end_indices` (vLLM's `get_pp_indices`) for that rank.
And, once: `extract_layer_index` on layer names, the CPU backend's per-layer cache shape
(`compute_layer_kv_cache_shape_bytes` of a `FullAttentionSpec`, in elements) and where its cache writer
(`cpu_attn_reshape_and_cache`, as `CPUAttentionBackendImpl.do_kv_cache_update` calls it) puts each slot's key and
value row. No engine is started.
"""

from __future__ import annotations

import json
import pathlib
import types
from unittest import mock

import torch

OUT = pathlib.Path(__file__).with_name("vllm_kv_layout.json")
# name -> (total KV heads, total layers, TP size, PP size); the tiny Llama of docs/serving.md has 2 KV heads.
CONFIGS = {
    "tp2": (2, 4, 2, 1),
    "pp2": (2, 4, 1, 2),
    "pp2_uneven": (2, 5, 1, 2),
    "one_kv_head_tp2": (1, 4, 2, 1),
    "two_kv_heads_tp4": (2, 4, 4, 1),
    "tp2_pp2": (4, 4, 2, 2),
}
NAMES = ["model.layers.0.self_attn.attn", "model.layers.13.self_attn.attn", "transformer.h.3.attn.attn", "3.attn"]
HEAD_SIZE = 32  # the CPU backend's smallest supported head size


def _heads_of_rank(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear

    patches = [
        mock.patch.object(module, name, return_value=value)
        for module in (linear, parameter)
        for name, value in (
            ("get_tensor_model_parallel_world_size", tp_size),
            ("get_tensor_model_parallel_rank", tp_rank),
        )
    ]
    for patch in patches:
        patch.start()
    try:
        heads = max(tp_size, total_kv_heads)
        layer = linear.QKVParallelLinear(8, HEAD_SIZE, total_num_heads=heads, total_num_kv_heads=total_kv_heads)
    finally:
        for patch in patches:
            patch.stop()
    # Row i of the full `k` weight belongs to KV head i // HEAD_SIZE: the rows a rank keeps name its heads.
    k_weight = torch.arange(total_kv_heads * HEAD_SIZE, dtype=torch.float32)[:, None].expand(-1, 8) // HEAD_SIZE
    layer.weight.data.fill_(-1)
    layer.weight_loader(layer.weight, k_weight.contiguous(), "k")
    start = layer.num_heads * HEAD_SIZE
    rows = layer.weight.data[start : start + layer.num_kv_heads * HEAD_SIZE, 0]
    return [int(h) for h in rows[::HEAD_SIZE]]


def _ranks(total_kv_heads: int, layers: int, tp_size: int, pp_size: int) -> list[dict]:
    from vllm.config import ModelConfig

    model = types.SimpleNamespace(
        use_mla=False,
        model_arch_config=types.SimpleNamespace(total_num_kv_heads=total_kv_heads),
        get_total_num_hidden_layers=lambda: layers,
    )
    out = []
    for rank in range(tp_size * pp_size):
        parallel = types.SimpleNamespace(
            rank=rank, tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, data_parallel_size=1
        )
        start, end = ModelConfig.get_layers_start_end_indices(model, parallel)
        out.append(
            {
                "rank": rank,
                "kv_heads": ModelConfig.get_num_kv_heads(model, parallel),
                "heads": _heads_of_rank(total_kv_heads, tp_size, rank % tp_size),
                "layers": [start, end],
            }
        )
    return out


def _cpu_cache(num_blocks: int = 3, block_size: int = 64, kv_heads: int = 2) -> dict:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

    dtype = torch.float32
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=HEAD_SIZE, dtype=dtype)
    shape = list(compute_layer_kv_cache_shape_bytes(spec, num_blocks))
    shape[-1] //= dtype.itemsize  # the registered view is in the cache dtype: [B, H, N, 2 * hd]
    cache = torch.zeros(shape, dtype=dtype)
    slots = [5, 70, 191]  # block 0 row 5, block 1 row 6, block 2 row 63
    code = torch.arange(1, HEAD_SIZE + 1, dtype=dtype)  # element d of a row holds d + 1 (+ 1000 t + 100 h)
    keys = torch.stack([torch.stack([code + 1000 * t + 100 * h for h in range(kv_heads)]) for t in range(len(slots))])
    # As do_kv_cache_update: the [B, H, N, 2 * hd] cache seen as a key half and a value half per block and head.
    key_cache, value_cache = cache.view(num_blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)
    isa = _get_attn_isa(dtype, block_size, HEAD_SIZE)
    values = -keys
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.tensor(slots), isa)
    pages = cache.view(num_blocks, kv_heads, -1)  # [B, H, 2 * N * hd]: one page per block and head
    places = {}  # "slot/head" -> the page offsets of that row's elements 0..hd-1, key and value
    for t, slot in enumerate(slots):
        for h in range(kv_heads):
            block = slot // block_size
            places[f"{slot}/{h}"] = {
                part: [int((pages[block, h] == row[d]).nonzero()[0, 0]) for d in range(HEAD_SIZE)]
                for part, row in (("key", keys[t, h]), ("value", values[t, h]))
            }
    return {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "kv_heads": kv_heads,
        "head_size": HEAD_SIZE,
        "dtype": str(dtype),
        "shape": shape,
        "isa": isa,
        "places": places,
    }


def main() -> None:
    import vllm
    from vllm.model_executor.models.utils import extract_layer_index

    record = {
        "vllm": vllm.__version__,
        "configs": {
            name: {"total_kv_heads": h, "layers": n, "tp_size": tp, "pp_size": pp, "ranks": _ranks(h, n, tp, pp)}
            for name, (h, n, tp, pp) in CONFIGS.items()
        },
        "layer_index": {name: extract_layer_index(name) for name in NAMES},
        "cpu_cache": _cpu_cache(),
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}: vLLM {vllm.__version__}, {len(CONFIGS)} configs")


if __name__ == "__main__":
    main()
