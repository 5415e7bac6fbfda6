"""The learning harness: how well each way of adapting a frozen real checkpoint learns the capitals task
(`peft_softprompt_plus.apps.capitals`: 160 training countries, 88 held out), at equal steps and at equal training time,
over several seeds. Every later change to how prompts learn is judged here. Method and targets: bench/README.md.

    python bench/bench_quality.py run                      # every variant, seeds 0-2 (hours on 2 cores)
    python bench/bench_quality.py run --variants ours-random,peft-pt-vocab --seeds 0
    python bench/bench_quality.py run --variants ours-random --lrs 0.003,0.03,0.3 --steps 120 --eval-at 120
    python bench/bench_quality.py report                   # tables + bench/quality.png from every recorded run

Runs append to bench/out/quality.jsonl (one line per variant, learning rate and seed), so several processes can
share the work and `report` reads whatever has finished.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _quality_report  # noqa: E402
import torch  # noqa: E402
from _quality_report import BATCH, STEPS, N  # noqa: E402  (the harness's shape: its report reads the same)
from _stats import comma_list  # noqa: E402
from peft import LoraConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup  # noqa: E402

from peft_softprompt_plus import SoftPromptPlusConfig  # noqa: E402
from peft_softprompt_plus.apps import capitals  # noqa: E402
from peft_softprompt_plus.apps.fetch import fetch_checkpoint  # noqa: E402

EVAL_AT = (20, 40, 80, 120)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "quality.jsonl")


@dataclass(frozen=True)
class Variant:
    """`build(base, seed, tokenizer, split)` -> the model to train (None: a hard prompt, never trained)."""

    about: str
    build: Optional[Callable]
    lr: float = 3e-2
    peft_prompt: bool = False  # a PEFT prompt-learning model: scored through an exact copy of its prompt (below)
    shots: int = 0  # hard prompt examples in front of each question
    schedule: Optional[Callable] = None  # (optimizer, steps) -> an LR scheduler stepped once per step
    config: dict = field(default_factory=dict)


def _ours(**config) -> Callable:
    def build(base, seed, tokenizer, split):
        full = {"num_virtual_tokens": N, "init_seed": seed, **config}
        return get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", **full))

    return build


def _labels(**config) -> Callable:
    """Class-label init: the training answers (as they appear after the arrow, with their space) start the prompt."""

    def build(base, seed, tokenizer, split):
        labels = [f" {capital}" for _, capital in split.train]
        path = tokenizer.name_or_path
        return _ours(prompt_init="labels", prompt_init_labels=labels, tokenizer_name_or_path=path, **config)(
            base, seed, tokenizer, split
        )

    return build


def _unit_gain(build: Callable) -> Callable:
    """The paper's LayerNorm at gain 1 (this library starts it at the embeddings' std): the ablation."""

    def unit(base, seed, tokenizer, split):
        model = build(base, seed, tokenizer, split)
        for encoder in model.base_model.prompt_bank.encoders.values():
            torch.nn.init.ones_(encoder.norm.weight)
        return model

    return unit


def _peft(make_config: Callable[[], object]) -> Callable:
    def build(base, seed, tokenizer, split):
        torch.manual_seed(seed)  # PEFT draws its inits from the global generator
        return get_peft_model(base, make_config())

    return build


VARIANTS: dict[str, Variant] = {
    "ours-random": Variant(
        "this library, prompt_init='random' (scaled to the embeddings)", _ours(prompt_init="random")
    ),
    "ours-vocab": Variant("this library, prompt_init='vocab'", _ours(prompt_init="vocab")),
    "ours-labels": Variant("this library, prompt_init='labels' (training answers, then frequent tokens)", _labels()),
    "ours-residual": Variant(
        "this library, reparameterization='residual' (m=400, LayerNorm), random init",
        _ours(reparameterization="residual"),
    ),
    "ours-residual-labels": Variant(
        "this library, residual + prompt_init='labels'", _labels(reparameterization="residual")
    ),
    "ours-residual-gain1": Variant(
        "ablation: residual with the paper's LayerNorm gain 1 at init",
        _unit_gain(_ours(reparameterization="residual")),
    ),
    "peft-pt-random": Variant(
        "PEFT PROMPT_TUNING, RANDOM init",
        _peft(lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N)),
        peft_prompt=True,
    ),
    "peft-pt-vocab": Variant(
        "PEFT PROMPT_TUNING, SAMPLE_VOCAB init",
        _peft(
            lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, prompt_tuning_init="SAMPLE_VOCAB")
        ),
        peft_prompt=True,
    ),
    "peft-p-tuning": Variant(
        "PEFT P_TUNING (MLP encoder, hidden 128)",
        _peft(lambda: PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, encoder_hidden_size=128)),
        lr=3e-3,
        peft_prompt=True,
    ),
    "peft-lora-r8": Variant(
        "PEFT LoRA r=8, alpha 16, q_proj/v_proj (the ceiling anchor)",
        _peft(lambda: LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        lr=1e-3,
    ),
    "ours-random-cosine": Variant(
        "this library, random init, 10 warm-up steps then cosine decay to 0",
        _ours(prompt_init="random"),
        schedule=lambda opt, steps: get_cosine_schedule_with_warmup(opt, 10, steps),
    ),
    "ours-random-n5": Variant("this library, random init, N=5", _ours(prompt_init="random", num_virtual_tokens=5)),
    "ours-random-n50": Variant("this library, random init, N=50", _ours(prompt_init="random", num_virtual_tokens=50)),
    "hard-0shot": Variant("the frozen model, no prompt", None),
    "hard-3shot": Variant("the frozen model, a hard 3-shot prompt (3 training pairs drawn per seed)", None, shots=3),
}


def _copied_prompt_scorer(path: str, tokenizer, split) -> Callable:
    """PEFT's prompt-learning `generate` re-injects the prompt at every step, and scoring by plain
    forwards costs ~1 minute per evaluation. Its learned `[N, D]` prompt is copied into this library's adapter on a
    second copy of the base instead: on unpadded rows both compute `[prompt; text]` at positions 0.. exactly (the
    run checks answers agree with PEFT's own uncached forwards at the end)."""
    evaluator = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path).eval(),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, validate_gradients="off"),
    )

    def exact(model):
        with torch.no_grad():
            evaluator.base_model.prompt("default").copy_(model.get_prompt_embedding_to_save("default"))
        return evaluator

    return exact


