"""bench_suite.py's `report`: every recorded run as tables with 95% intervals (a bootstrap over seeds and items,
paired items for differences), the curves, and the targets' differences."""

from __future__ import annotations

import json
import random
import statistics
from collections import defaultdict
from typing import Optional

REFERENCE = "ours-vocab"  # its training time at STEPS is the equal-time budget
STEPS = 120


def _final(record: dict, keep_best: bool = False) -> list[bool]:
    """Per-item matches at the last evaluation, or (keep_best) at the evaluation with the best validation score."""
    if keep_best and record["validation"][-1] is not None:
        best = max(range(len(record["validation"])), key=lambda i: (record["validation"][i], -i))
        return record["items"][best]
    return record["items"][-1]


def _within(record: dict, budget: float) -> list[bool]:
    """Per-item matches at the last evaluation whose training CPU time fits in `budget` (the start if none)."""
    fitting = [i for i, c in enumerate(record["cpu"]) if c <= budget * 1.02]
    return record["items"][fitting[-1]] if fitting else record["items"][0]


def bootstrap(runs_a: list[list[bool]], runs_b: Optional[list[list[bool]]] = None, draws: int = 2000) -> tuple:
    """Mean exact match of A (minus B's, when given), points, with a 95% interval over seeds and items: each draw
    resamples the seeds of each arm, then the items (the same items for both arms: they are paired)."""
    rng = random.Random(0)
    items = len(runs_a[0])

    def mean(runs, picks):
        return sum(sum(run[i] for i in picks) / len(picks) for run in runs) / len(runs)

    def value(picks, a, b):
        return 100 * (mean(a, picks) - (mean(b, picks) if b else 0.0))

    point = value(range(items), runs_a, runs_b)
    values = []
    for _ in range(draws):
        picks = [rng.randrange(items) for _ in range(items)]
        a = [rng.choice(runs_a) for _ in runs_a]
        b = [rng.choice(runs_b) for _ in runs_b] if runs_b else None
        values.append(value(picks, a, b))
    values.sort()
    return point, values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def _fmt(triple: tuple, seeds, signed: bool = False) -> str:
    """`seeds`: the runs behind the figure, an int or "5 vs 2" for a difference of two arms."""
    point, low, high = triple
    sign = "+" if signed else ""
    return f"{point:{sign}.1f} [{low:{sign}.1f}, {high:{sign}.1f}] (n={seeds})" if seeds else "–"


def _pair(a: list, b: list) -> str:
    return f"{len(a)} vs {len(b)}"


def cmd_report(args) -> None:
    with open(args.out, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    runs = defaultdict(list)
    for r in records:
        runs[(r["task"], r["variant"])].append(r)
    for task in sorted({r["task"] for r in records}):
        mine = {v: rs for (t, v), rs in runs.items() if t == task}
        reference = mine.get(REFERENCE, [])
        # The slowest reference run's CPU time: every reference run counts its own step 120, and the other arms get
        # at least as much time as any of ours took.
        budget = max(r["cpu"][-1] for r in reference) if reference else float("inf")
        print(f"\n### {task}: held-out exact match, % (mean [95% interval over items and seeds])")
        print(f"equal time = the most training CPU seconds a {REFERENCE} run took for {STEPS} steps: {budget:.0f} s\n")
        print("| arm | at step 120 | keep best by validation | at equal time | CPU s / step |")
        print("|---|---|---|---|---|")
        for name, rs in sorted(mine.items()):
            trained = rs[0]["steps"][-1] > 0
            per_step = statistics.median(r["cpu"][-1] / r["steps"][-1] for r in rs) if trained else None
            cells = [
                _fmt(bootstrap([_final(r) for r in rs]), len(rs)),
                _fmt(bootstrap([_final(r, True) for r in rs]), len(rs)) if trained else "–",
                _fmt(bootstrap([_within(r, budget) for r in rs]), len(rs)) if trained else "–",
                f"{per_step:.2f}" if per_step else "–",
            ]
            print(f"| {name} | " + " | ".join(cells) + " |")
        _curves(mine)
        _differences(mine, budget)


def _curves(mine: dict) -> None:
    """Held-out EM at every evaluation, mean (min-max over seeds), and the training CPU seconds to get there."""
    trained = {name: rs for name, rs in sorted(mine.items()) if rs[0]["steps"][-1] > 0}
    if not trained:
        return
    steps = sorted({s for rs in trained.values() for r in rs for s in r["steps"]})
    print("\ncurve: held-out EM %, mean (min-max over seeds) [median training CPU s]")
    print("| arm | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for name, rs in trained.items():
        cells = []
        for step in steps:
            at = [
                (100 * sum(r["items"][i]) / len(r["items"][i]), r["cpu"][i])
                for r in rs
                for i, s in enumerate(r["steps"])
                if s == step
            ]
            if not at:
                cells.append("–")
                continue
            ems = [em for em, _ in at]
            cpu = statistics.median(c for _, c in at)
            cells.append(f"{statistics.mean(ems):.1f} ({min(ems):.1f}–{max(ems):.1f}) [{cpu:.0f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")


def _differences(mine: dict, budget: float) -> None:
    """The issue's targets as differences with intervals: defaults vs hard 3-shot and vs PEFT, each option vs the
    defaults."""
    if REFERENCE not in mine:
        return
    ours = mine[REFERENCE]
    print("\n| comparison | points [95% interval] | target |")
    print("|---|---|---|")
    peft = ("peft-pt-vocab", "peft-pt-random", "peft-p-tuning", "peft-lora-r8")
    for other in ("hard-3shot", *peft):
        if other in mine:
            diff = bootstrap([_final(r) for r in ours], [_final(r) for r in mine[other]])
            target = ">= +15" if other == "hard-3shot" else "context"
            print(f"| {REFERENCE} - {other}, step 120 | {_fmt(diff, _pair(ours, mine[other]), True)} | {target} |")
    for other in peft:
        if other in mine:
            diff = bootstrap([_within(r, budget) for r in ours], [_within(r, budget) for r in mine[other]])
            target = ">= +5" if other.startswith("peft-pt-") else "context"
            print(f"| {REFERENCE} - {other}, equal time | {_fmt(diff, _pair(ours, mine[other]), True)} | {target} |")
    placed, hard = mine.get("ours-3shot-after"), mine.get("hard-3shot")
    if placed and hard:  # placement as a route to the 3-shot target
        diff = bootstrap([_final(r) for r in placed], [_final(r) for r in hard])
        print(f"| ours-3shot-after - hard-3shot, step 120 | {_fmt(diff, _pair(placed, hard), True)} | >= +15 |")
    keep = bootstrap([_final(r, True) for r in ours], [_final(r) for r in ours])
    print(f"| {REFERENCE} + keep best - {REFERENCE} | {_fmt(keep, len(ours), True)} | option effect |")
    for option in ("ours-bos", "ours-transfer", "ours-system-turn", "ours-3shot-after", "ours-labels", "ours-random"):
        if option in mine:
            diff = _fmt(
                bootstrap([_final(r) for r in mine[option]], [_final(r) for r in ours]),
                _pair(mine[option], ours),
                True,
            )
            print(f"| {option} - {REFERENCE}, step 120 | {diff} | option effect |")
