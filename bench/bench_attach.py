"""Cost of the attach-time gradient probe: median `get_peft_model` time with `validate_gradients="raise"` against
`"off"`, on a GPT-2-small-shaped random model built from its config (no download).

    python bench/bench_attach.py [--repeats 7] [--threads 1]

Runs interleave the two modes so that load from other processes hits both alike, and both wall time and process CPU
time are reported (on a shared machine, CPU time with one thread is the steadier of the two). It also times the
probe alone and, as its floor, one plain forward+backward of the base model over the same positions (N + 1).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time

import torch
from peft import get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

import peft_softprompt_plus  # noqa: F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig, gradient_flow

TARGET = 0.05  # the budget: the probe may add at most 5% to get_peft_model


def _timed(fn):
    """`fn()`'s result, and its (wall, CPU) seconds."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, (time.perf_counter() - wall, time.process_time() - cpu)


def _attach(base, mode: str, tokens: int):
    return get_peft_model(
        base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=tokens, validate_gradients=mode)
    )


def _floor(base, tokens: int) -> None:
    """The least work that proves a gradient crosses every layer: one forward+backward over N+1 positions."""
    embeds = torch.randn(1, tokens + 1, base.config.n_embd, requires_grad=True)  # [1, N+1, D]
    loss = base(inputs_embeds=embeds, labels=torch.zeros(1, tokens + 1, dtype=torch.long)).loss
    torch.autograd.grad(loss, [embeds])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared CPU)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--virtual-tokens", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=50257)
    base = GPT2LMHeadModel(config).eval()
    tokens = args.virtual_tokens

    times: dict[str, list[tuple[float, float]]] = {"off": [], "raise": []}
    for i in range(args.repeats + 1):  # round 0 warms up allocator and kernels
        for mode in ("off", "raise") if i % 2 else ("raise", "off"):
            model, elapsed = _timed(functools.partial(_attach, base, mode, tokens))
            base = model.base_model.unload()
            if i:
                times[mode].append(elapsed)

    model = _attach(base, "off", tokens)
    probe = functools.partial(gradient_flow.validate_at_attach, model.base_model, "default", "raise")
    probe_times = [_timed(probe)[1] for _ in range(args.repeats)]
    base = model.base_model.unload()
    floor_times = [_timed(functools.partial(_floor, base, tokens))[1] for _ in range(args.repeats)]

    print(
        f"GPT-2-small shape ({args.layers} layers x 768, vocab 50257), N={tokens}, threads={args.threads}, "
        f"{args.repeats} runs each, medians in ms:"
    )
    print(f"  {'':44s} {'wall':>8s} {'CPU':>8s}")
    rows = {
        "get_peft_model, validate_gradients='off'": times["off"],
        "get_peft_model, validate_gradients='raise'": times["raise"],
        "probe alone (validate_at_attach)": probe_times,
        "floor: one fwd+bwd of the base, N+1 positions": floor_times,
    }
    medians = {name: [1e3 * statistics.median(t[k] for t in runs) for k in (0, 1)] for name, runs in rows.items()}
    for name, (wall, cpu) in medians.items():
        print(f"  {name:44s} {wall:8.1f} {cpu:8.1f}")
    (off_wall, off_cpu), (on_wall, on_cpu) = list(medians.values())[:2]
    overhead = {"wall": on_wall / off_wall - 1, "CPU": on_cpu / off_cpu - 1}
    probe_cpu, floor_cpu = medians["probe alone (validate_at_attach)"][1], list(medians.values())[3][1]
    print(f"  probe / floor (CPU): {probe_cpu / floor_cpu:.2f}x")
    verdict = "MET" if max(overhead.values()) <= TARGET else "NOT MET"
    print(
        f"RESULT: the probe adds {100 * overhead['CPU']:.0f}% (CPU) / {100 * overhead['wall']:.0f}% (wall) to "
        f"get_peft_model; target <= {100 * TARGET:.0f}%: {verdict}"
    )


if __name__ == "__main__":
    main()
