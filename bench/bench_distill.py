"""Prompt distillation on SmolLM2-135M-Instruct: the 285-token system prompt of bench/distill_data/ distilled into N
soft tokens (N = 4, 8, 16, 32), scored on held-out user turns never trained on: per-token KL against the teacher next
to no system prompt at all, greedy agreement, curves over steps; then `generate` speed and cache bytes, soft prompt
against hard prompt, in one run. Method and targets: bench/README.md.

    python bench/bench_distill.py                     # about 85 min on one thread
    python bench/bench_distill.py --quick             # N=16 only, 20 steps, no curve (about 20 min)
    python bench/bench_distill.py --samples s.pkl     # keep the teacher's samples in s.pkl, reuse them next time
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from pathlib import Path

import _common as c
import torch
from _stats import Row, comma_list, print_table
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import DistillOptions, SoftPromptPlusConfig, distill_prompt, student_inputs
from peft_softprompt_plus.apps.fetch import fetch_checkpoint
from peft_softprompt_plus.distill.data import left_padded, prepare
from peft_softprompt_plus.distill.score import scored_batch, teacher_logits, token_kl
from peft_softprompt_plus.distill.teacher import TEACHER, Sample, attach_teacher

DATA = Path(__file__).resolve().parent / "distill_data"
SIZES = (4, 8, 16, 32)
GAP_TARGET = ">= 0.8"  # N=16, a system prompt of >= 150 tokens
NEW_TOKENS = 32
GEN_ROWS = 8


def _lines(name: str) -> list[str]:
    return [line.strip() for line in (DATA / name).read_text().splitlines() if line.strip()]


def _load(path: str):
    return AutoModelForCausalLM.from_pretrained(path).eval()


@torch.no_grad()
def default_system_kl(teacher, tokenizer, samples) -> float:
    """Context: the template's own rendering of the user turn alone (it inserts SmolLM2's default system prompt),
    scored against the teacher on the same continuations."""
    turn_of = {tuple(p): t for p, t in zip(samples.held_out_prompts, samples.held_out_turns, strict=True)}
    total, count = 0.0, 0
    for row in samples.held_out:
        turn = turn_of[tuple(row.ids[: row.first + 1])]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
        )
        head = tokenizer(text, add_special_tokens=False)["input_ids"]
        batch = scored_batch([row], tokenizer.pad_token_id, "cpu")
        other = scored_batch([Sample(head + row.ids[row.first + 1 :], len(head) - 1)], tokenizer.pad_token_id, "cpu")
        with teacher.disable_adapter():
            base = teacher(**other.kwargs).logits  # [1, K, V]: the same continuation positions
        kl = token_kl(teacher_logits(teacher, batch), base, batch.scored)
        total, count = total + kl.sum().item(), count + kl.numel()
    return total / count


def _with_teacher(path: str, prefix_ids: list[int]):
    model = get_peft_model(_load(path), SoftPromptPlusConfig(task_type="CAUSAL_LM", validate_gradients="off"))
    attach_teacher(model, prefix_ids)
    return model.eval()


def _greedy(model, batch: dict, **kwargs):
    return model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2, **kwargs)


def _cache_bytes_per_row(model, batch: dict, **kwargs) -> float:
    out = _greedy(model, batch, return_dict_in_generate=True, **kwargs)
    return sum(x.keys.nbytes + x.values.nbytes for x in out.cache.layers) / batch["input_ids"].shape[0]


def bench_generate(path, tokenizer, student, prepared, turns, rows: list[Row], reps: int) -> None:
    """The N=16 soft prompt against the hard prompt fed as tokens to the base, in one interleaved run; the hard prefix
    as a stored prompt (our teacher adapter, the engine's shared prefix) for context."""
    suffixes = [prepared.suffix_ids(tokenizer, t) for t in turns[:GEN_ROWS]]
    soft = student_inputs(tokenizer, [[{"role": "user", "content": t}] for t in turns[:GEN_ROWS]])
    assert soft["input_ids"].tolist() == left_padded(suffixes, tokenizer.pad_token_id)["input_ids"].tolist()
    hard = left_padded([prepared.prefix_ids + s for s in suffixes], tokenizer.pad_token_id)
    base, shared = _load(path), _with_teacher(path, prepared.prefix_ids)
    stored = {"adapter_names": [TEACHER] * GEN_ROWS}
    variants = {
        "soft": lambda: _greedy(student, soft),
        "hard": lambda: _greedy(base, hard),
        "hard, stored prefix": lambda: _greedy(shared, soft, **stored),
    }
    with torch.no_grad():
        times = c.interleaved(variants, reps, 1)
        cache = {
            "soft": _cache_bytes_per_row(student, soft),
            "hard": _cache_bytes_per_row(base, hard),
            "hard, stored prefix": _cache_bytes_per_row(shared, soft, **stored),
        }
    tag = f"generate {GEN_ROWS} held-out turns x {NEW_TOKENS} tokens"
    for name, t in times.items():
        print(f"  [{tag}] {name:<20} {t.line()}; cache {cache[name] / 1024:.0f} KB per row", flush=True)
    rows.append(Row(f"{tag}: soft (N=16) / hard", *c.ratio(times, "soft", "hard")))
    rows.append(Row(f"{tag}: hard, stored prefix / hard", *c.ratio(times, "hard, stored prefix", "hard")))
    for name in ("soft", "hard"):
        per_token = (
            1e3 * times[name].med() / GEN_ROWS / NEW_TOKENS,
            1e3 * times[name].med("cpu") / GEN_ROWS / NEW_TOKENS,
        )
        rows.append(Row(f"generate: {name}, ms per row and new token", *per_token, fmt="{:.1f}"))
    for name in variants:
        rows.append(Row(f"generate: cache KB per row, {name}", cache[name] / 1024, fmt="{:.0f}"))
    rows.append(Row("generate: cache bytes per row, soft / hard", cache["soft"] / cache["hard"]))
    config = student.get_base_model().config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4 / 1024  # KB, float32
    print(f"  prompt keys/values, held once (not per row): soft {16 * per_token:.0f} KB, hard prefix "
          f"{len(prepared.prefix_ids) * per_token:.0f} KB")  # fmt: skip


def _plot(reports: dict, none_kl: float, out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no plot"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for n, report in reports.items():
        left.plot([p.step for p in report.curve], [p.held_out.kl for p in report.curve], marker="o", label=f"N={n}")
    left.axhline(none_kl, color="grey", linestyle="--", label="no system prompt")
    left.set(xlabel="optimizer steps", ylabel="held-out KL(teacher || student) per token", yscale="log")
    left.legend()
    right.plot(list(reports), [r.gap_closed for r in reports.values()], marker="o")
    right.axhline(0.8, color="grey", linestyle="--", label="target (N=16)")
    right.set(xlabel="soft tokens N", ylabel="gap closed", xscale="log", xticks=list(reports))
    right.set_xticklabels([str(n) for n in reports])
    right.minorticks_off()
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return f"plot written to {out}"


def distill_sizes(path, tokenizer, system_prompt, sizes, steps, evaluate_at, args, rows: list[Row]) -> dict:
    """One student per N, all trained on the same teacher samples (drawn once, or read from --samples)."""
    samples = None
    if args.samples and os.path.exists(args.samples):
        with open(args.samples, "rb") as handle:
            samples = pickle.load(handle)
    students = {}
    for n in sizes:
        began = time.perf_counter()

        def log(line: str, n: int = n, began: float = began) -> None:
            print(f"  [N={n} {time.perf_counter() - began:6.0f} s] {line}", flush=True)

        options = DistillOptions(
            num_virtual_tokens=n, steps=steps, lr=args.lr, seed=args.seed, evaluate_at=evaluate_at
        )
        student = distill_prompt(
            _load(path),
            tokenizer,
            system_prompt,
            options,
            user_turns=_lines("train_turns.txt"),
            held_out_turns=_lines("held_out_turns.txt"),
            samples=samples,
            progress=log,
        )
        report = student.distill_report
        if samples is None and args.samples:
            with open(args.samples, "wb") as handle:
                pickle.dump(report.samples, handle)
        samples, students[n] = report.samples, student
        per_step = report.train_seconds / steps, report.train_cpu_seconds / steps
        rows.append(Row(f"N={n}: held-out KL, student", report.student.kl, fmt="{:.4f}"))
        rows.append(Row(f"N={n}: gap closed", report.gap_closed, target=GAP_TARGET if n == 16 else None))
        rows.append(Row(f"N={n}: greedy first token = teacher's", report.student.first_token, fmt="{:.2f}"))
        rows.append(Row(f"N={n}: greedy first 16 tokens = teacher's", report.student.first_16, fmt="{:.2f}"))
        rows.append(Row(f"N={n}: training s per step", *per_step, fmt="{:.2f}"))
    return students


def print_curves(reports: dict) -> None:
    print("\ncurves (held-out KL per token, gap closed, greedy agreement first token / first 16):")
    for n, report in reports.items():
        for p in report.curve:
            gap = (report.none.kl - p.held_out.kl) / report.none.kl
            print(f"  N={n:>2} step {p.step:>4} ({p.seconds:5.0f} s): KL {p.held_out.kl:.4f}  gap {gap:6.1%}  "
                  f"agree {p.held_out.first_token:.2f} / {p.held_out.first_16:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=16 only, 20 steps, no curve, 1 generate round")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--evaluate-at", default="0,30,60,120", help="steps with held-out figures (the curve)")
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--samples", default=None, help="a pickle of the teacher's samples: read if present, else written"
    )
    parser.add_argument("--plot", default=str(DATA.parent / "distill_curves.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    c.quiet()
    start, start_cpu = time.perf_counter(), time.process_time()
    print(f"machine: {c.machine()}", flush=True)
    path = fetch_checkpoint("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    system_prompt = (DATA / "system_prompt.txt").read_text().strip()
    sizes, steps = ((16,), 20) if args.quick else (SIZES, args.steps)
    evaluate_at = () if args.quick else tuple(s for s in comma_list(args.evaluate_at) if s <= steps)
    rows: list[Row] = []
    students = distill_sizes(path, tokenizer, system_prompt, sizes, steps, evaluate_at, args, rows)
    reports = {n: m.distill_report for n, m in students.items()}
    first = next(iter(reports.values()))
    none = first.none
    rows.append(
        Row("teacher adapter vs hard ids: max rel logit diff", first.teacher_gap, target="<= 1e-05", fmt="{:.1e}")
    )
    rows.append(Row("no system prompt: held-out KL", none.kl, fmt="{:.4f}"))
    rows.append(Row("no system prompt: greedy first token, first 16", none.first_token, none.first_16, fmt="{:.2f}"))
    default_kl = default_system_kl(_with_teacher(path, first.samples.prefix_ids), tokenizer, first.samples)
    rows.append(Row("template's default system prompt: held-out KL", default_kl, fmt="{:.4f}"))
    print_curves(reports)
    if evaluate_at:
        print(_plot(reports, none.kl, Path(args.plot)))
    print("\ngenerate: soft prompt (N=16) against the hard prompt", flush=True)
    prepared = prepare(tokenizer, system_prompt, True, 16)
    bench_generate(path, tokenizer, students[16], prepared, _lines("held_out_turns.txt"), rows, 1 if args.quick else 3)
    print_table(rows)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    print(f"\nmachine at the end: {c.machine()}")
    print(f"total {wall:.0f} s wall, {cpu:.0f} s cpu; seed {args.seed}, lr {args.lr}, steps {steps}")


if __name__ == "__main__":
    main()
