"""bench_quality.py's `report`: the tables from every recorded run (median and spread over seeds, at equal steps and
at equal training time), the learning-rate table, the curves and bench/quality.png. It holds the harness's shape
(N, STEPS, BATCH), which bench_quality.py trains with and imports from here; the variants come as an argument."""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from typing import Optional

import _stats
from _stats import Row, markdown, print_table, spread

N = 20  # virtual tokens of every trained prompt
STEPS = 120
BATCH = 16
PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quality.png")
REFERENCE = "ours-random"  # its training time at STEPS is the equal-time budget


def _score_at(record: dict, step: int) -> Optional[float]:
    return next(
        (s for t, s in zip(record["steps"], record["score"], strict=True) if t == step and s is not None), None
    )


def _score_within(record: dict, budget: float) -> Optional[float]:
    """The score after `budget` seconds of training CPU time, interpolated linearly between evaluations (a run
    that finishes sooner keeps its last score: no variant trains past STEPS)."""
    points = [(c, s) for c, s in zip(record["cpu"], record["score"], strict=True) if s is not None]
    if not points:
        return None
    if budget >= points[-1][0]:
        return points[-1][1]
    for (c0, s0), (c1, s1) in zip(points, points[1:], strict=False):
        if c0 <= budget <= c1:
            return s0 + (s1 - s0) * (budget - c0) / (c1 - c0)
    return None  # the budget ends before its first evaluation


def _nll_at(record: dict, step: int) -> Optional[float]:
    values = record.get("held_out_nll") or []
    return next((v for t, v in zip(record["steps"], values, strict=False) if t == step and v is not None), None)


def cmd_report(args, variants: dict) -> None:
    """`variants`: bench_quality.VARIANTS (name -> Variant: its `about`, `lr`, and `build`, None for a hard prompt)."""
    records = _stats.records(args.out)
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["variant"], r["lr"])].append(r)
    main = {name: groups[(name, v.lr)] for name, v in variants.items() if groups.get((name, v.lr))}
    reference = main.get(REFERENCE, [])
    budget = statistics.median(r["cpu"][-1] for r in reference) if reference else None
    print(f"held-out exact match, % (median (min–max, seeds)); N={N}, batch {BATCH}, AdamW, {STEPS} steps")
    if budget:
        print(f"equal time: the training CPU seconds {REFERENCE} needs for {STEPS} steps = {budget:.0f} s\n")
    rows = []
    for name, rs in main.items():
        final = [_score_at(r, STEPS) if variants[name].build else r["score"][0] for r in rs]
        timed = [_score_within(r, budget) if budget and variants[name].build else None for r in rs]
        per_step = statistics.median(r["cpu"][-1] / r["steps"][-1] for r in rs) if variants[name].build else None
        step_text = f"{per_step:.2f}" if per_step else "–"
        lr = f"{rs[0]['lr']:g}" if variants[name].build else "–"
        nll = [_nll_at(r, STEPS if variants[name].build else 0) for r in rs]
        rows.append([name, lr, spread(final), spread(timed), spread(nll, 1, 3), step_text, variants[name].about])
    header = ["variant", "lr", f"EM, step {STEPS}", f"EM in {budget or 0:.0f} s", f"NLL, step {STEPS}"]
    print(markdown([*header, "CPU s / step", "about"], rows))
    spreads = _lr_table(groups)
    _curves(main, budget, groups, variants)
    _targets(main, spreads)


def _median_final(rs: list[dict]) -> Optional[float]:
    finals = [s for s in (_score_at(r, STEPS) if r["steps"][-1] else r["score"][0] for r in rs) if s is not None]
    return statistics.median(finals) if finals else None


def _targets(main: dict, spreads: dict) -> None:
    """Issue 20's targets, in points of held-out exact match (medians over seeds at step STEPS)."""
    medians = {name: _median_final(rs) for name, rs in main.items()}
    medians = {k: v for k, v in medians.items() if v is not None}
    ours = {k: v for k, v in medians.items() if k.startswith("ours-") and "gain1" not in k}
    peft_pt = {k: v for k, v in medians.items() if k.startswith("peft-pt-")}
    rows = []
    if ours and peft_pt:
        best, best_peft = max(ours, key=ours.get), max(peft_pt, key=peft_pt.get)
        gap = 100 * (ours[best] - peft_pt[best_peft])
        rows.append(Row(f"best ours ({best}) - best PEFT PROMPT_TUNING ({best_peft}), points", gap, target=">= 5"))
    if ours and "hard-3shot" in medians:
        best = max(ours, key=ours.get)
        rows.append(
            Row(
                f"best ours ({best}) - hard 3-shot, points", 100 * (ours[best] - medians["hard-3shot"]), target=">= 15"
            )
        )
    if {"ours-residual", "ours-random"} <= medians.keys():
        diff = 100 * (medians["ours-residual"] - medians["ours-random"])
        rows.append(Row("residual - plain (random init), points", diff, target=">= 0"))
    if {"ours-residual", "ours-random"} <= spreads.keys():
        diff = spreads["ours-residual"] - spreads["ours-random"]
        rows.append(Row("lr spread residual - plain, points (smaller is better)", diff, target="<= 0"))
    if "peft-lora-r8" in medians and ours:
        best = max(ours, key=ours.get)
        rows.append(
            Row(f"LoRA r=8 - best ours ({best}), points (context)", 100 * (medians["peft-lora-r8"] - ours[best]))
        )
    if rows:
        print_table([dataclasses.replace(r, fmt="{:.1f}") for r in rows])


