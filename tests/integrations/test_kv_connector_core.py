"""The KV connector's core (`integrations/kv_connector_core.py`) against what vLLM 0.32's own helpers give, recorded
into vllm_kv_layout.json by _record_vllm_kv_layout.py: each rank's KV heads (TP=2, one KV head at TP=2, two at TP=4)
and layers (PP=2, even and uneven), layer indices from vLLM's names, and a fake of the CPU backend's paged cache and
writer checked against vLLM's own writer. A fake engine of every rank is then filled the way the connector fills it,
and the full prompt is read back from the ranks' caches."""

import json
import pathlib
import sys
import types
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from peft_softprompt_plus._names import SAVED_KV_KEY, VLLM_KV_TENSOR
from peft_softprompt_plus.files.content_hash import content_hash
from peft_softprompt_plus.integrations import kv_connector_core as core

RECORD = json.loads(pathlib.Path(__file__).with_name("vllm_kv_layout.json").read_text())
CONFIGS = RECORD["configs"]
HEAD_SIZE, BLOCK_SIZE, POSITIONS = 8, 4, 6


def test_the_record_is_vllm_0_32():
    assert RECORD["vllm"] == "0.32.0"
    assert {"tp2", "pp2", "one_kv_head_tp2"} <= set(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_rank_holds_the_kv_heads_vllm_gives_it(name):
    config = CONFIGS[name]
    tp = config["tp_size"]
    for rank in config["ranks"]:
        heads = core.rank_heads(config["total_kv_heads"], tp, rank["rank"] % tp)  # vLLM's order: DP x PP x TP
        assert len(heads) == rank["kv_heads"] and list(heads) == rank["heads"]


def test_replicated_heads_where_there_are_fewer_kv_heads_than_ranks():
    assert [list(core.rank_heads(1, 2, r)) for r in range(2)] == [[0], [0]]
    assert [list(core.rank_heads(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    with pytest.raises(ValueError, match="`tensor_parallel_size` 4 must divide the model's 6 KV heads"):
        core.rank_heads(6, 4, 0)


def test_layer_indices_are_read_from_vllm_s_names_as_vllm_reads_them():
    assert {name: core.layer_index(name) for name in RECORD["layer_index"]} == RECORD["layer_index"]
    with pytest.raises(ValueError, match="exactly one integer"):
        core.layer_index("model.layers.attn")


def test_slots_follow_the_block_table():
    # Positions 1..5 of a request whose blocks are 7, 2, 5 (block size 4): 7*4+1.., then block 2, then block 5.
    assert core.cache_slots([7, 2, 5], 4, first=1, count=6) == [29, 30, 31, 8, 9, 10]
    assert core.blocks_of([29, 30, 31, 8, 9, 10], 4) == {7, 2}


# ---------------------------------------------------------------- a fake of vLLM for CPU's paged cache


def _cpu_cache(num_blocks: int, kv_heads: int, block_size: int = BLOCK_SIZE, head_size: int = HEAD_SIZE):
    # One layer's cache as vLLM for CPU registers it: [B, H, N, 2 * hd].
    return torch.zeros(num_blocks, kv_heads, block_size, 2 * head_size)


def _offsets(slot: int, block_size: int, head_size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(block, key offsets, value offsets) of a slot's row in its [2 * N * hd] page, as vLLM's CPU writer lays it:
    keys transposed ([hd, N]), then values row by row ([N, hd])."""
    row, d = slot % block_size, torch.arange(head_size)
    return slot // block_size, d * block_size + row, block_size * head_size + row * head_size + d


def _cpu_write(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: list[int]) -> None:
    num_blocks, kv_heads, block_size, width = cache.shape
    pages = cache.view(num_blocks, kv_heads, -1)
    for t, slot in enumerate(slots):
        block, key_at, value_at = _offsets(slot, block_size, width // 2)
        pages[block, :, key_at] = keys[t]  # [Hr, hd]
        pages[block, :, value_at] = values[t]


def _cpu_read(cache: torch.Tensor, slot: int) -> torch.Tensor:
    num_blocks, kv_heads, block_size, width = cache.shape
    block, key_at, value_at = _offsets(slot, block_size, width // 2)
    page = cache.view(num_blocks, kv_heads, -1)[block]
    return torch.stack([page[:, key_at], page[:, value_at]])  # [2, Hr, hd]


def test_the_fake_cpu_cache_is_laid_out_as_vllm_s_writer_lays_it():
    cpu = RECORD["cpu_cache"]
    cache = _cpu_cache(cpu["num_blocks"], cpu["kv_heads"], cpu["block_size"], cpu["head_size"])
    assert list(cache.shape) == cpu["shape"]
    for key, place in cpu["places"].items():
        slot, head = map(int, key.split("/"))
        _, key_at, value_at = _offsets(slot, cpu["block_size"], cpu["head_size"])
        assert (key_at.tolist(), value_at.tolist()) == (place["key"], place["value"])
    assert cpu["isa"] == "vec"  # the kernel this layout is vLLM for CPU's (fp32, block size a multiple of 32)


# ---------------------------------------------------------------- every rank of an engine, filled by the core


def _engine(config: dict, draft_layers: int = 0) -> list[dict]:
    """Each rank's caches and layer shapes, named as vLLM names a Llama's layers, with `draft_layers` extra layers
    (an EAGLE/MTP drafter's, indexed past the model's) on the last pipeline stage."""
    total, layers, tp = config["total_kv_heads"], config["layers"], config["tp_size"]
    ranks = []
    for rank in config["ranks"]:
        start, end = rank["layers"]
        if end == layers:
            end += draft_layers
        names = [f"model.layers.{i}.self_attn.attn" for i in range(start, end)]
        ranks.append(
            {
                "heads": core.rank_heads(total, tp, rank["rank"] % tp),
                "caches": {name: _cpu_cache(16, rank["kv_heads"]) for name in names},
                "layers": {name: core.LayerShape(rank["kv_heads"], HEAD_SIZE) for name in names},
            }
        )
    return ranks


def _fill(ranks: list[dict], prompt: torch.Tensor, model_layers: int, first: int, slots: list[int]) -> list:
    reasons = []
    for rank in ranks:

        def write(name, keys, values, caches=rank["caches"]):
            _cpu_write(caches[name], keys, values, slots)

        reasons.append(core.load_prompt(prompt, rank["layers"], rank["heads"], model_layers, first, len(slots), write))
    return reasons


@pytest.mark.parametrize("name", ["tp2", "pp2", "pp2_uneven", "one_kv_head_tp2", "two_kv_heads_tp4", "tp2_pp2"])
def test_every_layer_and_head_of_the_prompt_lands_on_the_ranks_that_hold_it(name):
    config = CONFIGS[name]
    layers, total = config["layers"], config["total_kv_heads"]
    prompt = torch.randn(layers, 2, total, POSITIONS, HEAD_SIZE)  # [layers, 2, Hkv, N, hd]
    first, blocks = 1, [7, 2, 5]  # position 0 is in the cache already (a prefix-cache hit)
    slots = core.cache_slots(blocks, BLOCK_SIZE, first, POSITIONS - first)
    ranks = _engine(config, draft_layers=1)
    assert _fill(ranks, prompt, layers, first, slots) == [None] * len(ranks)
    copies = {}  # (layer, head) -> every rank's copy, [2, N - first, hd]
    for rank in ranks:
        for layer_name, cache in rank["caches"].items():
            layer = core.layer_index(layer_name)
            read = torch.stack([_cpu_read(cache, slot) for slot in slots], dim=2)  # [2, Hr, T, hd]
            if layer >= layers:  # the drafter's layer: untouched
                assert not cache.any()
                continue
            for i, head in enumerate(rank["heads"]):
                copies.setdefault((layer, head), []).append(read[:, i])
            assert cache.count_nonzero() == read.count_nonzero()  # nothing outside the request's slots
    assert sorted(copies) == [(layer, head) for layer in range(layers) for head in range(total)]
    for (layer, head), found in copies.items():
        for copy in found:  # a replicated head is written on each rank that holds it
            assert torch.equal(copy, prompt[layer, :, head, first:])
    assert {len(found) for found in copies.values()} == {max(1, config["tp_size"] // total)}


def test_a_layer_that_doesn_t_fit_writes_nothing_on_that_rank_and_says_why():
    config = CONFIGS["tp2"]
    prompt = torch.randn(config["layers"], 2, 2, POSITIONS, HEAD_SIZE)
    slots = core.cache_slots([0, 1], BLOCK_SIZE, 0, POSITIONS)
    ranks = _engine(config)
    ranks[1]["layers"]["model.layers.2.self_attn.attn"] = core.LayerShape(2, HEAD_SIZE)  # not this rank's share
    reasons = _fill(ranks, prompt, config["layers"], 0, slots)
    assert reasons[0] is None
    assert (
        "layer model.layers.2.self_attn.attn holds 2 KV heads of size 8, this rank's share of the KV prompt 1"
        in (reasons[1])
    )
    assert not any(cache.any() for cache in ranks[1]["caches"].values())  # checked before anything was written


@pytest.mark.parametrize(
    ("prompt_shape", "why"),
    [
        ((3, 2, 2, POSITIONS, HEAD_SIZE), "layer model.layers.3.self_attn.attn has index 3, the KV prompt 3 layers"),
        ((4, 2, 1, POSITIONS, HEAD_SIZE), "this rank holds KV heads 1..1, the KV prompt 1 heads"),
        ((4, 2, 2, POSITIONS, 16), "holds 1 KV heads of size 8, this rank's share of the KV prompt 1 of size 16"),
    ],
)
def test_a_prompt_for_another_model_is_refused_by_the_worker_with_its_reason(prompt_shape, why):
    ranks = _engine(CONFIGS["tp2"])
    reasons = _fill(ranks, torch.randn(prompt_shape), 4, 0, core.cache_slots([0, 1], BLOCK_SIZE, 0, POSITIONS))
    assert why in reasons[-1]
    assert not any(cache.any() for cache in ranks[-1]["caches"].values())


# ---------------------------------------------------------------- the scheduler side: what is matched


@pytest.fixture
def share(tmp_path):
    """A KV prompt published as the front publishes it (serve/share.py): test_kv_share_files.py checks those."""
    values, config = torch.randn(4, 2, 2, POSITIONS, HEAD_SIZE), {"prompt_level": "kv"}
    digest = content_hash(config, {SAVED_KV_KEY: values})
    save_file({VLLM_KV_TENSOR: values}, str(tmp_path / f"{digest}.safetensors"), metadata=core.file_metadata(config))
    return str(tmp_path), digest


MODEL = core.ModelShape(layers=4, kv_heads=2, head_size=HEAD_SIZE)


def test_a_fitting_prompt_is_matched_for_its_positions_not_yet_in_the_cache(share):
    folder, digest = share
    assert core.match(folder, digest, MODEL, prompt_tokens=POSITIONS + 1, computed=0) == (POSITIONS, None)
    assert core.match(folder, digest, MODEL, prompt_tokens=POSITIONS + 1, computed=4) == (POSITIONS - 4, None)


@pytest.mark.parametrize(
    ("model", "tokens", "why"),
    [
        (core.ModelShape(5, 2, HEAD_SIZE), 9, "the KV prompt has 4 layers (the model: 5): it was trained on another"),
        (core.ModelShape(4, 4, 16), 9, "has 2 KV heads (the model: 4), 8 head size (the model: 16)"),
        (MODEL, POSITIONS, f"the request has {POSITIONS} tokens: the KV prompt's {POSITIONS} positions need text"),
    ],
)
def test_a_prompt_that_doesn_t_fit_matches_nothing_and_says_why(share, model, tokens, why):
    positions, reason = core.match(*share, model, prompt_tokens=tokens, computed=0)
    assert positions == 0 and why in reason


def test_an_unreadable_or_unnamed_prompt_matches_nothing_and_says_why(share):
    folder, _ = share
    assert core.match(folder, "cd" * 16, MODEL, 9, 0)[1].startswith(f"the KV prompt {'cd' * 16!r} can't be read")
    assert "must be a content hash" in core.match(folder, "../etc", MODEL, 9, 0)[1]
    assert "not [layers, 2, kv_heads, positions, head_size]" in core.prompt_misfit((4, 3, 2, 6, 8), MODEL)


# ---------------------------------------------------------------- the connector's worker side, with vLLM stood in


def _worker(folder: str, tp_size: int, tp_rank: int, caches: dict, model=(4, 2, HEAD_SIZE)):
    """The real connector (`vllm_kv.py`, its vLLM imports stood in by tests/serve/kv_connector_stub.py) as one
    tensor-parallel worker of vLLM registers it, with `caches` (name -> fake CPU cache)."""
    import kv_connector_stub

    connector = kv_connector_stub.scheduler_connector(folder, model=model, block_size=BLOCK_SIZE)
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.get_tensor_model_parallel_world_size = lambda: tp_size
    state.get_tensor_model_parallel_rank = lambda: tp_rank
    with mock.patch.dict(sys.modules, {"vllm.distributed.parallel_state": state}):
        connector.register_kv_caches(caches)
    return connector


def _step(connector, loads: list, layers: dict) -> None:
    """One forward step: the scheduler's metadata bound, then `start_load_kv` with attention layers of `layers`'
    shapes whose backend writes as vLLM for CPU does."""
    module = type(connector).start_load_kv.__globals__  # vllm_kv's names: the stub leaves it out of sys.modules
    meta = module["SoftPromptKVMetadata"]([module["_PromptLoad"](*load) for load in loads])
    connector._get_connector_metadata = lambda: meta  # vLLM's base binds it before the step

    def update(layer, keys, values, cache, slots):
        _cpu_write(cache, keys, values, slots.tolist())

    attention = {
        name: types.SimpleNamespace(num_kv_heads=s.num_kv_heads, head_size=s.head_size, impl=types.SimpleNamespace())
        for name, s in layers.items()
    }
    for layer in attention.values():
        layer.impl.do_kv_cache_update = update
    connector.start_load_kv(types.SimpleNamespace(no_compile_layers=attention))


def test_each_tp_worker_of_the_connector_writes_its_own_kv_head(share):
    folder, digest = share
    prompt = core.shared_prompt(folder, digest)  # [4, 2, 2, N, hd]
    slots = core.cache_slots([3, 1], BLOCK_SIZE, 0, POSITIONS)
    ranks = _engine(CONFIGS["tp2"])
    for tp_rank, rank in enumerate(ranks):
        worker = _worker(folder, 2, tp_rank, rank["caches"])
        _step(worker, [(digest, 0, slots)], rank["layers"])
        assert worker.get_block_ids_with_load_errors() == set()
        for name, cache in rank["caches"].items():
            written = torch.stack([_cpu_read(cache, slot) for slot in slots], dim=2)  # [2, 1, T, hd]
            assert torch.equal(written[:, 0], prompt[core.layer_index(name), :, tp_rank])


def test_a_worker_that_can_t_fill_a_layer_reports_a_failed_load_and_does_not_raise(share):
    folder, digest = share
    slots = core.cache_slots([3, 1], BLOCK_SIZE, 0, POSITIONS)
    rank = _engine(CONFIGS["tp2"])[1]
    rank["layers"]["model.layers.3.self_attn.attn"] = core.LayerShape(2, HEAD_SIZE)  # not rank 1's share
    worker = _worker(folder, 2, 1, rank["caches"])
    _step(worker, [(digest, 0, slots)], rank["layers"])
    assert not any(cache.any() for cache in rank["caches"].values())
    assert worker.get_block_ids_with_load_errors() == {3, 1}  # vLLM ends that request; the engine goes on
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
