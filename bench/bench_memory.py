"""Peak memory of one soft-prompt training step on fp32, bf16 and 8-bit bases: the base's resident bytes should stay
at its own precision (no float32 master copy), and at most one layer's float32 copy may be alive at once.
Method, targets and commands: bench/README.md.

    python bench/bench_memory.py            # GPT-2-small shape, B=4, L=128 (1-3 minutes on 2 cores)
    python bench/bench_memory.py --quick    # tiny shape, B=2, L=32 (seconds)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import _common as c
import _memory as mem
import torch

MEASURED = ("fp32", "bf16", "int8", "int8+bf16")  # keys of `c.BASES`; the first is the reference


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


def measure(name: str, path: str, shape: c.Shape, args) -> Result:
    device = torch.device(args.device)
    base = c.BASES[name](path, device)
    before = {n: (p.dtype, p.data_ptr()) for n, p in base.named_parameters()}
    model = c.ours(base, args.n, validate_gradients="raise")
    prompt = model.base_model.prompt("default")
    optimizer = torch.optim.Adam([prompt], lr=1e-3)
    ids = shape.ids().to(device)
    model.train()
    tensors = mem.resident_tensors(model)
    resident = mem.pointers(tensors)
    mode = mem.LiveBytes(resident, mem.weight_shapes(base))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with mode, mem.saved_for_backward(resident) as saved:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    after = {n: (p.dtype, p.data_ptr()) for n, p in base.named_parameters()}
    if after != before:
        changed = [n for n in before if before[n] != after.get(n)]
        raise AssertionError(f"{name}: attaching and training changed base parameters {changed[:5]}")
    if prompt.dtype != torch.float32:
        raise AssertionError(f"{name}: the prompt became {prompt.dtype}")
    return Result(
        name=name,
        resident=mem.storage_bytes(tensors),
        peak=mode.peak,
        saved=sum(saved.values()),
        float_weight_peak=mode.float_weight_peak,
        base_fp32_size=mem.float32_size(base),
        largest_layer_fp32=mem.largest_layer_fp32(base),
        loss=loss.item(),
        seconds=seconds,
        dtypes=", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in base.parameters()})),
        cuda_peak=torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
    )


def report(results: list[Result], shape: c.Shape, args) -> None:
    ref = results[0]
    print(
        f"\n{shape.describe()}, batch {shape.batch} x {shape.length} tokens, N={args.n}, device {args.device}. "
        "MB = 2**20 bytes."
    )
    head = (
        f"{'base':<10} {'weights dtypes':<24} {'resident':>9} {'step +':>8} {'peak':>8} {'ratio':>6} {'saved':>8} "
        f"{'fp-weight':>10} {'loss':>7} {'sec':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.name:<10} {r.dtypes:<24} {r.resident / c.MB:>9.1f} {r.peak / c.MB:>8.1f} {r.step_peak / c.MB:>8.1f} "
            f"{r.step_peak / ref.step_peak:>6.2f} {r.saved / c.MB:>8.1f} {r.float_weight_peak / c.MB:>10.1f} "
            f"{r.loss:>7.3f} {r.seconds:>6.1f}"
        )
        if r.cuda_peak:
            print(f"{'':<10} torch.cuda.max_memory_allocated: {r.cuda_peak / c.MB:.1f} MB")
    print(
        "\nresident: weights + buffers (+ int8 scales); step +: peak of tensors alive during forward/backward/step; "
        "peak = resident + step +;\nratio: peak / first base's peak; saved: activations kept for backward; "
        "fp-weight: most bytes of float32 weight-shaped tensors alive at once (a float32 copy of the whole base "
        f"would be {ref.base_fp32_size / c.MB:.0f} MB)."
    )
    for r in results[1:]:
        verdict = "OK" if r.float_weight_peak <= r.largest_layer_fp32 else "FAIL"
        print(
            f"{verdict}: {r.name} held at most {r.float_weight_peak / c.MB:.1f} MB of float32 weight copies at once "
            f"(one layer is {r.largest_layer_fp32 / c.MB:.1f} MB; the whole base {r.base_fp32_size / c.MB:.0f} MB)."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape at B=2, L=32: a smoke test in seconds")
    parser.add_argument("--batch", type=int, default=None, help="default 4 (2 with --quick)")
    parser.add_argument("--length", type=int, default=None, help="default 128 (32 with --quick)")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (12; 4 with --quick)")
    parser.add_argument("--n", type=int, default=20, help="num_virtual_tokens")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", nargs="*", default=None, choices=MEASURED, help="a subset of the bases")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch.cuda.is_available() is False. Use --device cpu.")
    c.quiet(all_warnings=False)
    shape, batch, length = (c.TINY, 2, 32) if args.quick else (c.SMALL, 4, 128)
    shape = shape.replace(
        n_layer=args.layers or shape.n_layer, batch=args.batch or batch, length=args.length or length
    )
    results = []
    with c.checkpoint(shape) as path:
        for name in MEASURED:
            if args.only and name not in args.only:
                continue
            results.append(measure(name, path, shape, args))
            print(f"measured {name}: peak {results[-1].step_peak / c.MB:.1f} MB in {results[-1].seconds:.1f} s")
    report(results, shape, args)


if __name__ == "__main__":
    main()
