"""Prompt distillation, content kept: the system prompt of bench/distill_content/ (written for this benchmark; the
recipe was never tuned on it) distilled on SmolLM2-135M-Instruct, each arm scored on the probe questions (one per
part of the prompt, in a form no training turn uses) by the share of the part's facts its greedy reply states, next
to the teacher and no system prompt, and on held-out per-token KL. Method: docs/distillation.md.

    python bench/bench_distill_content.py                 # the first 3 arms, N=16, 60 steps, one seed (about 40 min)
    python bench/bench_distill_content.py --arm "+ in the system turn" --arm "+ in the system turn, N=32" --seed 1
    python bench/bench_distill_content.py --steps 20      # a smoke run
    python bench/bench_distill_content.py --steps 120 --evaluate-at 30,60,90 --seed 2 \
        --arm "+ 3 turns per part, answer weight 0.5, N=64"   # the docs' recommendation, with its KL curve
    python bench/bench_distill_content.py --steps 120 --max-new-tokens 64 \
        --arm "+ 3 turns per part, answer weight 0.5, N=64"   # longer teacher continuations to train on

The teacher's samples for a seed are drawn once and kept in bench/out/ (`--fresh` draws them again), so arms run in
separate processes score on the same probes and held-out turns.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import distill_prompt
from peft_softprompt_plus.apps.fetch import fetch_checkpoint
from peft_softprompt_plus.distill.content import parts, read_probes, replies, score
from peft_softprompt_plus.distill.data import pad_id, prepare
from peft_softprompt_plus.distill.score import gap_closed
from peft_softprompt_plus.distill.teacher import quoted_rows
from peft_softprompt_plus.forward.routing import BASE

DATA = Path(__file__).resolve().parent / "distill_content"
OUT = Path(__file__).resolve().parent / "out"


class Arm(NamedTuple):
    """One arm's options; arms with the same turns_per_part and greedy_part_replies share the teacher's samples."""

    turns_per_part: int
    answer_weight: float
    num_virtual_tokens: int
    in_system_turn: bool = False
    greedy_part_replies: bool = False
    quote_parts: int = 0
    keep_facts: bool = False  # keep the prompt's facts as hard text (`keep_text`: KEPT_PARAGRAPHS)


ARMS = {
    "generic turns (0.3 defaults)": (0, 0.0, 16, False, False),
    "+ 3 turns per part": (3, 0.0, 16, False, False),
    "+ 3 turns per part, answer weight 0.5": (3, 0.5, 16, False, False),
    "+ 3 turns per part, answer weight 0.5, N=32": (3, 0.5, 32, False, False),
    "+ 3 turns per part, answer weight 0.5, N=64": (3, 0.5, 64, False, False),
    "+ 3 turns per part, answer weight 1.0, N=64": (3, 1.0, 64, False, False),
    "+ in the system turn": (3, 0.5, 16, True, False),
    "+ in the system turn, N=32": (3, 0.5, 32, True, False),
    "+ in the system turn, N=64": (3, 0.5, 64, True, False),
    "+ greedy part replies, answer weight 0.5, N=64": (3, 0.5, 64, False, True),
    "+ greedy part replies, N=64": (3, 0.0, 64, False, True),
    "+ greedy and quoted part replies, answer weight 0.5, N=64": (3, 0.5, 64, False, True, 3),
    "+ 3 turns per part, answer weight 0.5, N=16, facts kept as hard text": (3, 0.5, 16, False, False, 0, True),
}
# The passage a "facts kept as hard text" arm keeps (`keep_text`): the prompt's two paragraphs of facts.
KEPT_PARAGRAPHS = slice(1, 3)
DEFAULT_ARMS = list(ARMS)[:3]


def _samples(seed: int, per_part: int, length: int, greedy: bool, quotes: int, fresh: bool):
    """The teacher's samples kept from an earlier process for this seed, turns per part, continuation length, greedy
    part replies and quoting questions, or None."""
    tail = (
        ("" if length == 24 else f"-len{length}")
        + ("-greedy" if greedy else "")
        + (f"-quote{quotes}" if quotes else "")
    )  # the earlier files' names kept
    path = OUT / f"distill_content_samples-seed{seed}-parts{per_part}{tail}.pkl"
    return path, (None if fresh or not path.exists() else pickle.loads(path.read_bytes()))


@torch.no_grad()
def _user_probes(model, tokenizer, system_prompt: str, teacher_replies: dict):
    """The content score on bench/distill_content/user_probes.jsonl: questions a user would ask, written by hand with
    the facts a reply must state, in no form the training turns use. The teacher is the base reading the hard system
    prompt's ids (the teacher adapter is gone from the returned model); its replies are drawn once per process."""
    probes = read_probes((DATA / "user_probes.jsonl").read_text().splitlines())
    prepared = prepare(tokenizer, system_prompt, True, 1)

    questions, pad = [p.question for p in probes], pad_id(tokenizer)

    def read(adapter, prefix_ids=()):
        return replies(model, tokenizer, prepared, questions, adapter, pad, len(questions), prefix_ids)

    if not teacher_replies:
        teacher_replies.update(teacher=read(BASE, prepared.prefix_ids), none=read(BASE))
    return score({**teacher_replies, "student": read("default")}, probes, system_prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--evaluate-at", default="", help="comma-separated steps at which held-out KL is measured too")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--max-new-tokens", type=int, default=24, help="length of the teacher's training continuations (default 24)"
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--arm", action="append", help=f"one arm, repeatable (default the first 3): {list(ARMS)}")
    parser.add_argument("--fresh", action="store_true", help="draw the teacher's samples again")
    args = parser.parse_args()
    names = args.arm or DEFAULT_ARMS
    unknown = [name for name in names if name not in ARMS]
    if unknown:
        raise SystemExit(f"--arm: unknown {unknown}; known: {list(ARMS)}")
    torch.set_num_threads(args.threads)
    evaluate_at = [int(step) for step in args.evaluate_at.split(",") if step]
    path = fetch_checkpoint("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    system_prompt = (DATA / "system_prompt.txt").read_text().strip()
    results, teacher_replies = {}, {}
    OUT.mkdir(exist_ok=True)
    for name in names:
        per_part, weight, n, in_turn, greedy, quotes, keep = Arm(*ARMS[name])
        keep_text = "\n\n".join(system_prompt.split("\n\n")[KEPT_PARAGRAPHS]) if keep else None
        kept, samples = _samples(args.seed, per_part, args.max_new_tokens, greedy, quotes, args.fresh)
        if quotes and samples is None and not args.fresh:
            # Quoted rows draw nothing from the RNG: the samples without them, plus them, are what a fresh draw gives.
            samples = _samples(args.seed, per_part, args.max_new_tokens, greedy, 0, False)[1]
            if samples is not None:
                prepared = prepare(tokenizer, system_prompt, True, n)
                samples.train += quoted_rows(tokenizer, prepared, parts(system_prompt), quotes)
        args.fresh = False  # drawn once per run
        began = time.perf_counter()
        model = distill_prompt(
            AutoModelForCausalLM.from_pretrained(path), tokenizer, system_prompt,
            num_virtual_tokens=n, steps=args.steps, seed=args.seed, turns_per_part=per_part, answer_weight=weight,
            in_system_turn=in_turn, samples=samples, lr=args.lr, evaluate_at=evaluate_at,
            max_new_tokens=args.max_new_tokens, greedy_part_replies=greedy, quote_parts=quotes, keep_text=keep_text,
            progress=lambda line: print("  " + line, flush=True),
        )  # fmt: skip
        report = model.distill_report
        if samples is None:
            kept.write_bytes(pickle.dumps(report.samples))
        c = report.content
        u = _user_probes(model, tokenizer, system_prompt, teacher_replies)
        results[name] = dict(
            gap_closed=report.gap_closed, kl=report.student.kl, kl_none=report.none.kl, probes=c.probes,
            teacher=c.teacher, student=c.student, none=c.none, kept=c.kept, seconds=time.perf_counter() - began,
            replies=c.replies, seed=args.seed, steps=args.steps, lr=args.lr, samples_reused=samples is not None,
            max_new_tokens=args.max_new_tokens,
            user_probes=dict(probes=u.probes, teacher=u.teacher, student=u.student, none=u.none, kept=u.kept),
            user_replies=u.replies,
            curve={p.step: round(gap_closed(p.held_out, report.none), 4) for p in report.curve},
        )  # fmt: skip
        figures = {k: v for k, v in results[name].items() if k != "replies"}
        with open(OUT / "distill_content.jsonl", "a") as log:
            log.write(json.dumps({"arm": name, **figures}) + "\n")
        print(f"{name}: {json.dumps(figures)}", flush=True)
    print(
        "\n| arm | KL gap closed | content: teacher / student / none | kept | user probes: teacher / student / none "
        "| kept |\n|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        u = r["user_probes"]
        print(
            f"| {name} | {r['gap_closed']:.1%} | {r['teacher']:.2f} / {r['student']:.2f} / {r['none']:.2f} | "
            f"{r['kept']:.0%} | {u['teacher']:.2f} / {u['student']:.2f} / {u['none']:.2f} | {u['kept']:.0%} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
