"""Data-parallel training on the CPU (gloo, 2 processes) through the launchers users type: `torchrun` and
`accelerate launch`. Each rank writes what it ended with; the ranks must agree bit for bit and have trained."""

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

# Multi-process launches run one at a time on one xdist worker (`--dist loadgroup`): with two at once, a DDP launch
# ran past its 240 s limit in a clean-clone run on 2 cores.
pytestmark = pytest.mark.xdist_group("distributed")

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_ddp_worker.py")
TIMEOUT_S = 120  # a launch takes ~6 s here; a hung one is tried once more
PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def _free_port() -> int:
    """A free port below the ephemeral range. Every other test's server binds port 0, which the system picks in
    that range: a launcher's rendezvous port taken by one of them between this check and the launcher's bind (a few
    seconds: torch loads first) left a rank talking to an HTTP server, hung."""
    low = int(open(PORTS).read().split()[0]) if os.path.exists(PORTS) else 32768
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _torchrun(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(port)]  # fmt: skip


def _accelerate(port: int) -> list[str]:
    # `--multi_gpu` is accelerate's name for its torchrun-based multi-process launcher; on a machine without GPUs the
    # worker's `use_cpu=True` keeps it on the CPU with gloo. (`--cpu` alone starts a single process.)
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]  # fmt: skip


LAUNCHERS = {"torchrun": _torchrun, "accelerate": _accelerate}
# Trainer defaults on one launcher; on the other, the faster setting the docs recommend, with gradient checkpointing;
# and a KV prompt under torchrun, with checkpointing.
WORKER_FLAGS = {
    "torchrun": [],
    "accelerate": ["--no-find-unused", "--checkpointing"],
    "torchrun-kv": ["--level", "kv", "--checkpointing"],
}


def _launch(launcher: str, out) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    hung = []
    for _ in range(2):  # a launch that hangs is tried once more on a fresh port; one that fails is not
        start = LAUNCHERS[launcher.split("-")[0]](_free_port())
        cmd = start + [WORKER, "--output-dir", str(out), *WORKER_FLAGS[launcher]]
        code, stdout, stderr = _run(cmd, env)
        if code is not None:
            break
        hung.append(stderr[-2000:])
    assert code == 0, f"{launcher} failed ({code}; hung before: {hung}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def _run(cmd: list[str], env: dict) -> tuple:
    """(exit code, stdout, stderr); the code None where the launch outlived TIMEOUT_S. Its output goes to files, not
    pipes (a rank that outlives its launcher would hold a pipe open), and on a timeout the launcher's group and every
    rank started with `cmd`'s `--output-dir` folder are killed."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
            _kill(proc.pid, cmd[cmd.index("--output-dir") + 1])
            proc.wait()
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def _kill(group: int, marker: str) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):  # ranks in sessions of their own
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "torchrun-kv"])
def test_two_ranks_end_with_bit_identical_trained_prompts(tmp_path, launcher):
    rank0, rank1 = _launch(launcher, tmp_path)

    for state in (rank0, rank1):
        assert state["world_size"] == 2
        assert state["backend"] == "gloo"
        assert len(state["seen"]) == 3
        assert state["checkpointing"] == ("--checkpointing" in WORKER_FLAGS[launcher])
    # The ranks trained on different shards, so only the gradient all-reduce can make them agree.
    assert not any(torch.equal(a, b) for a, b in zip(rank0["seen"], rank1["seen"], strict=True))
    assert torch.equal(rank0["initial"], rank1["initial"])
    assert torch.equal(rank0["final"], rank1["final"])
    assert rank0["final"].dtype == torch.float32
    assert not torch.equal(rank0["final"], rank0["initial"])
    assert rank0["final"].dim() == (5 if launcher.endswith("kv") else 2)  # a KV prompt's [layers, 2, Hkv, N-1, hd]
