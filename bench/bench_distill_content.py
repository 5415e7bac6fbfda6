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
    python bench/bench_distill_content.py --steps 120 --prompt museum \
        --arm "+ 3 turns per part, answer weight 0.5, N=16, facts kept as hard text"   # a second prompt's folder
    python bench/bench_distill_content.py --score-only --arm ...   # the arms' saved adapters on today's user probes
                                                                   # (and on held-out KL, where the samples are kept)

Each arm is also scored on the prompt folder's user_probes.jsonl (questions a customer would ask, written by hand);
an arm that keeps the facts as hard text also scores the base reading that kept text alone (kept.txt) as its system
prompt, so the soft tokens' own share shows.

The teacher's samples for a seed are drawn once and kept in bench/out/ (`--fresh` draws them again), so arms run in
separate processes score on the same probes and held-out turns.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from pathlib import Path

import _cartridge_arm
import _distill_arms as arms
import torch
from _distill_table import table
from _stats import comma_list, markdown
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import DistillOptions, distill_prompt
from peft_softprompt_plus.apps.fetch import fetch_checkpoint
from peft_softprompt_plus.distill.content import parts, read_probes, replies, score, words
from peft_softprompt_plus.distill.data import kept_ids, pad_id, prepare
from peft_softprompt_plus.distill.score import gap_closed, held_out_kl
from peft_softprompt_plus.distill.teacher import KEPT_ONLY, TEACHER, attach_teacher, quoted_rows
from peft_softprompt_plus.forward.routing import BASE


@torch.no_grad()
def _user_probes(model, tokenizer, data: Path, system_prompt: str, teacher_replies: dict, keep_text=None):
    """The content score on bench/distill_content/user_probes.jsonl: questions a user would ask, written by hand with
    the facts a reply must state, in no form the training turns use. The teacher is the base reading the hard system
    prompt's ids (the teacher adapter is gone from the returned model); its replies are drawn once per process. With
    `keep_text`, also the score of the base reading the kept text alone as its system turn (no soft tokens): what the
    soft tokens add over a hard prompt cut to its facts."""
    probes = read_probes((data / "user_probes.jsonl").read_text().splitlines())
    prepared = prepare(tokenizer, system_prompt, True, 1)

    questions, pad = [p.question for p in probes], pad_id(tokenizer)

    def read(adapter, prefix_ids=()):
        return replies(model, tokenizer, prepared, questions, adapter, pad, len(questions), prefix_ids)

    if not teacher_replies:
        teacher_replies.update(teacher=read(BASE, prepared.prefix_ids), none=read(BASE))
    kept_only = None
    if keep_text is not None:
        kept_only = score({**teacher_replies, "student": read(BASE, kept_ids(tokenizer, prepared, keep_text, False))},
                          probes, system_prompt)  # fmt: skip
    return score({**teacher_replies, "student": read("default")}, probes, system_prompt), kept_only


