"""Prompt distillation, content kept: the system prompt of bench/distill_content/ (written for this benchmark; the
recipe was never tuned on it) distilled on SmolLM2-135M-Instruct, each arm scored on the probe questions (one per
part of the prompt, in a form no training turn uses) by the share of the part's facts its greedy reply states, next
to the teacher and no system prompt, and on held-out per-token KL. Method: docs/distillation.md.

    python bench/bench_distill_content.py                 # 3 arms, N=16, 60 steps, one seed (about 40 min)
    python bench/bench_distill_content.py --steps 20      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import distill_prompt
from peft_softprompt_plus.apps.fetch import fetch_checkpoint

DATA = Path(__file__).resolve().parent / "distill_content"
# name -> (turns_per_part, answer_weight, num_virtual_tokens, the arm whose teacher samples it reuses)
ARMS = {
    "generic turns (0.3 defaults)": (0, 0.0, 16, None),
    "+ 3 turns per part": (3, 0.0, 16, None),
    "+ 3 turns per part, answer weight 0.5": (3, 0.5, 16, "+ 3 turns per part"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = fetch_checkpoint("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    system_prompt = (DATA / "system_prompt.txt").read_text().strip()
    results, samples = {}, {}
    for name, (per_part, weight, n, reuse) in ARMS.items():
        began = time.perf_counter()
        model = distill_prompt(
            AutoModelForCausalLM.from_pretrained(path), tokenizer, system_prompt,
            num_virtual_tokens=n, steps=args.steps, seed=args.seed, turns_per_part=per_part, answer_weight=weight,
            samples=samples.get(reuse), progress=lambda line: print("  " + line, flush=True),
        )  # fmt: skip
        report = model.distill_report
        samples[name] = report.samples
        c = report.content
        results[name] = dict(
            gap_closed=report.gap_closed, kl=report.student.kl, kl_none=report.none.kl, probes=c.probes,
            teacher=c.teacher, student=c.student, none=c.none, kept=c.kept, seconds=time.perf_counter() - began,
            replies=c.replies,
        )  # fmt: skip
        print(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'replies'})}", flush=True)
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
