"""What every quality bench shares after its runs: the lists a command line names (seeds, steps), the intervals over
seeds and items, and the Markdown tables the reports print. Standard library only, so a report reads its records
without loading torch; and the figures-against-targets table every bench ends with (`Row`, `print_table`). Timing is
_common.py's (`interleaved`, `Timings`, `timed_run`)."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided, by d.o.f.

Runs = Sequence[Sequence[float]]  # one arm: a run per seed, a value per item


def comma_list(text: str, kind: Callable = int) -> list:
    """ "0,1,2" -> [0, 1, 2]: the comma lists of --seeds, --eval-at, --lrs (empty entries dropped)."""
    return [kind(part) for part in text.split(",") if part.strip()]


def records(path) -> list[dict]:
    """The runs a bench appended to its JSON-lines file, one dict per line."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): a 95% t-interval over seeds; one value gives a zero-width interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def bootstrap(statistic: Callable[..., float], *arms: Runs, paired: bool = True, draws: int = 2000) -> tuple:
    """(point, low, high): `statistic(*arms)` with a 95% percentile interval. Each draw resamples each arm's seeds,
    then the items: one draw of item indices shared by every run of every arm when `paired` (the arms answered the
    same items, so their difference is paired), else a draw per run. Draws where the statistic is NaN are dropped."""
    rng = random.Random(0)
    items = len(arms[0][0])
    values = []
    for _ in range(draws):
        picks = [rng.randrange(items) for _ in range(items)] if paired else None
        drawn = []
        for runs in arms:
            seeds = [rng.choice(runs) for _ in runs]
            if paired:
                drawn.append([[run[i] for i in picks] for run in seeds])
            else:
                drawn.append([[rng.choice(run) for _ in run] for run in seeds])
        values.append(statistic(*drawn))
    values = sorted(v for v in values if v == v)
    return statistic(*arms), values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]


def mean_of_runs(runs: Runs) -> float:
    """The mean over seeds of each run's mean over items."""
    return statistics.fmean(statistics.fmean(run) for run in runs)


def spread(values: Sequence, scale: float = 100, digits: int = 1) -> str:
    """ "median (min–max, n=k)" of the values that exist, "–" if none."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    med, low, high = (f"{scale * v:.{digits}f}" for v in (statistics.median(values), min(values), max(values)))
    return f"{med} ({low}–{high}, n={len(values)})"


def markdown_header(header: Sequence[str]) -> str:
    """A Markdown table's first two lines, for a bench that prints each row as it is measured."""
    return markdown_row(header) + "\n|" + "---|" * len(header)


def markdown_row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table: a header row, the rule, a row per entry."""
    return "\n".join([markdown_header(header), *map(markdown_row, rows)])


_COMPARE = {">=": float.__ge__, "<=": float.__le__, ">": float.__gt__, "<": float.__lt__}


@dataclass
class Row:
    """One line of a result table; `target` is None for context-only figures."""

    what: str
    value: float  # judged against `target`; for timings, from wall-clock medians
    cpu: Optional[float] = None  # the same figure from process-CPU-time medians, as a cross-check
    target: Optional[str] = None  # e.g. ">= 2.0"
    fmt: str = "{:.3f}"

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        op, bound = self.target.split()
        return "PASS" if _COMPARE[op](self.value, float(bound)) else "MISS"


def print_table(rows: list[Row]) -> None:
    cells = [[r.what, r.fmt.format(r.value), "" if r.cpu is None else r.fmt.format(r.cpu), r.target or "", r.verdict]
             for r in rows]  # fmt: skip
    print("\n" + markdown(["measure", "value", "cpu-time", "target", "result"], cells))
    misses = [r for r in rows if r.verdict == "MISS"]
    print(f"\n{len(misses)} of {sum(r.target is not None for r in rows)} targets missed" + ":" * bool(misses))
    for r in misses:
        print(f"  MISS {r.what}: {r.fmt.format(r.value)} (target {r.target})")
    print("value: from wall-clock medians (the verdict); cpu-time: the same ratio from process-CPU-time medians.")
