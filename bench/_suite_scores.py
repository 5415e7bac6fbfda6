"""What bench_suite.py's reports read off a recorded run (`_suite_report.py`, `_suite_ct_report.py`): its per-item
matches at the last evaluation, at its best validation or within a CPU budget; an arm's best among several; and the
points between two arms with a 95% interval (a bootstrap over seeds and items, paired items)."""

from __future__ import annotations

from typing import Optional

import _stats
from _stats import mean_of_runs


def final(record: dict, keep_best: bool = False) -> list[bool]:
    """Per-item matches at the last evaluation, or (keep_best) at the evaluation with the best validation score."""
    if keep_best and record["validation"][-1] is not None:
        best = max(range(len(record["validation"])), key=lambda i: (record["validation"][i], -i))
        return record["items"][best]
    return record["items"][-1]


def within(record: dict, budget: float) -> list[bool]:
    """Per-item matches at the last evaluation whose training CPU time fits in `budget` (the start if none)."""
    fitting = [i for i, c in enumerate(record["cpu"]) if c <= budget * 1.02]
    return record["items"][fitting[-1]] if fitting else record["items"][0]


def _difference(a, b=None) -> float:
    """Points of exact match: A's mean over seeds and items, minus B's when given."""
    return 100 * (mean_of_runs(a) - (mean_of_runs(b) if b is not None else 0.0))


def bootstrap(runs_a: list[list[bool]], runs_b: Optional[list[list[bool]]] = None) -> tuple:
    """Mean exact match of A (minus B's, when given), points, with a 95% interval over seeds and items (the same
    items for both arms: they are paired)."""
    return _stats.bootstrap(_difference, *([runs_a] if runs_b is None else [runs_a, runs_b]))


def best(mine: dict, names, score) -> Optional[str]:
    """The arm among `names` with the highest mean of `score(record)` (per-item matches), None if none ran."""
    ran = [name for name in names if name in mine]
    return max(ran, key=lambda name: mean_of_runs([score(r) for r in mine[name]])) if ran else None