def _kept_interval(rows: list[dict], draws: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of `kept` over questions (ContentScore.replies): one fact's swing shows."""
    shares = []
    for row in rows:
        facts = set().union(*(words(fact) for fact in row["facts"]))
        shares.append({r: len(words(row[r]) & facts) / len(facts) for r in ("teacher", "student", "none")})
    rng, kept = random.Random(0), []
    for _ in range(draws):
        pick = [rng.choice(shares) for _ in shares]
        mean = {r: sum(p[r] for p in pick) / len(pick) for r in ("teacher", "student", "none")}
        gain = mean["teacher"] - mean["none"]
        if gain > 0:
            kept.append((mean["student"] - mean["none"]) / gain)
    kept.sort()
    return kept[int(0.025 * len(kept))], kept[int(0.975 * len(kept)) - 1]


@torch.no_grad()
def _held_out_gaps(model, tokenizer, system_prompt: str, samples, keep_text) -> dict:
    """Held-out KL gap closed, from the seed's saved samples, by the saved student and (with `keep_text`) by the kept
    text alone as the system turn: the KL half of what the soft tokens add over the kept text."""
    prepared = prepare(tokenizer, system_prompt, True, 1)
    attach_teacher(model, prepared.prefix_ids)
    readers = {"student": "default"}
    if keep_text is not None:
        attach_teacher(model, kept_ids(tokenizer, prepared, keep_text, False), KEPT_ONLY)
        readers["kept text alone"] = KEPT_ONLY
    pad = pad_id(tokenizer)
    none = held_out_kl(model, samples.held_out, BASE, pad, 8)
    gaps = {r: (none - held_out_kl(model, samples.held_out, a, pad, 8)) / none for r, a in readers.items()}
    for adapter in (TEACHER, *([KEPT_ONLY] if keep_text is not None else [])):
        model.delete_adapter(adapter)
    return gaps


def _score_only(names, seed, path, tokenizer, data: Path, system_prompt: str, knobs: str = "") -> None:
    """`--score-only`: each arm's adapter saved by an earlier run, scored again on today's user probes."""
    from peft import PeftModel

    teacher_replies = {}
    for name in names:
        folder = arms.adapter_dir(data, name + knobs, seed)
        if not folder.exists():
            raise SystemExit(f"--score-only: no adapter for {name!r} seed {seed} at {folder}; run the arm first")
        arm = arms.Arm(*arms.ARMS[name])
        keep_text = arms.keep_text(data, arm.keep_facts)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), folder)
        samples = arms.samples(data, seed, arm.turns_per_part, 24, arm.greedy_part_replies, arm.quote_parts, False)[1]
        kl = None if samples is None else _held_out_gaps(model, tokenizer, system_prompt, samples, keep_text)
        u, kept_only = _user_probes(model, tokenizer, data, system_prompt, teacher_replies, keep_text)
        figures = dict(
            arm=name, knobs=knobs, prompt=data.name, seed=seed, score_only=True, held_out_gap_closed=kl,
            user_probes=dict(
                probes=u.probes, teacher=u.teacher, student=u.student, none=u.none, kept=u.kept,
                kept_95=_kept_interval(u.replies),
            ),
            kept_text_only=None if kept_only is None else dict(student=kept_only.student, kept=kept_only.kept),
            user_replies=u.replies,
        )  # fmt: skip
        with open(arms.OUT / "distill_content.jsonl", "a") as log:
            log.write(json.dumps(figures) + "\n")
        low, high = figures["user_probes"]["kept_95"]
        only = "" if kept_only is None else f"; kept text alone {kept_only.student:.2f} (kept {kept_only.kept:.0%})"
        if kl is not None:
            only += "; KL gap closed: " + ", ".join(f"{reader} {gap:.1%}" for reader, gap in kl.items())
        print(f"| {name} | seed {seed} | user probes ({u.probes}): teacher {u.teacher:.2f} / student {u.student:.2f} "
              f"/ none {u.none:.2f} | kept {u.kept:.0%} (95%: {low:.0%}–{high:.0%}){only} |", flush=True)  # fmt: skip


