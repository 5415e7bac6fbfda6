"""Sharded data-parallel training on the CPU (gloo, 2 processes under `torchrun`): FSDP2 `fully_shard`, FSDP1
`FullyShardedDataParallel` and DeepSpeed ZeRO-2/3. Each rank trains on its half of every global batch; the gathered
prompt must match one process trained on the whole batches, `save_pretrained` straight on a sharded prompt must refuse
(and write nothing), and the gather recipe its message gives must write an adapter that loads back as that prompt."""

import functools
import importlib.util
import os
import socket
import subprocess
import sys

import pytest
import torch
from peft import PeftModel

from peft_softprompt_plus.apps.tiny import tiny_gpt2

# Multi-process launches run one at a time on one xdist worker (`--dist loadgroup`): with two at once, a DDP launch
# ran past its 240 s limit in a clean-clone run on 2 cores.
pytestmark = pytest.mark.xdist_group("distributed")

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_sharded_worker.py")
TIMEOUT_S = 240
# Measured: 1.7e-7 (FSDP1, ZeRO-2/3) and 4.1e-8 (FSDP2) on the prompt, 2.1e-7 on the logits; the ranks' float32 sums
# are grouped differently from one process's, so bit equality is not expected.
ATOL = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=None)
def _worker():
    """The worker as a module, for its data, loss and one-process reference (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("_sharded_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _reference(forward_path: str, level: str = "input") -> dict:
    """One process, the same steps on the whole global batches."""
    worker = _worker()
    model, losses = worker.train_reference(forward_path=forward_path, level=level)
    ids, mask = worker.eval_batch()
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=mask).logits
    return {"prompt": model.base_model.prompt("default").detach().clone(), "losses": losses, "logits": logits}


def _launch(mode: str, out, forward_path: str = "auto", level: str = "input") -> list[dict]:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           WORKER, "--mode", mode, "--output-dir", str(out), "--forward-path", forward_path,
           "--level", level]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{mode} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


SHAPES = {"input": (4, 64), "kv": (2, 2, 4, 3, 16)}  # a KV prompt's trained positions: N=4 after its sink


def _assert_trained_like_one_process(ranks: list[dict], forward_path: str, level: str = "input") -> None:
    reference = _reference(forward_path, level)
    for rank, state in enumerate(ranks):
        assert state["world_size"] == 2
        assert state["backend"] == "gloo"
        assert state["rows"] == (2 * rank, 2 * rank + 2)  # each rank its own half of every global batch
        for key in ("forward_error", "gather_error", "recipe_error"):
            assert state[key] is None, state[key]["traceback"]
    assert torch.equal(ranks[0]["initial"], ranks[1]["initial"])
    # The ranks' losses are over different rows; their mean is the global batch's loss.
    assert ranks[0]["losses"] != ranks[1]["losses"]
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert mean == pytest.approx(reference["losses"], rel=1e-6)

    gathered = ranks[0]["gathered"]
    assert gathered is not None and gathered.shape == SHAPES[level] and gathered.dtype == torch.float32
    assert not torch.equal(gathered, ranks[0]["initial"])
    torch.testing.assert_close(gathered, reference["prompt"], atol=ATOL, rtol=0)


def _assert_refused_without_writing(ranks: list[dict], out) -> None:
    for state in ranks:
        error = state["direct_error"]
        assert error is not None and error["type"] == "ValueError", error
        assert "is sharded on this process" in error["message"]
        assert "Gather the full state dict on every rank" in error["message"]
        assert "is_main_process=rank == 0" in error["message"]
    assert not (out / "direct").exists()
    assert not [p.name for p in out.iterdir() if "softprompt-plus-save" in p.name]  # no staging folder left behind


def _assert_recipe_adapter_loads(ranks: list[dict], out, forward_path: str, level: str = "input") -> None:
    reference = _reference(forward_path, level)
    assert sorted(os.listdir(out / "recipe")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(tiny_gpt2(seed=0), out / "recipe")
    prompt = loaded.base_model.prompt("default").detach()
    assert torch.equal(prompt, ranks[0]["gathered"])
    torch.testing.assert_close(prompt, reference["prompt"], atol=ATOL, rtol=0)
    ids, mask = _worker().eval_batch()
    with torch.no_grad():
        logits = loaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, reference["logits"], atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("forward_path", ["auto", "concat"])
def test_fsdp2_trains_like_one_process_and_saves_through_the_recipe(tmp_path, forward_path):
    ranks = _launch("fsdp2", tmp_path, forward_path)

    # 'auto' concatenates under FSDP2 (its pre-forward copies the prompt pass's keys/values per block) and must
    # still train exactly like one process on the attention path.
    for state in ranks:
        assert state["forward_error"] is None, state["forward_error"]["traceback"]
        assert state["local_type"] == "DTensor"
        assert state["local_shape"] == [2, 64]  # each rank holds half the prompt's rows
    assert ranks[1]["state_dict_size"] == 0  # cpu_offload=True: the full state dict lands on rank 0 only
    _assert_trained_like_one_process(ranks, forward_path)
    _assert_refused_without_writing(ranks, tmp_path)
    assert "get_model_state_dict" in ranks[0]["direct_error"]["message"]
    _assert_recipe_adapter_loads(ranks, tmp_path, forward_path)


@pytest.mark.slow
def test_fsdp2_refuses_shared_kv_with_the_fix(tmp_path):
    ranks = _launch("fsdp2", tmp_path, "shared_kv")

    for state in ranks:
        error = state["forward_error"]
        assert error is not None and error["type"] == "ValueError", error
        assert "forward_path`='shared_kv'" in error["message"]
        assert "FSDP2 `fully_shard` wraps its blocks" in error["message"]
        assert "forward_path='auto'" in error["message"]


@pytest.mark.slow
def test_fsdp1_trains_like_one_process_and_saves_through_the_recipe(tmp_path):
    ranks = _launch("fsdp1", tmp_path)

    # use_orig_params=True: each rank's prompt is a flat view of its slice of the root unit's flat parameter.
    assert sorted(state["local_shape"][0] for state in ranks) == [0, 256]
    assert all(state["state_dict_size"] > 0 for state in ranks)  # FULL_STATE_DICT: every rank gets it all
    _assert_trained_like_one_process(ranks, "auto")
    _assert_refused_without_writing(ranks, tmp_path)
    assert "StateDictType.FULL_STATE_DICT" in ranks[0]["direct_error"]["message"]
    _assert_recipe_adapter_loads(ranks, tmp_path, "auto")


@pytest.mark.slow
def test_deepspeed_zero2_trains_like_one_process_and_saves_directly(tmp_path):
    pytest.importorskip("deepspeed")
    ranks = _launch("zero2", tmp_path)

    # ZeRO-2 partitions gradients and optimizer state, never the parameters: the prompt is whole, so a direct save
    # is right and must write the same adapter as the recipe.
    assert all(state["local_shape"] == [4, 64] for state in ranks)
    assert all(state["direct_error"] is None for state in ranks)
    _assert_trained_like_one_process(ranks, "auto")
    _assert_recipe_adapter_loads(ranks, tmp_path, "auto")
    direct = PeftModel.from_pretrained(tiny_gpt2(seed=0), tmp_path / "direct")
    assert torch.equal(direct.base_model.prompt("default").detach(), ranks[0]["gathered"])


@pytest.mark.slow
def test_deepspeed_zero3_trains_like_one_process_and_saves_through_the_recipe(tmp_path):
    pytest.importorskip("deepspeed")
    ranks = _launch("zero3", tmp_path)

    # stage3_param_persistence_threshold=0: the prompt is partitioned, an empty placeholder plus a [128] shard.
    assert all(state["held_shape"] == [0] and state["local_shape"] == [128] for state in ranks)
    assert ranks[1]["state_dict_size"] == 0  # the consolidated state dict lands on rank 0 only
    _assert_trained_like_one_process(ranks, "auto")
    _assert_refused_without_writing(ranks, tmp_path)
    assert "_zero3_consolidated_16bit_state_dict" in ranks[0]["direct_error"]["message"]
    _assert_recipe_adapter_loads(ranks, tmp_path, "auto")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "fsdp1"])
def test_a_kv_prompt_trains_sharded_like_one_process_at_the_attention(tmp_path, mode):
    """A KV prompt has no prompt pass, so FSDP2's copy of the forward keyword costs nothing: it stays at the
    attention (an input prompt concatenates under FSDP2)."""
    ranks = _launch(mode, tmp_path, "auto", "kv")
    for state in ranks:
        assert state["forward_error"] is None, state["forward_error"]["traceback"]
        assert "concat" not in state["kernels"] and state["kernels"]
    _assert_trained_like_one_process(ranks, "auto", "kv")
    _assert_refused_without_writing(ranks, tmp_path)
    _assert_recipe_adapter_loads(ranks, tmp_path, "auto", "kv")