def _lr_table(groups) -> dict[str, float]:
    by_variant = defaultdict(dict)
    for (name, lr), rs in groups.items():
        finals = [s for s in (_score_at(r, STEPS) for r in rs) if s is not None]
        if finals:
            by_variant[name][lr] = finals
    swept = {n: lrs for n, lrs in by_variant.items() if len(lrs) > 2}
    if not swept:
        return {}
    spreads = {}
    print(f"\nlearning-rate sweep: held-out EM % at step {STEPS}, median over seeds; spread = max - min of medians")
    lrs = sorted({lr for table in swept.values() for lr in table})
    rows = []
    for name, table in swept.items():
        medians = {lr: statistics.median(v) for lr, v in table.items()}
        cells = [f"{100 * medians[lr]:.1f}" if lr in medians else "–" for lr in lrs]
        spreads[name] = 100 * (max(medians.values()) - min(medians.values()))
        rows.append([name, *cells, f"{spreads[name]:.1f}"])
    print(markdown(["variant", *(f"{lr:g}" for lr in lrs), "spread"], rows))
    return spreads


def _curves(main: dict, budget: Optional[float], groups: dict, variants: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(no plot: matplotlib is not installed; pip install -e '.[bench]')")
        return
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    _lr_panel(axes[2], groups)
    axes = axes[:2]
    for name, rs in main.items():
        if variants[name].build is None:
            flat = [r["score"][0] for r in rs if r["score"][0] is not None]
            for ax in axes:
                ax.axhline(100 * statistics.median(flat), linestyle=":", color="gray")
                ax.annotate(name, (0, 100 * statistics.median(flat)), fontsize=8, color="gray")
            continue
        steps = [t for t, s in zip(rs[0]["steps"], rs[0]["score"], strict=True) if s is not None]
        cols = [[_score_at(r, t) for r in rs] for t in steps]
        med = [100 * statistics.median([v for v in col if v is not None]) for col in cols]
        low = [100 * min(v for v in col if v is not None) for col in cols]
        high = [100 * max(v for v in col if v is not None) for col in cols]
        cpu = [statistics.median(r["cpu"][r["steps"].index(t)] for r in rs) for t in steps]
        for ax, x in zip(axes, (steps, cpu), strict=True):
            (line,) = ax.plot(x, med, marker="o", label=name)
            ax.fill_between(x, low, high, alpha=0.15, color=line.get_color())
    axes[0].set(xlabel="optimizer steps (batch 16)", ylabel="held-out exact match, %", title="equal steps")
    axes[1].set(xlabel="training CPU seconds (1 thread)", title="equal training time")
    if budget:
        axes[1].axvline(budget, linestyle="--", color="black", linewidth=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, capitals task (160 train / 88 held out): median and range over seeds")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    print(f"\nplot: {PLOT}")


def _lr_panel(ax, groups: dict) -> None:
    """Held-out EM at step STEPS against the learning rate, for every variant run at more than two of them."""
    by_variant = defaultdict(dict)
    for (name, lr), rs in groups.items():
        finals = [s for s in (_score_at(r, STEPS) for r in rs) if s is not None]
        if finals:
            by_variant[name][lr] = finals
    for name, table in sorted(by_variant.items()):
        if len(table) <= 2:
            continue
        lrs = sorted(table)
        ax.plot(lrs, [100 * statistics.median(table[lr]) for lr in lrs], marker="o", label=name)
        for lr in lrs:
            ax.scatter([lr] * len(table[lr]), [100 * v for v in table[lr]], s=8, color="gray", alpha=0.5)
    ax.set(xscale="log", xlabel="learning rate (AdamW)", ylabel=f"held-out exact match at step {STEPS}, %",
           title="learning-rate sensitivity")  # fmt: skip
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