@torch.no_grad()
def _check_probes(path: str, tokenizer, data: Path, system_prompt: str) -> None:
    """`--check-probes`: a new prompt's questions read by the teacher and by no system prompt only (no student), each
    probe's facts stated by each: the check its writer makes before freezing the prompt and its probes."""
    probes = read_probes((data / "user_probes.jsonl").read_text().splitlines())
    prepared, pad = prepare(tokenizer, system_prompt, True, 1), pad_id(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    from peft import get_peft_model

    from peft_softprompt_plus import SoftPromptPlusConfig

    model = get_peft_model(model, SoftPromptPlusConfig(num_virtual_tokens=1, validate_gradients="off"))
    questions = [p.question for p in probes]
    teacher = replies(model, tokenizer, prepared, questions, BASE, pad, 8, prepared.prefix_ids)
    none = replies(model, tokenizer, prepared, questions, BASE, pad, 8)
    rows = []
    for probe, t, n in zip(probes, teacher, none, strict=True):
        facts = set().union(*(words(f) for f in probe.facts))
        if not facts:
            raise SystemExit(f"probe {probe.question!r}: its facts {probe.facts} are all common words; name others")
        shares = {reader: len(words(text) & facts) / len(facts) for reader, text in (("teacher", t), ("none", n))}
        rows.append(dict(question=probe.question, facts=sorted(facts), teacher=t, none=n,
                         teacher_share=shares["teacher"], none_share=shares["none"]))  # fmt: skip
        print(f"{rows[-1]['teacher_share']:.2f} {rows[-1]['none_share']:.2f} | {probe.question} | {t[:90]!r}")
    stated = sum(r["teacher_share"] > 0 for r in rows)
    print(f"{data.name}: {len(rows)} probes; the teacher states facts of {stated}, mean share "
          f"{sum(r['teacher_share'] for r in rows) / len(rows):.2f}; no prompt "
          f"{sum(r['none_share'] for r in rows) / len(rows):.2f}")  # fmt: skip
    (arms.OUT / f"probe_check_{data.name}.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None, help="default: the student form's own (distill_prompt's)")
    parser.add_argument("--self-study", action="store_true", help="the teacher writes its turns from five seed kinds")
    parser.add_argument("--kl-top-k", type=int, default=0, help="train on the teacher's top-k tokens (0: full KL)")
    parser.add_argument("--kv-frozen-positions", type=int, default=None, help="a KV student's frozen sink")
    parser.add_argument("--prompt-text-weight", type=float, default=0.0, help="next-token loss on the system turn")
    parser.add_argument("--evaluate-at", default="", help="comma-separated steps at which held-out KL is measured too")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--max-new-tokens", type=int, default=24, help="length of the teacher's training continuations (default 24)"
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--arm", action="append", help=f"one arm, repeatable (default the first 3): {list(arms.ARMS)}")
    parser.add_argument("--fresh", action="store_true", help="draw the teacher's samples again")
    parser.add_argument(
        "--prompt",
        default=None,
        help="a folder under bench/distill_content/ with its own system_prompt.txt, "
        "user_probes.jsonl and kept.txt (default: the bike-shop prompt at its top)",
    )
    parser.add_argument(
        "--score-only", action="store_true", help="score the arms' adapters saved by an earlier run on the user probes"
    )
    parser.add_argument("--table", action="store_true", help="print every recorded arm on --prompt over its seeds")
    parser.add_argument(
        "--check-probes", action="store_true", help="--prompt's probes read by the teacher and no prompt only"
    )
    args = parser.parse_args()
    names = args.arm or arms.DEFAULT_ARMS
    unknown = [name for name in names if name not in arms.ARMS]
    if unknown:
        raise SystemExit(f"--arm: unknown {unknown}; known: {list(arms.ARMS)}")
    torch.set_num_threads(args.threads)
    evaluate_at = comma_list(args.evaluate_at)
    path = fetch_checkpoint("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = arms.DATA / args.prompt if args.prompt else arms.DATA
    if not (data / "system_prompt.txt").exists():
        raise SystemExit(f"--prompt: {args.prompt!r} has no system_prompt.txt under {arms.DATA}")
    system_prompt = (data / "system_prompt.txt").read_text().strip()
    results, teacher_replies = {}, {}
    arms.OUT.mkdir(exist_ok=True)
    if args.table:
        return print(table(arms.OUT / "distill_content.jsonl", data.name if args.prompt else arms.DATA.name, data))
    if args.check_probes:
        return _check_probes(path, tokenizer, data, system_prompt)
    if args.score_only:
        return _score_only(names, args.seed, path, tokenizer, data, system_prompt, arms.knobs(args))
    for name in names:
        arm = arms.Arm(*arms.ARMS[name])
        per_part, weight, _, in_turn, greedy, quotes, keep, level, init = arm
        keep_text = arms.keep_text(data, keep)
        n = arms.num_virtual_tokens(arm, tokenizer, system_prompt, keep_text)
        kept, samples = arms.samples(
            data, args.seed, per_part, args.max_new_tokens, greedy, quotes, args.fresh, args.self_study
        )
        if quotes and samples is None and not args.fresh:
            # Quoted rows draw nothing from the RNG: the samples without them, plus them, are what a fresh draw gives.
            samples = arms.samples(data, args.seed, per_part, args.max_new_tokens, greedy, 0, False)[1]
            if samples is not None:
                prepared = prepare(tokenizer, system_prompt, True, n)
                samples.train += quoted_rows(tokenizer, prepared, parts(system_prompt), quotes)
        args.fresh = False  # drawn once per run
        if name.startswith("PEFT CARTRIDGE"):
            folder = arms.adapter_dir(data, name + arms.knobs(args), args.seed)
            scorers = (_held_out_gaps, lambda *a: _user_probes(*a, teacher_replies), folder, arms.knobs(args))
            results[name] = _cartridge_arm.arm(args, path, tokenizer, data, system_prompt, samples, n, weight, scorers)
            results[name]["user_probes"]["kept_95"] = _kept_interval(results[name]["user_replies"])
            with open(arms.OUT / "distill_content.jsonl", "a") as log:
                log.write(json.dumps({"arm": name, **results[name]}) + "\n")
            print(f"{name}: gap {results[name]['gap_closed']:.1%}, copy gap {results[name]['copy_gap']:.1e}")
            continue
        began = time.perf_counter()
        options = DistillOptions(
            num_virtual_tokens=n, steps=args.steps, seed=args.seed, turns_per_part=per_part, answer_weight=weight,
            in_system_turn=in_turn, lr=args.lr, evaluate_at=evaluate_at, max_new_tokens=args.max_new_tokens,
            greedy_part_replies=greedy, quote_parts=quotes, keep_text=keep_text, prompt_level=level, prompt_init=init,
            self_study=args.self_study, kl_top_k=args.kl_top_k, kv_frozen_positions=args.kv_frozen_positions,
            prompt_text_weight=args.prompt_text_weight,
        )  # fmt: skip
        model = distill_prompt(
            AutoModelForCausalLM.from_pretrained(path),
            tokenizer,
            system_prompt,
            options,
            samples=samples,
            progress=lambda line: print("  " + line, flush=True),
        )
        report = model.distill_report
        if samples is None:
            kept.write_bytes(pickle.dumps(report.samples))
        model.save_pretrained(arms.adapter_dir(data, name + arms.knobs(args), args.seed))  # for --score-only
        c, whole = report.content, prepare(tokenizer, system_prompt, True, 1)
        u, kept_only = _user_probes(model, tokenizer, data, system_prompt, teacher_replies, keep_text)
        results[name] = dict(
            prompt=data.name,
            gap_closed=report.gap_closed, kl=report.student.kl, kl_none=report.none.kl, probes=c.probes,
            teacher=c.teacher, student=c.student, none=c.none, kept=c.kept, seconds=time.perf_counter() - began,
            replies=c.replies, seed=args.seed, steps=args.steps, lr=report.options.lr,
            samples_reused=samples is not None,
            max_new_tokens=args.max_new_tokens, self_study=args.self_study, kl_top_k=args.kl_top_k,
            kv_frozen_positions=args.kv_frozen_positions, prompt_text_weight=args.prompt_text_weight,
            user_probes=dict(
                probes=u.probes, teacher=u.teacher, student=u.student, none=u.none, kept=u.kept,
                kept_95=_kept_interval(u.replies),
            ),
            user_replies=u.replies,
            kept_text_only=None if kept_only is None else dict(
                student=kept_only.student, kept=kept_only.kept, gap_closed=report.kept_text_gap_closed,
            ),
            curve={p.step: round(gap_closed(p.held_out, report.none), 4) for p in report.curve},
            train_cpu=report.train_cpu_seconds, knobs=arms.knobs(args),
            kv_selection="replies" if init == "selected" else None, num_virtual_tokens=n,
            kept_positions=report.kept_positions, facts=report.facts,
            prompt_positions=len(whole.prefix_ids),
            read_positions=n + (len(kept_ids(tokenizer, whole, keep_text, False)) if level == "input" and keep else 0),
        )  # fmt: skip
        figures = {k: v for k, v in results[name].items() if k != "replies"}
        with open(arms.OUT / "distill_content.jsonl", "a") as log:
            log.write(json.dumps({"arm": name, **figures}) + "\n")
        print(f"{name}: {json.dumps(figures)}", flush=True)
    rows = []
    for name, r in results.items():
        u = r["user_probes"]
        rows.append([
            name, f"{r['gap_closed']:.1%}", f"{r['teacher']:.2f} / {r['student']:.2f} / {r['none']:.2f}",
            f"{r['kept']:.0%}", f"{u['teacher']:.2f} / {u['student']:.2f} / {u['none']:.2f}",
            f"{u['kept']:.0%} ({u['kept_95'][0]:.0%}–{u['kept_95'][1]:.0%})",
        ])  # fmt: skip
    header = ["arm", "KL gap closed", "content: teacher / student / none", "kept"]
    print("\n" + markdown([*header, "user probes: teacher / student / none", "kept"], rows))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
