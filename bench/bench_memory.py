"""Peak memory of one soft-prompt training step on fp32, bf16 and 8-bit GPT-2-small-shaped bases.

Soft prompts train an `[N, D]` float32 leaf and leave the base frozen, so the base never needs a float32 master copy:
its resident bytes should stay at the base's own precision, and only activations scale with it.

How memory is measured (deterministic, CPU-friendly, no RSS noise):

* resident: the unique storage bytes of every parameter and buffer, plus bitsandbytes' per-row scales (`SCB`),
  which hang off `Int8Params` as plain attributes and are neither.
* step peak: a `TorchDispatchMode` sees every tensor that any ATen or custom op (bitsandbytes' included) returns
  during forward, backward and `optimizer.step()`. Each new storage is counted until a weakref callback says it
  was freed; the peak of that running total is the step's transient peak. Allocations hidden inside a kernel and
  never returned (scratch buffers) are not seen; everything autograd keeps for backward is.
* saved for backward: bytes that autograd packs between forward and backward (`saved_tensors_hooks`), deduplicated
  by storage and excluding the model's own weights.
* float copies of weights: any float32/float64 tensor born in the step with the shape of a base weight (or its
  transpose) is a dequantized or upcast weight. We report how many bytes of those were ever alive at once, next to
  the float32 size of the whole base: a library that upcast the base would show the second number.

With `--device cuda` (and a GPU) `torch.cuda.max_memory_allocated` is printed alongside as a cross-check.

Run: `python bench/bench_memory.py` (about 1-3 minutes on 2 CPU cores; builds the model from `GPT2Config`, offline).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from peft import get_peft_model  # noqa: E402
from transformers import BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel  # noqa: E402

import peft_softprompt_plus  # noqa: E402,F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig  # noqa: E402

MB = 2**20
_UPCAST = (torch.float32, torch.float64)


class LiveBytes(TorchDispatchMode):
    """Running and peak bytes of storages returned by ops under this mode; freed storages leave via weakrefs."""

    def __init__(self, weight_shapes: set[tuple[int, ...]], resident: set[int]):
        super().__init__()
        self._resident = resident  # storage pointers of weights: views of them (`w.t()`) allocate nothing
        self.live = self.peak = 0
        self.float_weight_live = self.float_weight_peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._weight_shapes = weight_shapes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)  # storages keep one Python object while alive, so `id` is stable until the weakref fires
        if key in self._refs or storage.nbytes() == 0 or storage.data_ptr() in self._resident:
            return
        size = storage.nbytes()
        weight_like = tensor.dtype in _UPCAST and tuple(tensor.shape) in self._weight_shapes

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


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _resident_tensors(model: nn.Module) -> list[torch.Tensor]:
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        # bitsandbytes keeps int8 row scales outside params/buffers: on the weight, then on `state` after a forward.
        # `_parameters`/`__dict__`, not getattr: PEFT tuner layers answer `.weight` through a property.
        for owner in (module.__dict__.get("state"), module._parameters.get("weight")):
            scales = getattr(owner, "SCB", None)
            if isinstance(scales, torch.Tensor):
                tensors.append(scales)
    return tensors


def _weight_shapes(model: nn.Module) -> set[tuple[int, ...]]:
    shapes = set()
    for param in model.parameters():
        if param.dim() == 2:
            shapes.update({tuple(param.shape), tuple(param.shape[::-1])})
    return shapes


def _float32_size_of_base(model: nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def _largest_layer_fp32(model: nn.Module) -> int:
    """Float32 bytes of the biggest non-embedding weight: the most a per-layer dequantization may hold at once."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return max(p.numel() * 4 for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)


@dataclass
class Result:
    name: str
    resident: int
    peak: int
    saved: int
    float_weight_peak: int
    base_fp32_size: int
    largest_layer_fp32: int
    loss: float
    seconds: float
    dtypes: str
    cuda_peak: int = 0

    @property
    def step_peak(self) -> int:
        return self.resident + self.peak


