"""bench_distill_content.py's table (`--table`): every recorded arm on one prompt, side by side, over its seeds.

- KL gap closed on the held-out turns: mean with a 95% t-interval over seeds (one seed: the value alone).
- Content kept on the prompt folder's user probes (hand-written questions with their facts), refusal probes aside:
  (student - none) / (teacher - none) on the facts each question needs, with a 95% bootstrap interval over seeds
  and questions.
- Refusals: the share of off-topic probes (`"kind": "refusal"`) whose reply carries the refusal's words (the
  probe's facts), teacher against student.
- CPU seconds of training, and the KL gap closed at the cheapest arm's CPU budget where the arm's curve reaches it.
- Positions read: the student's prompt positions (N, and an input student's kept text) over the system turn's.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from _stats import bootstrap, markdown, t_interval

from peft_softprompt_plus.distill.content import words


def knobs(record: dict) -> str:
    """The recipe of a record beyond its arm's name: its learning rate (or "untrained"), steps and flags."""
    tags = ["untrained"] if record["lr"] < 1e-6 else [f"lr {record['lr']:g}", f"{record['steps']} steps"]
    if record["lr"] >= 1e-6:
        tags += ["self-study" if record.get("self_study") else ""]
        tags += [f"top {record['kl_top_k']}" if record.get("kl_top_k") else ""]
        sink = record.get("kv_frozen_positions")
        tags += [f"sink {sink}" if sink is not None else ""]
        tags += [f"system turn's text at {record['prompt_text_weight']:g}" if record.get("prompt_text_weight") else ""]
    if "selected" in record["arm"] and not record.get("kv_selection"):
        tags.append("first 32 rows' attention")  # the selection before it read replies over every kind of row
    return ", ".join(t for t in tags if t)


def _mean_interval(values: list[float]) -> str:
    mean, low, high = t_interval(values)
    return f"{mean:.1%}" if len(values) < 2 else f"{mean:.1%} [{low:.1%}, {high:.1%}]"


def _gap_cell(records: list[dict]) -> str:
    """The KL gap over the seeds that have one on the standard held-out turns (a self-study seed without the
    standard samples has none: said with the count)."""
    gaps = [r["gap_closed"] for r in records if r["gap_closed"] == r["gap_closed"]]
    if not gaps:
        return "–"
    return _mean_interval(gaps) + ("" if len(gaps) == len(records) else f" ({len(gaps)} of {len(records)} seeds)")


def _shares(record: dict, refusals: set[str]) -> tuple[list[dict], list[dict]]:
    """Per question: each reader's share of the facts (content probes), or whether it carried them all (refusals)."""
    content, steered = [], []
    for row in record["user_replies"]:
        facts = set().union(*(words(fact) for fact in row["facts"]))
        share = {r: len(words(row[r]) & facts) / len(facts) for r in ("teacher", "student", "none")}
        (steered if row["question"] in refusals else content).append(share)
    return content, steered


def _kept(runs: list[list[dict]]) -> float:
    mean = {r: statistics.fmean(s[r] for run in runs for s in run) for r in ("teacher", "student", "none")}
    gain = mean["teacher"] - mean["none"]
    return (mean["student"] - mean["none"]) / gain if gain > 0 else float("nan")


def _kept_interval(runs: list[list[dict]]) -> str:
    # Each seed's questions are drawn on their own: a share is a ratio of means, not an item-paired difference.
    point, low, high = bootstrap(_kept, runs, paired=False)
    return f"{point:.0%} [{low:.0%}, {high:.0%}]"


def table(log: Path, prompt: str, data: Path) -> str:
    """The Markdown table of every arm recorded in `log` on the prompt folder `prompt` (its name; "" the top one)."""
    probes = [json.loads(line) for line in (data / "user_probes.jsonl").read_text().splitlines() if line.strip()]
    refusals = {p["question"] for p in probes if p.get("kind") == "refusal"}
    arms, rescored = defaultdict(list), {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("prompt") != prompt:
            continue
        if record.get("score_only") and record.get("held_out_gap_closed"):  # on the standard samples' held-out turns
            rescored[(record["arm"], record.get("knobs", ""), record["seed"])] = record["held_out_gap_closed"][
                "student"
            ]
        elif not record.get("score_only") and "user_replies" in record:
            arms[(record["arm"], knobs(record))].append(record)
    for rs in arms.values():  # a self-study arm's own held-out turns are its own kind: read the standard ones
        for r in rs:
            if r.get("self_study"):
                r["gap_closed"] = rescored.get((r["arm"], r.get("knobs", " self-study"), r["seed"]), float("nan"))
    trained = [rs for (_, tag), rs in arms.items() if tag != "untrained"] or [[{"seconds": 0.0}]]
    budget = min(statistics.median(r.get("train_cpu", r["seconds"]) for r in rs) for rs in trained)
    header = [
        "arm", "seeds", "KL gap closed", "content kept", "refusals steered: teacher / student",
        "kept text alone: gap / content", "positions read", "CPU s (train)", "gap at equal CPU",
    ]  # fmt: skip
    rows = []
    for (arm, tag), rs in sorted(arms.items()):
        runs = [_shares(r, refusals) for r in rs]
        content, steered = [c for c, _ in runs], [s for _, s in runs]
        flat = [s for run in steered for s in run]
        rate = {r: statistics.fmean(s[r] == 1 for s in flat) if flat else 0.0 for r in ("teacher", "student")}
        refuse = "–" if not flat else f"{rate['teacher']:.0%} / {rate['student']:.0%}"
        alone = [r["kept_text_only"] for r in rs if r.get("kept_text_only")]
        alone_gap, alone_kept = (
            statistics.fmean(a[k] for a in alone) if alone else 0.0 for k in ("gap_closed", "kept")
        )
        alone_text = "–" if not alone else f"{alone_gap:.1%} / {alone_kept:.0%}"
        cpu = statistics.median(r.get("train_cpu", r["seconds"]) for r in rs)
        name = f"{arm}{' (' + tag + ')' if tag else ''}"
        kept = _kept_interval(content)
        row = [name, len(rs), _gap_cell(rs), kept, refuse, alone_text, _read(rs[0]), f"{cpu:.0f}"]
        rows.append([*row, _at_budget(rs, budget)])
    about = (
        f"prompt {prompt or '(top)'}: {len(probes) - len(refusals)} content probes, {len(refusals)} refusal probes; "
        f"equal CPU time = {budget:.0f} s of training"
    )
    return about + "\n" + markdown(header, rows)


def _read(record: dict) -> str:
    """The positions the student reads in the system turn's place, over the turn's (a record before they were kept
    says "–")."""
    read, whole = record.get("read_positions", record.get("num_virtual_tokens")), record.get("prompt_positions")
    return "–" if not (read and whole) else f"{read} of {whole} ({read / whole:.0%})"


def _at_budget(records: list[dict], budget: float) -> str:
    """The held-out gap closed at `budget` CPU seconds of training: the final gap of a run that took no more, else its
    last curve point within the budget (steps at the run's own rate; a self-study run's curve reads its own kind of
    turns, so it has none here)."""
    values = []
    for r in records:
        cpu = r.get("train_cpu", r["seconds"])
        if cpu <= budget * 1.02:
            values.append(r["gap_closed"])
            continue
        per_step = cpu / r["steps"]
        points = [(int(s), gap) for s, gap in r.get("curve", {}).items() if int(s) * per_step <= budget * 1.02]
        if points and not r.get("self_study"):
            values.append(max(points)[1])
    return "–" if len(values) < len(records) else f"{statistics.fmean(values):.1%}"
