"""bench_suite.py's `report`: every recorded run as tables with 95% intervals (a bootstrap over seeds and items,
paired items for differences), the curves, and the targets' differences."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

import _suite_ct_report
from _stats import markdown, mean_of_runs
from _suite_scores import best as _best
from _suite_scores import bootstrap
from _suite_scores import final as _final
from _suite_scores import within as _within

REFERENCE = "ours-vocab"  # its training time at STEPS is the equal-time budget
STEPS = 120


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
    latest = {(r["task"], r["variant"], r["seed"]): r for r in records}  # a rerun of a seed replaces it
    runs = defaultdict(list)
    for r in latest.values():
        runs[(r["task"], r["variant"])].append(r)
    for task in sorted({r["task"] for r in records}):
        mine = {v: rs for (t, v), rs in runs.items() if t == task}
        reference = mine.get(REFERENCE, [])
        # The slowest reference run's CPU time: every reference run counts its own step 120, and the other arms get
        # at least as much time as any of ours took.
        budget = max(r["cpu"][-1] for r in reference) if reference else float("inf")
        print(f"\n### {task}: held-out exact match, % (mean [95% interval over items and seeds])")
        if reference:
            print(
                f"equal time = the most training CPU seconds a {REFERENCE} run took for {STEPS} steps: {budget:.0f} s"
            )
        else:
            print(f"no {REFERENCE} run: the equal-time column is each run's last evaluation")
        print()
        rows = []
        for name, rs in sorted(mine.items()):
            trained = rs[0]["steps"][-1] > 0
            per_step = statistics.median(r["cpu"][-1] / r["steps"][-1] for r in rs) if trained else None
            rows.append([
                name,
                _fmt(bootstrap([_final(r) for r in rs]), len(rs)),
                _fmt(bootstrap([_final(r, True) for r in rs]), len(rs)) if trained else "–",
                _fmt(bootstrap([_within(r, budget) for r in rs]), len(rs)) if trained else "–",
                f"{per_step:.2f}" if per_step else "–",
            ])  # fmt: skip
        print(markdown(["arm", "at its last step", "keep best by validation", "at equal time", "CPU s / step"], rows))
        _curves(mine)
        _differences(mine, budget)
        _suite_ct_report.targets(task, mine)


def _curves(mine: dict) -> None:
    """Held-out EM at every evaluation, mean (min-max over seeds), and the training CPU seconds to get there."""
    trained = {name: rs for name, rs in sorted(mine.items()) if rs[0]["steps"][-1] > 0}
    if not trained:
        return
    steps = sorted({s for rs in trained.values() for r in rs for s in r["steps"]})
    rows = []
    for name, rs in trained.items():
        cells = [name]
        for step in steps:
            at = [
                (100 * mean_of_runs([r["items"][i]]), r["cpu"][i])
                for r in rs
                for i, s in enumerate(r["steps"])
                if s == step
            ]
            ems = [em for em, _ in at]
            cpu = statistics.median(c for _, c in at) if at else 0
            cells.append(f"{statistics.mean(ems):.1f} ({min(ems):.1f}–{max(ems):.1f}) [{cpu:.0f}]" if at else "–")
        rows.append(cells)
    print("\ncurve: held-out EM %, mean (min-max over seeds) [median training CPU s]")
    print(markdown(["arm", *(f"step {s}" for s in steps)], rows))


# Our forms of prompt and PEFT's prompt methods: the targets compare our best form with the hard 3-shot and
# with PEFT's best prompt method at equal time. LoRA is context, not a prompt method.
OURS = ("ours-vocab", "ours-kv-vocab", "ours-kv-text", "ours-kv-text-nosink")
PEFT_PROMPTS = ("peft-pt-vocab", "peft-pt-random", "peft-p-tuning", "peft-prefix-text", "peft-cartridge-text")


def _row(a: str, b: str, mine: dict, score, when: str, target: str) -> list:
    diff = bootstrap([score(r) for r in mine[a]], [score(r) for r in mine[b]])
    return [f"{a} - {b}, {when}", _fmt(diff, _pair(mine[a], mine[b]), True), target]


def _differences(mine: dict, budget: float) -> None:
    """The issue's targets as differences with intervals: our best form against hard 3-shot and against PEFT's best
    prompt method at equal time, each of our forms against PEFT's, each option against the defaults."""
    within = lambda r: _within(r, budget)  # noqa: E731
    best = _best(mine, OURS, _final)
    if best is None:
        return
    rows = []
    if "hard-3shot" in mine:
        rows.append(_row(best, "hard-3shot", mine, _final, "step 120 (our best form)", ">= +15"))
    rival = _best(mine, PEFT_PROMPTS, within)
    if rival:
        rows.append(_row(_best(mine, OURS, within), rival, mine, within, "equal time (each side's best)", ">= +5"))
    for ours in (name for name in OURS if name in mine):
        for other in (name for name in (*PEFT_PROMPTS, "peft-lora-r8") if name in mine):
            rows.append(_row(ours, other, mine, _final, "step 120", "context"))
            rows.append(_row(ours, other, mine, within, "equal time", "context"))
    if REFERENCE in mine:
        ours = mine[REFERENCE]
        if "ours-3shot-after" in mine and "hard-3shot" in mine:  # placement as a route to the 3-shot target
            rows.append(_row("ours-3shot-after", "hard-3shot", mine, _final, "step 120", ">= +15"))
        keep = bootstrap([_final(r, True) for r in ours], [_final(r) for r in ours])
        rows.append([f"{REFERENCE} + keep best - {REFERENCE}", _fmt(keep, len(ours), True), "option effect"])
        options = ("ours-bos", "ours-transfer", "ours-system-turn", "ours-3shot-after", "ours-labels", "ours-random")
        for option in (name for name in options if name in mine):
            rows.append(_row(option, REFERENCE, mine, _final, "step 120", "option effect"))
    print("\n" + markdown(["comparison", "points [95% interval]", "target"], rows))