def _saved_bytes_hooks(weights: set[int], counter: dict):
    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in counter:
            counter[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def measure(name: str, load: Callable[[], nn.Module], args) -> Result:
    device = torch.device(args.device)
    base = load()
    before = {n: (p.dtype, p.data_ptr()) for n, p in base.named_parameters()}
    model = get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=args.n, init_seed=0))
    prompt = model.base_model.prompt("default")
    optimizer = torch.optim.Adam([prompt], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.length), generator=gen).to(device)
    model.train()
    resident = _storage_bytes(_resident_tensors(model))
    weights = {t.untyped_storage().data_ptr() for t in _resident_tensors(model) if t.numel()}
    saved: dict[int, int] = {}
    mode = LiveBytes(_weight_shapes(base), weights)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with mode, _saved_bytes_hooks(weights, saved):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    cuda_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    after = {n: (p.dtype, p.data_ptr()) for n, p in base.named_parameters()}
    if after != before:
        changed = [n for n in before if before[n] != after.get(n)]
        raise AssertionError(f"{name}: attaching and training changed base parameters {changed[:5]}")
    if prompt.dtype != torch.float32:
        raise AssertionError(f"{name}: the prompt became {prompt.dtype}")
    dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in base.parameters()}))
    return Result(
        name=name,
        resident=resident,
        peak=mode.peak,
        saved=sum(saved.values()),
        float_weight_peak=mode.float_weight_peak,
        base_fp32_size=_float32_size_of_base(base),
        largest_layer_fp32=_largest_layer_fp32(base),
        loss=loss.item(),
        seconds=seconds,
        dtypes=dtypes,
        cuda_peak=cuda_peak,
    )


def _loaders(path: str, device: str) -> dict[str, Callable[[], nn.Module]]:
    device_map = {"": device}

    def int8(dtype=None):
        quant = BitsAndBytesConfig(load_in_8bit=True)
        return GPT2LMHeadModel.from_pretrained(path, quantization_config=quant, device_map=device_map, dtype=dtype)

    return {
        "fp32": lambda: GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).to(device),
        "bf16": lambda: GPT2LMHeadModel.from_pretrained(path, dtype=torch.bfloat16).to(device),
        "int8": lambda: int8(),
        "int8+bf16": lambda: int8(torch.bfloat16),
    }


def _report(results: list[Result], args) -> None:
    ref = results[0]
    print(
        f"\nGPT-2-small shape (12 x 768, vocab 50257), batch {args.batch} x {args.length} tokens, N={args.n}, "
        f"device {args.device}. MB = 2**20 bytes."
    )
    head = (
        f"{'base':<10} {'weights dtypes':<24} {'resident':>9} {'step +':>8} {'peak':>8} {'ratio':>6} {'saved':>8} "
        f"{'fp-weight':>10} {'loss':>7} {'sec':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.name:<10} {r.dtypes:<24} {r.resident / MB:>9.1f} {r.peak / MB:>8.1f} {r.step_peak / MB:>8.1f} "
            f"{r.step_peak / ref.step_peak:>6.2f} {r.saved / MB:>8.1f} {r.float_weight_peak / MB:>10.1f} "
            f"{r.loss:>7.3f} {r.seconds:>6.1f}"
        )
        if r.cuda_peak:
            print(f"{'':<10} torch.cuda.max_memory_allocated: {r.cuda_peak / MB:.1f} MB")
    print(
        "\nresident: weights + buffers (+ int8 scales); step +: peak of tensors alive during forward/backward/step; "
        "peak = resident + step +;\nratio: peak / fp32 peak; saved: activations kept for backward; fp-weight: most "
        f"bytes of float32 weight-shaped tensors alive at once (a float32 copy of the whole base would be "
        f"{ref.base_fp32_size / MB:.0f} MB)."
    )
    for r in results[1:]:
        verdict = "OK" if r.float_weight_peak <= r.largest_layer_fp32 else "FAIL"
        print(
            f"{verdict}: {r.name} held at most {r.float_weight_peak / MB:.1f} MB of float32 weight copies at once "
            f"(one layer is {r.largest_layer_fp32 / MB:.1f} MB; the whole base {r.base_fp32_size / MB:.0f} MB)."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--n", type=int, default=20, help="num_virtual_tokens")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", nargs="*", default=None, help="subset of: fp32 bf16 int8 int8+bf16")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch.cuda.is_available() is False. Use --device cpu.")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast ... to float16" every call
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=50257)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    results = []
    with tempfile.TemporaryDirectory() as path:
        GPT2LMHeadModel(config).save_pretrained(path)  # random weights; int8 loading needs a checkpoint on disk
        for name, load in _loaders(path, args.device).items():
            if args.only and name not in args.only:
                continue
            results.append(measure(name, load, args))
            print(
                f"measured {name}: peak {results[-1].step_peak / MB:.1f} MB in {results[-1].seconds:.1f} s", flush=True
            )
    _report(results, args)


if __name__ == "__main__":
    main()
