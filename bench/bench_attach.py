"""Cost of the attach-time gradient probe: `get_peft_model` with `validate_gradients="raise"` against `"off"`, and the
probe alone against its floor, one forward+backward of the base over N+1 positions. Target: "raise" / "off" <= 1.05
(the probe adds at most 5% to `get_peft_model`). Method and commands: bench/README.md.

    python bench/bench_attach.py            # GPT-2-small shape, 7 rounds (about a minute on 2 cores)
    python bench/bench_attach.py --quick    # tiny shape, 3 rounds (seconds)
"""

from __future__ import annotations

import argparse

import _common as c
import torch
from _stats import Row, print_table

from peft_softprompt_plus import check_gradient_flow

TARGET = "<= 1.05"  # get_peft_model with the probe / without it


def _floor(base, tokens: int) -> None:
    """The least work that proves a gradient crosses every layer: one forward+backward over N+1 positions."""
    embeds = torch.randn(1, tokens + 1, base.config.n_embd, requires_grad=True)  # [1, N+1, D]
    loss = base(inputs_embeds=embeds, labels=torch.zeros(1, tokens + 1, dtype=torch.long)).loss
    torch.autograd.grad(loss, [embeds])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.timing_flags(parser, quick="tiny shape, 3 rounds: a smoke test in seconds", reps=7)
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (12; 4 with --quick)")
    parser.add_argument("--num-virtual-tokens", type=int, default=20)
    args = parser.parse_args()
    shape = c.TINY if args.quick else c.SMALL
    shape = shape.replace(n_layer=args.layers or shape.n_layer)
    reps, tokens = 3 if args.quick else args.reps, args.num_virtual_tokens
    with c.timed_run(args, f"{shape.describe()}, N={tokens}; median of {reps} rounds after 1 warm-up round"):
        run(shape, reps, tokens)


def run(shape: c.Shape, reps: int, tokens: int) -> None:
    bases = [shape.base().eval()]  # attaching wraps it in place; unloading (untimed) hands the next call a bare base

    def attach(mode: str):
        return lambda: c.ours(bases[0], tokens, validate_gradients=mode)

    def detach(model) -> None:
        bases[0] = model.base_model.unload()

    attach_times = c.interleaved({"off": attach("off"), "raise": attach("raise")}, reps, 1, after=detach)
    model, floor_base = c.ours(bases[0], tokens), shape.base().eval()
    probe_times = c.interleaved(
        {"probe": lambda: check_gradient_flow(model), "floor": lambda: _floor(floor_base, tokens)}, reps, 1
    )
    times = {**attach_times, **probe_times}
    for name, t in times.items():
        print(f"  {name:<6} {t.line()}", flush=True)
    off_ms = (1e3 * times["off"].med(), 1e3 * times["off"].med("cpu"))
    rows = [
        Row("get_peft_model, validate_gradients='off', ms (context)", *off_ms, fmt="{:.1f}"),
        Row("probe alone / floor (context)", *c.ratio(times, "probe", "floor")),
        Row("get_peft_model, validate_gradients 'raise' / 'off'", *c.ratio(times, "raise", "off"), TARGET),
    ]
    print_table(rows)


if __name__ == "__main__":
    main()
