"""Many tasks, one base: 16 rows over 4 soft prompts in one batch (`adapter_names`), against the same 16 rows on one
prompt, and against PEFT PROMPT_TUNING, which must run one batch per adapter (4 batches of 4).
Method, targets and commands: bench/README.md.

    python bench/bench_mixed.py            # tiny shape, L=128 and L=32, train step and forward (about 5 minutes)
    python bench/bench_mixed.py --quick    # L=32 only, 2 rounds (well under a minute)
"""

from __future__ import annotations

import argparse

import _common as c
import torch
from _stats import Row, print_table
from peft import PromptTuningConfig

from peft_softprompt_plus import SoftPromptPlusConfig

ADAPTERS = ("default", "b", "c", "d")  # get_peft_model names the first one "default"
N = 50
SAME_WORK = "<= 1.15"  # mixed / one prompt
SPEEDUP = ">= 2.0"  # PEFT 4x4 / ours mixed
EXACT = "<= 1e-05"  # |mean loss mixed - PEFT|


def _ours(shape: c.Shape):
    config = dict(task_type="CAUSAL_LM", num_virtual_tokens=N, validate_gradients="off")
    model = c.ours(shape.base(), N)
    for i, name in enumerate(ADAPTERS[1:]):
        model.add_adapter(name, SoftPromptPlusConfig(init_seed=i + 1, **config))
    for name in ADAPTERS:
        model.base_model.prompt(name).requires_grad_(True)  # every prompt trains at once
    return model


def _peft(shape: c.Shape, ours):
    model = c.peft_prompt_tuning(shape.base(), ours.base_model.prompt("default").detach())
    for name in ADAPTERS[1:]:
        model.add_adapter(name, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N))
        with torch.no_grad():
            c.peft_prompt(model, name).copy_(ours.base_model.prompt(name))
    return model


def bench(shape: c.Shape, train: bool, reps: int, warmup: int, rows: list[Row]) -> None:
    tag = f"{shape.name} L={shape.length} {'train step' if train else 'forward'}"
    ids = shape.ids()
    ours = _ours(shape).train(train)
    mixed_names = [ADAPTERS[i % 4] for i in range(shape.batch)]  # 4 rows per adapter, interleaved
    ref = _peft(shape, ours).train(train)
    params = [ours.base_model.prompt(n) for n in ADAPTERS]
    groups = [[i for i, n in enumerate(mixed_names) if n == name] for name in ADAPTERS]

    def run(fn):
        def step():
            with torch.set_grad_enabled(train):
                loss = fn()
                if train:
                    loss.backward()
            for p in list(params) + list(ref.parameters()):
                p.grad = None

        return step

    def peft_batches():
        total = 0.0
        for name, rows_ in zip(ADAPTERS, groups, strict=True):
            ref.set_adapter(name)
            total = total + ref(input_ids=ids[rows_], labels=ids[rows_]).loss
        return total

    with torch.no_grad():  # the same rows, the same prompts: the same per-row losses
        loss_mixed = ours(input_ids=ids, labels=ids, adapter_names=mixed_names).loss.item()
        loss_peft = peft_batches().item() / 4
    print(f"  [{tag}] mean loss: ours mixed {loss_mixed:.6f}, PEFT 4 batches {loss_peft:.6f}", flush=True)
    steps = {
        "mixed": run(lambda: ours(input_ids=ids, labels=ids, adapter_names=mixed_names).loss),
        "one": run(lambda: ours(input_ids=ids, labels=ids).loss),
        "peft4x4": run(peft_batches),
    }
    times = c.interleaved(steps, reps, warmup)
    for name, t in times.items():
        print(f"  [{tag}] {name:<8} {t.line()}", flush=True)
    rows.append(Row(f"{tag}: |mean loss mixed - PEFT|", abs(loss_mixed - loss_peft), target=EXACT, fmt="{:.1e}"))
    rows.append(Row(f"{tag}: 4 adapters mixed / one adapter", *c.ratio(times, "mixed", "one"), SAME_WORK))
    rows.append(Row(f"{tag}: PEFT 4 batches of 4 / ours mixed", *c.ratio(times, "peft4x4", "mixed"), SPEEDUP))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.timing_flags(parser, quick="L=32 only, 2 rounds after 1 warm-up: a smoke test", reps=7)
    args = parser.parse_args()
    reps, warmup, lengths = (2, 1, (32,)) if args.quick else (args.reps, 2, (128, 32))
    with c.timed_run(args, f"{c.TINY.describe()}; B=16, 4 adapters x N={N}; median of {reps} rounds"):
        rows: list[Row] = []
        for length in lengths:
            for train in (True, False):
                bench(c.TINY.replace(batch=16, length=length), train, reps, warmup, rows)
        print_table(rows)


if __name__ == "__main__":
    main()
