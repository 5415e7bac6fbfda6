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

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import distill_prompt
from peft_softprompt_plus.apps.fetch import fetch_checkpoint
from peft_softprompt_plus.distill.score import gap_closed

DATA = Path(__file__).resolve().parent / "distill_content"
OUT = Path(__file__).resolve().parent / "out"
# name -> (turns_per_part, answer_weight, num_virtual_tokens, in_system_turn); arms with the same turns_per_part
# share the teacher's samples
ARMS = {
    "generic turns (0.3 defaults)": (0, 0.0, 16, False),
    "+ 3 turns per part": (3, 0.0, 16, False),
    "+ 3 turns per part, answer weight 0.5": (3, 0.5, 16, False),
    "+ 3 turns per part, answer weight 0.5, N=32": (3, 0.5, 32, False),
    "+ 3 turns per part, answer weight 0.5, N=64": (3, 0.5, 64, False),
    "+ 3 turns per part, answer weight 1.0, N=64": (3, 1.0, 64, False),
    "+ in the system turn": (3, 0.5, 16, True),
    "+ in the system turn, N=32": (3, 0.5, 32, True),
    "+ in the system turn, N=64": (3, 0.5, 64, True),
}
DEFAULT_ARMS = list(ARMS)[:3]


def _samples(seed: int, per_part: int, length: int, fresh: bool):
    """The teacher's samples kept from an earlier process for this seed, turns per part and continuation length, or
    None."""
    tail = "" if length == 24 else f"-len{length}"  # 24, the library's default, kept the earlier files' names
    path = OUT / f"distill_content_samples-seed{seed}-parts{per_part}{tail}.pkl"
    return path, (None if fresh or not path.exists() else pickle.loads(path.read_bytes()))


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
    results = {}
    OUT.mkdir(exist_ok=True)
    for name in names:
        per_part, weight, n, in_turn = ARMS[name]
        kept, samples = _samples(args.seed, per_part, args.max_new_tokens, args.fresh)
        args.fresh = False  # drawn once per run
        began = time.perf_counter()
        model = distill_prompt(
            AutoModelForCausalLM.from_pretrained(path), tokenizer, system_prompt,
            num_virtual_tokens=n, steps=args.steps, seed=args.seed, turns_per_part=per_part, answer_weight=weight,
            in_system_turn=in_turn, samples=samples, lr=args.lr, evaluate_at=evaluate_at,
            max_new_tokens=args.max_new_tokens,
            progress=lambda line: print("  " + line, flush=True),
        )  # fmt: skip
        report = model.distill_report
        if samples is None:
            kept.write_bytes(pickle.dumps(report.samples))
        c = report.content
        results[name] = dict(
            gap_closed=report.gap_closed, kl=report.student.kl, kl_none=report.none.kl, probes=c.probes,
            teacher=c.teacher, student=c.student, none=c.none, kept=c.kept, seconds=time.perf_counter() - began,
            replies=c.replies, seed=args.seed, steps=args.steps, lr=args.lr, samples_reused=samples is not None,
            max_new_tokens=args.max_new_tokens,
            curve={p.step: round(gap_closed(p.held_out, report.none), 4) for p in report.curve},
        )  # fmt: skip
        figures = {k: v for k, v in results[name].items() if k != "replies"}
        with open(OUT / "distill_content.jsonl", "a") as log:
            log.write(json.dumps({"arm": name, **figures}) + "\n")
        print(f"{name}: {json.dumps(figures)}", flush=True)
    print("\n| arm | KL gap closed | content: teacher / student / none | kept | probes |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['gap_closed']:.1%} | {r['teacher']:.2f} / {r['student']:.2f} / {r['none']:.2f} | "
            f"{r['kept']:.0%} | {r['probes']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
