"""What every benchmark here shares: the seeded GPT-2 shapes and the bases loaded from them, the models compared,
interleaved timing with medians, the result table and a description of the machine. Method: bench/README.md."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PromptTuningConfig, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402
from transformers import BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel  # noqa: E402

import peft_softprompt_plus  # noqa: E402,F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig  # noqa: E402
from peft_softprompt_plus.apps.tiny import tiny_config  # noqa: E402

MB = 2**20


def quiet(all_warnings: bool = True) -> None:
    """Silence what would repeat on every call and drown the tables; `all_warnings=False` keeps library warnings."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast ... to float16" every call
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" on every from_pretrained
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    if all_warnings:
        warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------------------------- models


def checkpointing_on(model) -> None:
    """Non-reentrant checkpointing by the name the installed transformers uses (`activation_*` from 5.24 on)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@dataclass(frozen=True)
class Shape:
    """A random GPT-2 (dropout off, `n_positions` 1024, ids 0/1 end-of-text and pad) and the batch it runs on."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    batch: int = 16
    length: int = 128
    pad_id: int = 1
    first_id: int = 2  # the lowest id that is not a special token

    def config(self) -> GPT2Config:
        return tiny_config(self.vocab, n_positions=1024, n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head)

    def base(self, checkpointing: bool = False) -> GPT2LMHeadModel:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(self.config())
        if checkpointing:
            checkpointing_on(model)
        return model

    def ids(self, seed: int = 1) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(self.first_id, self.vocab, (self.batch, self.length), generator=gen)  # [B, L]

    def replace(self, **changes) -> Shape:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return f"{self.name}: GPT-2 {self.n_layer} x {self.n_embd}, {self.n_head} heads, vocab {self.vocab}"


TINY = Shape("tiny", 4, 256, 4, 5000)
SMALL = Shape("small", 12, 768, 12, 50257)


@contextlib.contextmanager
def checkpoint(shape: Shape) -> Iterator[str]:
    """`shape.base()` saved to a temporary folder: 8- and 4-bit loading quantizes a checkpoint on disk."""
    with tempfile.TemporaryDirectory() as path:
        shape.base().save_pretrained(path)
        yield path


def _plain(dtype: torch.dtype) -> Callable[[str, torch.device], nn.Module]:
    return lambda path, device: GPT2LMHeadModel.from_pretrained(path, dtype=dtype).to(device)


def _quantized(dtype: Optional[torch.dtype] = None, **quant) -> Callable[[str, torch.device], nn.Module]:
    def load(path: str, device: torch.device) -> nn.Module:
        # nf4 computes in bf16 on a GPU; bitsandbytes' CPU kernels take float32
        compute = {"bnb_4bit_compute_dtype": torch.bfloat16 if device.type == "cuda" else torch.float32}
        config = BitsAndBytesConfig(**quant, **(compute if quant.get("load_in_4bit") else {}))
        device_map = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
        kwargs = {} if dtype is None else {"dtype": dtype}
        return GPT2LMHeadModel.from_pretrained(path, quantization_config=config, device_map=device_map, **kwargs)

    return load


# base name -> `load(checkpoint_path, device)`; the weights' dtypes are named by the key
BASES: dict[str, Callable[[str, torch.device], nn.Module]] = {
    "fp32": _plain(torch.float32),
    "fp16": _plain(torch.float16),
    "bf16": _plain(torch.bfloat16),
    "int8": _quantized(load_in_8bit=True),
    "int8+bf16": _quantized(torch.bfloat16, load_in_8bit=True),
    "nf4": _quantized(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
}


def ours(base: nn.Module, n: int, **config):
    config = {"init_seed": 0, "validate_gradients": "off", **config}
    return get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, **config))


def peft_prompt_tuning(base: nn.Module, values: torch.Tensor):
    """PEFT PROMPT_TUNING holding `values` `[N, D]`."""
    model = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=values.shape[0]))
    with torch.no_grad():
        peft_prompt(model).copy_(values)
    return model


def peft_prompt(model, adapter_name: str = "default") -> nn.Parameter:
    return model.prompt_encoder[adapter_name].embedding.weight


def peft_cartridge(base: nn.Module, values: torch.Tensor):
    """PEFT CARTRIDGE holding our KV prompt's `[layers, 2, Hkv, N, hd]` values (its first position frozen, as ours)."""
    from peft import CartridgeConfig

    n = values.shape[3]
    model = get_peft_model(base, CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, num_frozen_tokens=1))
    model.prompt_encoder["default"].load_prompt_embeddings(values.detach().permute(3, 0, 1, 2, 4).reshape(n, -1))
    return model


def peft_prefix_tuning(base: nn.Module, n: int):
    """PEFT PREFIX_TUNING, its defaults (no projection): a `[N, layers*2*D]` table served as past_key_values."""
    from peft import PrefixTuningConfig

    return get_peft_model(base, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n))


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


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, warmup: int, after: Optional[Callable[[object], None]] = None
) -> dict[str, Timings]:
    """Every variant once per round, the order rotating each round; the timed rounds' seconds. `after` gets each
    call's result, untimed (e.g. to undo what the call did)."""
    names = list(fns)
    times = {name: Timings() for name in names}
    for round_ in range(warmup + reps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            result = fns[name]()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if after is not None:
                after(result)
            if round_ >= warmup:
                times[name].wall.append(wall)
                times[name].cpu.append(cpu)
    return times


def ratio(times: dict[str, Timings], num: str, den: str) -> tuple[float, float]:
    """(wall, cpu) ratios of medians."""
    return times[num].med() / times[den].med(), times[num].med("cpu") / times[den].med("cpu")


# ---------------------------------------------------------------------------------------------- a run


def timing_flags(parser, quick: str, threads: int = 1, reps: Optional[int] = None) -> None:
    """The flags every timing bench takes: `--quick` (what its smoke test runs), `--threads`, `--reps`."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--threads", type=int, default=threads, help="torch threads; 0 keeps torch's default")
    if reps is not None:
        parser.add_argument("--reps", type=int, default=reps, help="timed rounds")


@contextlib.contextmanager
def timed_run(args, about: str = "") -> Iterator[None]:
    """A timing bench's run: its torch threads, quiet logs, the machine before (with `about`) and after, the total."""
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet()
    start = time.perf_counter()
    print(f"machine: {machine()}" + (f"\n{about}" if about else ""), flush=True)
    yield
    print(f"\nmachine at the end: {machine()}\ntotal {time.perf_counter() - start:.0f} s")


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
