"""GPU check of the attention (bench/_cuda_attention.py: which SDPA backend runs, bf16 exactness, step time and
memory of ours / PEFT / the floor at L up to 8192) and of the precision paths: fp16 + GradScaler, bf16, fp32 +
autocast, 8-bit and 4-bit bases on CUDA, and an 8-bit-trained adapter loaded on fp32. Exits 2 with a message when
CUDA is absent, 1 when a check fails.
Method, pass criteria and commands: bench/README.md.

    python bench/cuda_check.py                         # on a GPU: the attention table (~6 min), then precision
    python bench/cuda_check.py --part attention        # the attention part alone
    python bench/cuda_check.py --part kv               # KV prompts against the floor, input and CARTRIDGE (<= 4 min)
    python bench/cuda_check.py --device cpu --quick    # a smoke test of the script itself, on the CPU
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class PathResult:
    name: str
    losses: list = field(default_factory=list)
    skipped: int = 0
    peak_bytes: int = 0
    prompt_dtype: str = ""
    grad_dtype: str = ""
    seconds: float = 0.0
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        learned = len(self.losses) > 1 and self.losses[-1] < self.losses[0]
        return self.error is None and learned and self.prompt_dtype == self.grad_dtype == "float32"


def _no_cuda_message() -> str:
    return (
        f"CUDA is not available: torch {torch.__version__} (built for CUDA {torch.version.cuda}), "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}. This script checks the GPU paths; on a "
        "CPU-only machine run `pytest tests/method/test_precision.py` instead, or pass `--device cpu` for a smoke run."
    )


@dataclass(frozen=True)
class Recipe:
    base: str  # key of `_common.BASES`
    scaler: bool  # torch.amp.GradScaler around the loss
    autocast: Optional[torch.dtype] = None
    required: bool = True  # a path that isn't is reported, not judged


RECIPES = {
    "fp16 + GradScaler": Recipe("fp16", scaler=True),
    "bf16": Recipe("bf16", scaler=False),
    "fp32 + autocast fp16 + GradScaler": Recipe("fp32", scaler=True, autocast=torch.float16),
    "int8 (LLM.int8)": Recipe("int8", scaler=False),
    "int4 (nf4)": Recipe("nf4", scaler=False, required=False),
}


def train_path(
    name: str, recipe: Recipe, load: Callable, attach: Callable, ids: torch.Tensor, args
) -> tuple[PathResult, object]:
    """Train the prompt of `attach(load())` for `args.steps` steps on `ids`, the way `recipe` says."""
    result = PathResult(name)
    device = ids.device
    try:
        model = attach(load())
    except Exception as err:  # a path that can't load (e.g. 4-bit unsupported) is reported, not fatal
        result.error = f"{type(err).__name__}: {err}"
        return result, None
    prompt = model.base_model.prompt("default")
    optimizer = torch.optim.Adam([prompt], lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=recipe.scaler)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        if device.type == "cuda" and step == 1:  # step 0 allocates optimizer state and warms kernels up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast(device.type, dtype=recipe.autocast or torch.float16, enabled=recipe.autocast is not None):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        result.grad_dtype = str(prompt.grad.dtype).removeprefix("torch.")
        scale_before = scaler.get_scale() if recipe.scaler else 1.0
        scaler.step(optimizer)  # unscales first: raises "Attempting to unscale FP16 gradients" on an fp16 prompt
        scaler.update()
        result.skipped += int(recipe.scaler and scaler.get_scale() < scale_before)
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(loss.item())
        if device.type == "cuda" and step == 1:
            result.peak_bytes = torch.cuda.max_memory_allocated()
    result.seconds = time.perf_counter() - start
    result.prompt_dtype = str(prompt.dtype).removeprefix("torch.")
    return result, model


def _curve(losses: list, points: int = 8) -> str:
    picks = sorted({round(i * (len(losses) - 1) / (points - 1)) for i in range(points)})
    return " ".join(f"{i}:{losses[i]:.3f}" for i in picks)


@torch.no_grad()
def _logits(model, ids) -> torch.Tensor:
    return model(input_ids=ids).logits.float()  # [B, L, V]


def portability(trained, load_fp32: Callable, ids: torch.Tensor) -> tuple[float, float, float]:
    """Save the int8-trained adapter, load it on fp32; return (max |logit diff|, bare-base diff, prompt effect)."""
    from peft import PeftModel

    trained.eval()
    with tempfile.TemporaryDirectory() as adapter_dir:
        trained.save_pretrained(adapter_dir)
        loaded = PeftModel.from_pretrained(load_fp32(), adapter_dir).eval()
    diff = (_logits(loaded, ids) - _logits(trained, ids)).abs().max().item()
    with loaded.disable_adapter(), trained.disable_adapter():
        bare = (_logits(loaded, ids) - _logits(trained, ids)).abs().max().item()
    with loaded.disable_adapter():
        effect = (_logits(loaded, ids) - _logits(trained, ids)).abs().max().item()
    dtype = loaded.base_model.prompt("default").dtype
    if dtype != torch.float32:
        raise AssertionError(f"the loaded prompt is {dtype}, expected float32")
    return diff, bare, effect


def _parse(argv: Optional[list]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a smoke run")
    parser.add_argument("--quick", action="store_true", help="3 steps on a 2 x 64 GPT-2, vocab 1000, B=2, L=16")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--n", type=int, default=20, help="num_virtual_tokens")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--only", nargs="*", default=None, help=f"subset of {list(RECIPES)}")
    parser.add_argument(
        "--part",
        choices=["all", "precision", "attention", "profile", "kv"],
        default="all",
        help="which checks (default: all; `profile` prints where a step's GPU time goes; `kv`: KV prompts, <= 4 min)",
    )
    parser.add_argument("--seconds", type=float, default=330, help="time budget of the attention speed table")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per variant (median)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.layers, args.embd, args.vocab, args.batch, args.length = 3, 2, 64, 1000, 2, 16
    return args


def main(argv: Optional[list] = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(_no_cuda_message(), file=sys.stderr)
        raise SystemExit(2)
    # Imported once CUDA is known to be there: `tests/method/test_precision.py` loads this file by path, without
    # bench/ on sys.path, to check the exit above.
    import _common as c

    c.quiet(all_warnings=False)
    attention_ok = True
    if args.part == "profile":
        import _cuda_attention

        if device.type == "cpu":
            _cuda_attention.smoke_on_cpu()
            _cuda_attention.profile("tiny-llama", length=64, n=4)
        else:
            _cuda_attention.profile()
        return 0
    if args.part == "kv":
        import _cuda_attention
        import _cuda_kv

        if device.type == "cpu":
            _cuda_attention.smoke_on_cpu()
        return _cuda_kv.run(min(args.seconds, 200), args.reps)
    if args.part in ("all", "attention"):
        import _cuda_attention

        if device.type == "cpu":
            _cuda_attention.smoke_on_cpu()
        attention_ok = _cuda_attention.run(args.seconds, args.reps) == 0
        if args.part == "attention":
            return 0 if attention_ok else 1
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}); torch {torch.__version__}", flush=True)
    shape = c.Shape("check", args.layers, args.embd, max(1, args.embd // 64), args.vocab, args.batch, args.length)
    ids = shape.ids().to(device)
    results, int8_model = [], None
    with c.checkpoint(shape) as path:
        loaders = {base: functools.partial(load, path, device) for base, load in c.BASES.items()}
        attach = functools.partial(c.ours, n=args.n, validate_gradients="raise")
        for label, recipe in RECIPES.items():
            if args.only and label not in args.only:
                continue
            result, model = train_path(label, recipe, loaders[recipe.base], attach, ids, args)
            results.append(result)
            status = result.error or f"{_curve(result.losses)}  ({result.seconds:.1f} s)"
            print(f"{label:<36} {status}", flush=True)
            if recipe.base == "int8" and model is not None:
                int8_model = model
        print(f"\n{'path':<36} {'first':>7} {'last':>7} {'prompt':>8} {'grad':>8} {'skipped':>8} {'step MB':>8}  ok")
        for r in results:
            first, last = (r.losses[0], r.losses[-1]) if r.losses else (float("nan"), float("nan"))
            print(
                f"{r.name:<36} {first:>7.3f} {last:>7.3f} {r.prompt_dtype:>8} {r.grad_dtype:>8} {r.skipped:>8} "
                f"{r.peak_bytes / c.MB:>8.1f}  {'yes' if r.ok else 'NO: ' + (r.error or 'see row')}"
            )
        if int8_model is not None:
            diff, bare, effect = portability(int8_model, loaders["fp32"], ids)
            verdict = "ok" if diff <= 2 * bare + 1e-6 and effect > 20 * diff else "NO"
            print(
                f"\nint8-trained adapter loaded on fp32: max |logit diff| {diff:.2e} (bare int8 vs fp32 bases: "
                f"{bare:.2e}; the prompt itself moves logits by {effect:.2e}) -> {verdict}"
            )
            results.append(PathResult("portability", losses=[1, 0], prompt_dtype="float32", grad_dtype="float32"))
            results[-1].error = None if verdict == "ok" else "logits disagree beyond quantization noise"
    required = {label for label, recipe in RECIPES.items() if recipe.required} | {"portability"}
    return 0 if attention_ok and all(r.ok for r in results if r.name in required) else 1


if __name__ == "__main__":
    sys.exit(main())
