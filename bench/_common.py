"""What every benchmark here shares: the seeded GPT-2 shapes, the models compared, interleaved timing with medians,
the step-memory measure, the result table and a description of the machine. See bench/README.md for the method."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PromptTuningConfig, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

import peft_softprompt_plus  # noqa: E402,F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig  # noqa: E402
from peft_softprompt_plus.tiny import tiny_config  # noqa: E402

MB = 2**20


def quiet() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Shape:
    """A random GPT-2 (fp32, dropout off, `n_positions` 1024) and the batch it is timed on."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    batch: int = 16
    length: int = 128

    def base(self, checkpointing: bool = False) -> GPT2LMHeadModel:
        torch.manual_seed(0)
        config = tiny_config(
            self.vocab, n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head, n_positions=1024
        )
        model = GPT2LMHeadModel(config)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def ids(self, seed: int = 1) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(2, self.vocab, (self.batch, self.length), generator=gen)  # [B, L]

    def describe(self) -> str:
        return f"{self.name}: GPT-2 {self.n_layer} x {self.n_embd}, {self.n_head} heads, vocab {self.vocab}"


TINY = Shape("tiny", 4, 256, 4, 5000)
SMALL = Shape("small", 12, 768, 12, 50257)


def ours(base: nn.Module, n: int, **config):
    config = {"init_seed": 0, "validate_gradients": "off", **config}
    return get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, **config))


def peft_prompt_tuning(base: nn.Module, values: torch.Tensor):
    """PEFT PROMPT_TUNING holding `values` `[N, D]`."""
    model = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=values.shape[0]))
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.copy_(values)
    return model


def peft_prompt(model) -> nn.Parameter:
    return model.prompt_encoder["default"].embedding.weight


def train_step(model, ids: torch.Tensor, params: list[nn.Parameter], **forward) -> Callable[[], torch.Tensor]:
    """Forward with `labels=ids` and backward; the gradients are dropped (no optimizer, for every variant alike)."""

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids, **forward).loss
        loss.backward()
        for p in params:
            p.grad = None
        return loss

    return step


def floor_step(base: GPT2LMHeadModel, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The frozen base on the text alone; its input embeddings require grad, so the backward crosses every layer
    down to the input, as a prompt's must."""
    base.requires_grad_(False)
    wte = base.get_input_embeddings()

    def step() -> torch.Tensor:
        with torch.no_grad():
            embeds = wte(ids)  # [B, L, D]
        loss = base(inputs_embeds=embeds.requires_grad_(), labels=ids).loss
        loss.backward()
        return loss

    return step


# ---------------------------------------------------------------------------------------------- timing


@dataclass
class Timings:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds: with 1 thread, immune to waiting for a core

    def med(self, kind: str = "wall") -> float:
        return statistics.median(getattr(self, kind))

    def line(self) -> str:
        return (
            f"wall median {1e3 * self.med():8.1f} ms (min {1e3 * min(self.wall):7.1f}, "
            f"max {1e3 * max(self.wall):7.1f}); cpu median {1e3 * self.med('cpu'):8.1f} ms"
        )


def interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, Timings]:
    """Every variant once per round, the order rotating each round; the timed rounds' seconds."""
    names = list(fns)
    times = {name: Timings() for name in names}
    for round_ in range(warmup + reps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            fns[name]()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if round_ >= warmup:
                times[name].wall.append(wall)
                times[name].cpu.append(cpu)
    return times


def ratio(times: dict[str, Timings], num: str, den: str) -> tuple[float, float]:
    """(wall, cpu) ratios of medians."""
    return times[num].med() / times[den].med(), times[num].med("cpu") / times[den].med("cpu")


# ---------------------------------------------------------------------------------------------- memory


class LiveBytes(TorchDispatchMode):
    """Running and peak bytes of storages returned by ops under this mode; freed storages leave via weakrefs.
    `weight_shapes` marks float32 tensors shaped like a weight (upcast or dequantized copies) for a separate count."""

    def __init__(self, resident: set[int], weight_shapes: frozenset = frozenset()):
        super().__init__()
        self._resident = resident  # storage pointers of weights: views of them (`w.t()`) allocate nothing
        self._weight_shapes = weight_shapes
        self.live = self.peak = self.float_weight_live = self.float_weight_peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)  # storages keep one Python object while alive, so `id` is stable until the weakref fires
        if key in self._refs or storage.nbytes() == 0 or storage.data_ptr() in self._resident:
            return
        size = storage.nbytes()
        weight_like = tensor.dtype in (torch.float32, torch.float64) and tuple(tensor.shape) in self._weight_shapes

        def freed(_ref, key=key, size=size, weight_like=weight_like):
            self._refs.pop(key, None)
            self.live -= size
            self.float_weight_live -= size if weight_like else 0

        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)
        if weight_like:
            self.float_weight_live += size
            self.float_weight_peak = max(self.float_weight_peak, self.float_weight_live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.device.type != "meta":
                self._track(item)
        return out


def step_peak(step: Callable[[], object], model: nn.Module) -> int:
    """Peak bytes of tensors alive during one step; weights and buffers are not counted."""
    weights = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    gc.collect()
    mode = LiveBytes(weights)
    with mode:
        step()
    return mode.peak


# ---------------------------------------------------------------------------------------------- report


@dataclass
class Row:
    """One line of a result table; `target` is None for context-only figures."""

    what: str
    value: float  # judged against `target`; for timings, from wall-clock medians
    cpu: Optional[float] = None  # the same figure from process-CPU-time medians, as a cross-check
    target: Optional[str] = None  # e.g. ">= 2.0"
    fmt: str = "{:.3f}"

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        op, bound = self.target.split()
        return "PASS" if (self.value >= float(bound) if op == ">=" else self.value <= float(bound)) else "MISS"


def print_table(rows: list[Row]) -> None:
    width = max(len(r.what) for r in rows)
    print(f"\n| {'measure':<{width}} | {'value':>9} | {'cpu-time':>8} | {'target':>8} | result |")
    print(f"|{'-' * (width + 2)}|{'-' * 11}|{'-' * 10}|{'-' * 10}|--------|")
    for r in rows:
        cpu = "" if r.cpu is None else r.fmt.format(r.cpu)
        print(f"| {r.what:<{width}} | {r.fmt.format(r.value):>9} | {cpu:>8} | {r.target or '':>8} | {r.verdict:<6} |")
    misses = [r for r in rows if r.verdict == "MISS"]
    print(f"\n{len(misses)} of {sum(r.target is not None for r in rows)} targets missed" + ":" * bool(misses))
    for r in misses:
        print(f"  MISS {r.what}: {r.fmt.format(r.value)} (target {r.target})")
    print("value: from wall-clock medians (the verdict); cpu-time: the same ratio from process-CPU-time medians.")


def machine() -> str:
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (
        f"{platform.system()} {platform.machine()}, CPU: {cpu}, {os.cpu_count()} logical cores, torch threads "
        f"{torch.get_num_threads()}; python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}; load average (1/5/15 min) {load}"
    )
