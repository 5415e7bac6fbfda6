"""bench_suite.py `report`'s context-tuning targets, per task: our best context-tuning form against PEFT's best
prefix or cartridge arm at equal CPU time (>= +5), against hard k-shot with the same demonstrations (>= +5) and
against hard 3-shot (>= +15), each a PASS/MISS row judged on the point estimate with its 95% interval beside it;
and the CPU seconds per step of every trained arm against PEFT's.

"Our best form" is picked among the `ct-*` arms run on the most seeds (an ablation's single lucky seed can't be it);
"equal time": each PEFT arm's median training CPU for all its steps, ours read at its last evaluation inside it.
Every difference is over the seeds both arms ran (the runs column counts them), so a one-seed ablation is read
against its parent's same seed."""

from __future__ import annotations

import re
import statistics
from typing import Optional

from _stats import Row, markdown
from _suite_scores import best as _best
from _suite_scores import bootstrap
from _suite_scores import final as _final
from _suite_scores import within as _within

PEFT_PREFIX = re.compile(r"^peft-(prefix|cartridge)-")
CT = re.compile(r"^ct-k(\d+)")


def _budget(runs: list[dict]) -> float:
    return statistics.median(r["cpu"][-1] for r in runs)


def targets(task: str, mine: dict) -> None:
    """Print the targets' rows for `task` (`mine`: arm -> its records), if it has a context-tuning arm."""
    ct = [n for n in mine if CT.match(n) and mine[n][0]["steps"][-1] > 0]
    if not ct:
        return
    most = max(len(mine[n]) for n in ct)
    best = _best(mine, [n for n in ct if len(mine[n]) == most], _final)
    peft = [n for n in mine if PEFT_PREFIX.match(n)]
    rows, lines = [], []

    def row(what: str, a: list, b: list, target: Optional[str]) -> None:
        a, b = _common(a, b)
        point, low, high = bootstrap([score(r) for score, r in a], [score(r) for score, r in b])
        verdict = Row(what, point, target=target).verdict
        rows.append([what, f"{point:+.1f} [{low:+.1f}, {high:+.1f}]", f"{len(a)} vs {len(b)}", target or "", verdict])

    if peft:  # the PEFT arm that does best at its own 120 steps, and ours inside that arm's CPU time
        rival = _best(mine, peft, _final)
        budget = _budget(mine[rival])
        ours = [(lambda r: _within(r, budget), r) for r in mine[best]]
        row(f"{best} - {rival}, equal time ({budget:.0f} CPU s)", ours, _at(mine[rival]), ">= 5")
        for other in sorted(set(peft) - {rival}):  # the other PEFT arms, each at its own time, for context
            spent = _budget(mine[other])
            mine_then = [(lambda r, spent=spent: _within(r, spent), r) for r in mine[best]]
            row(f"{best} - {other}, equal time ({spent:.0f} CPU s)", mine_then, _at(mine[other]), None)
    k = CT.match(best).group(1)
    for name, target in ((f"hard-demos-k{k}", ">= 5"), ("hard-3shot", ">= 15")):
        if name in mine:
            row(f"{best} - {name}, last step", _at(mine[best]), _at(mine[name]), target)
    for name, parent in _ablations(ct):
        row(f"{name} - {parent}, last step", _at(mine[name]), _at(mine[parent]), None)
    for name in sorted(n for n in mine if mine[n][0]["steps"][-1] > 0 and (n in ct or n in peft)):
        cost = statistics.median(r["cpu"][-1] / r["steps"][-1] for r in mine[name])
        lines.append([name, f"{cost:.2f}", len(mine[name])])
    print(f"\n#### {task}: context tuning's targets (our best form: {best}, run on {most} seeds)")
    print("\n" + markdown(["comparison", "points [95% interval]", "runs", "target", "result"], rows))
    print("\n" + markdown(["trained arm", "training CPU s / step (median)", "runs"], lines))


def _at(runs: list[dict]) -> list:
    return [(_final, r) for r in runs]


def _common(a: list, b: list) -> tuple[list, list]:
    """Both arms' (score, record) pairs on the seeds both ran (paired by seed as well as by item), or all of each
    where they share none."""
    seeds = {r["seed"] for _, r in a} & {r["seed"] for _, r in b}
    return ([x for x in a if x[1]["seed"] in seeds], [x for x in b if x[1]["seed"] in seeds]) if seeds else (a, b)


def _ablations(names: list[str]) -> list[tuple[str, str]]:
    """(arm, the arm it ablates): each option of an arm's name (`-noloo`, `-n20`, `-many`...) taken out in turn,
    where that arm ran too."""
    pairs = []
    for name in sorted(names):
        parts = name.split("-")  # ["ct", "k16", options...]
        for i in range(2, len(parts)):
            parent = "-".join(parts[:i] + parts[i + 1 :])
            if parent in names:
                pairs.append((name, parent))
    return pairs