def _agreement(model, exact, tokenizer, split, rows: int = 8) -> bool:
    countries = [c for c, _ in split.held_out[:rows]]
    own = capitals.greedy_answers(model, tokenizer, countries, cached=False)
    return own == capitals.greedy_answers(exact(model), tokenizer, countries)


def run_one(name: str, lr: Optional[float], seed: int, steps: int, eval_at: tuple[int, ...], path: str) -> dict:
    variant = VARIANTS[name]
    lr = variant.lr if lr is None else lr
    tokenizer = AutoTokenizer.from_pretrained(path)
    split = capitals.load_split()
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(seed)  # whatever else draws from the global generator (an encoder without init_seed)
    record = {"variant": name, "lr": lr, "seed": seed, "n": N, "batch": BATCH, "threads": torch.get_num_threads()}
    start = time.perf_counter()
    if variant.build is None:
        prefix = capitals.few_shot_prefix(random.Random(seed).sample(split.train, variant.shots))
        score = capitals.exact_match(base, tokenizer, split.held_out, prefix) if variant.shots or seed == 0 else None
        record.update(steps=[0], seconds=[0.0], cpu=[0.0], score=[score], loss=[None], n=0)
        record["held_out_nll"] = [capitals.answer_nll(base, tokenizer, split.held_out, prefix)]
    else:
        model = variant.build(base, seed, tokenizer, split)
        exact = _copied_prompt_scorer(path, tokenizer, split) if variant.peft_prompt else (lambda m: m)
        nll = []

        def score(m) -> float:
            nll.append(capitals.answer_nll(exact(m), tokenizer, split.held_out))
            return capitals.exact_match(exact(m), tokenizer, split.held_out)

        curve = capitals.tune(model, tokenizer, split, steps, BATCH, lr, seed, eval_at, score, variant.schedule)
        record.update(steps=curve.steps, seconds=curve.seconds, cpu=curve.cpu, score=curve.score, loss=curve.loss)
        record["n"] = getattr(model.peft_config["default"], "num_virtual_tokens", None)
        record["held_out_nll"] = [nll.pop(0) if s is not None else None for s in curve.score]
        if variant.peft_prompt:
            record["copy_agrees_with_peft_forward"] = _agreement(model, exact, tokenizer, split)
    record["total_seconds"] = time.perf_counter() - start
    return record


def cmd_run(args) -> None:
    torch.set_num_threads(args.threads)
    path = fetch_checkpoint("smollm2")
    names = comma_list(args.variants, str) if args.variants else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    lrs = comma_list(args.lrs, float) if args.lrs else [None]
    eval_at = tuple(comma_list(args.eval_at)) if args.eval_at else EVAL_AT
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    for seed in comma_list(args.seeds):
        for name in names:
            for lr in lrs:
                record = run_one(name, lr, seed, args.steps, eval_at, path)
                with open(args.out, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
                final = next((s for s in reversed(record["score"]) if s is not None), None)
                print(
                    f"{name} lr={record['lr']:g} seed={seed}: held-out EM {final} ({record['total_seconds']:.0f} s)",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and score variants; appends to --out")
    run.add_argument("--variants", default=None, help=f"comma-separated, default all: {','.join(VARIANTS)}")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--lrs", default=None, help="comma-separated learning rates (default: each variant's own)")
    run.add_argument("--steps", type=int, default=STEPS)
    run.add_argument("--eval-at", default=None, help=f"steps to score at (default {','.join(map(str, EVAL_AT))})")
    run.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)")
    run.add_argument("--out", default=OUT)
    run.set_defaults(func=cmd_run)
    report = sub.add_parser("report", help="tables and the plot from --out")
    report.add_argument("--out", default=OUT)
    report.set_defaults(func=lambda args: _quality_report.cmd_report(args, VARIANTS))
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
