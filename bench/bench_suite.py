"""The task suite harness: each way of adapting SmolLM2-135M-Instruct on the three suite tasks
(`peft_softprompt_plus.apps.suite`: cities, subdivisions, emoji; 400 held-out items each), at equal steps and at equal
training time, over seeds, with 95% intervals over items and seeds. Method and targets: bench/README.md.

    python bench/bench_suite.py run --tasks cities --variants ours-vocab,hard-3shot --seeds 0,1,2
    python bench/bench_suite.py run --tasks cities:chat --variants ours-vocab,ours-system-turn --seeds 0  # chat form
    python bench/bench_suite.py report                      # tables from every recorded run

Every evaluation records each held-out item's exact match and the validation score, so "keep the best step by
validation" is read off the same runs (`+keep-best` rows) without training again. Runs append to
bench/out/suite.jsonl; several processes can share the work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _suite_ct as ct  # noqa: E402
import _suite_kv as kv  # noqa: E402
import bench_quality as q  # noqa: E402
import torch  # noqa: E402
from _stats import comma_list  # noqa: E402
from _suite_report import cmd_report  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from peft_softprompt_plus.apps import capitals, suite  # noqa: E402
from peft_softprompt_plus.apps.fetch import fetch_checkpoint  # noqa: E402

STEPS, EVAL_AT = 120, (40, 80, 120)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "suite.jsonl")
ADAPTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "suite_adapters")
TRANSFER_FROM = {"cities": "subdivisions", "subdivisions": "cities", "emoji": "cities"}  # answers of the same kind


def _bos_prefix(base, seed, tokenizer, split):
    # SmolLM2-Instruct's tokenizer names <|im_start|> its BOS; the token its pre-training put before every document
    # is <|endoftext|>, which is what a plain task's text would follow.
    start = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    start = start if start != tokenizer.unk_token_id and start is not None else tokenizer.bos_token_id
    return q._ours(prompt_prefix_ids=[start])(base, seed, tokenizer, split)


def _transfer(task: str):
    def build(base, seed, tokenizer, split):
        folder = os.path.join(ADAPTERS, f"{TRANSFER_FROM[task]}-ours-vocab-{seed}")
        if not os.path.isdir(folder):
            raise SystemExit(f"run ours-vocab on {TRANSFER_FROM[task]} seed {seed} first: {folder} is missing")
        return q._ours(prompt_init="adapter", prompt_init_adapter=folder)(base, seed, tokenizer, split)

    return build


def _system_turn(base, seed, tokenizer, split):
    # The soft tokens inside a system turn of the chat template (SmolLM2's ChatML), where a system prompt sits.
    turn = dict(prompt_prefix="<|im_start|>system\n", prompt_suffix="<|im_end|>\n")
    return q._ours(tokenizer_name_or_path=tokenizer.name_or_path, **turn)(base, seed, tokenizer, split)


def _shots(split, seed: int, count: int, form: capitals.Form = capitals.PLAIN) -> str:
    """The hard prompt of `count` training pairs drawn for `seed`: the same pairs wherever the seed is the same."""
    return capitals.few_shot_prefix(random.Random(seed).sample(split.train, count), form)


def _few_shot_after(base, seed, tokenizer, split):
    # The soft tokens, then the very examples hard-3shot reads for this seed (plain form), frozen, then the question:
    # placement lets the prompt learn what the examples leave out instead of relearning the format.
    text = _shots(split, seed, q.VARIANTS["hard-3shot"].shots)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return q._ours(prompt_suffix_ids=ids)(base, seed, tokenizer, split)


EXTRA = {  # the options issue 30 adds, on top of bench_quality's variants
    "ours-bos": q.Variant("this library, the document start (<|endoftext|>) as a hard prefix", _bos_prefix),
    "ours-transfer": q.Variant("this library, started from ours-vocab trained on a related task", None),
    "ours-system-turn": q.Variant("this library, the soft tokens inside a system turn (chat form)", _system_turn),
    "ours-3shot-after": q.Variant("this library, hard-3shot's examples as frozen suffix (plain)", _few_shot_after),
}


def _variant(name: str, task: str) -> q.Variant:
    if name == "ours-transfer":
        return q.Variant(EXTRA[name].about, _transfer(task))
    return EXTRA.get(name) or q.VARIANTS[name]


def run_one(spec: str, name: str, seed: int, steps: int, eval_at: tuple[int, ...], path: str, lr=None) -> dict:
    """One arm on one task; `spec` is a task name, `name:chat` for its chat form; `lr` a KV arm's (None: its own)."""
    task, _, form_name = spec.partition(":")
    arm = ct.parse(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    form = suite.form_of(form_name or "plain", tokenizer)
    split = suite.load_task(task)
    prefix, train_split, n = None, split, q.N
    if arm is not None:  # a context-tuning arm (_suite_ct.py): its demonstrations, what it trains on
        pairs, texts = ct.demonstrations(split, arm, seed, form, task)
        build = None if arm.kind == "hard-demos" else ct.build(arm, texts)
        variant, copied = q.Variant(name, build, lr=ct.CT_LR if lr is None else lr), arm.kind != "ct"
        train_split = ct.train_split(split, arm, pairs)
        n = arm.n or len(tokenizer("".join(texts), add_special_tokens=False)["input_ids"])
    elif name in kv.VARIANTS:
        variant, copied = kv.variant(name, task, lr)
    else:
        variant, copied = _variant(name, task), False
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(seed)
    tag = name if lr is None else f"{name}-lr{lr:g}"  # a swept learning rate is its own arm in the report
    record = {"task": spec, "variant": tag, "lr": variant.lr, "seed": seed, "threads": torch.get_num_threads()}
    start = time.perf_counter()
    if arm is not None and arm.kind == "hard-demos":
        record.update(ct.hard_shots(base, tokenizer, split, arm, pairs, texts, form))
    elif variant.build is None:
        prefix = prefix if prefix is not None else _shots(split, seed, variant.shots, form)
        items = capitals.matches(base, tokenizer, split.held_out, prefix, form=form)
        record.update(steps=[0], cpu=[0.0], items=[items], validation=[None])
    else:
        model = variant.build(base, seed, tokenizer, split)
        exact = q._copied_prompt_scorer(path, tokenizer, split) if variant.peft_prompt else (lambda m: m)
        exact = kv.copied_kv_scorer(path, n) if copied else exact
        items, validation = [], []

        def score(m) -> float:
            items.append(capitals.matches(exact(m), tokenizer, split.held_out, form=form))
            validation.append(capitals.exact_match(exact(m), tokenizer, split.validation, form=form))
            return sum(items[-1]) / len(items[-1])

        if arm is not None and arm.kind == "ct":
            record["matched"] = ct.matched(model, tokenizer, train_split, form)  # rows leave-one-out recognises
        batch = min(q.BATCH, len(train_split.train))
        curve = capitals.tune(model, tokenizer, train_split, steps, batch, variant.lr, seed, eval_at, score, form=form)
        scored = [i for i, s in enumerate(curve.score) if s is not None]
        record.update(
            steps=[curve.steps[i] for i in scored],
            cpu=[curve.cpu[i] for i in scored],
            items=items,
            validation=validation,
        )
        if copied:
            record["agrees"] = kv.agrees(model, exact, tokenizer, split, form)
        if name == "ours-vocab":
            model.save_pretrained(os.path.join(ADAPTERS, f"{spec}-{name}-{seed}".replace(":", "-")))
    record["total_seconds"] = time.perf_counter() - start
    return record


def cmd_run(args) -> None:
    torch.set_num_threads(args.threads)
    path = fetch_checkpoint("smollm2")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    eval_at = tuple(comma_list(args.eval_at))
    for seed in comma_list(args.seeds):
        for task in comma_list(args.tasks, str):
            for name in comma_list(args.variants, str):
                record = run_one(task, name, seed, args.steps, eval_at, path, args.lr)
                with open(args.out, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
                final = sum(record["items"][-1]) / len(record["items"][-1])
                print(f"{task} {name} seed={seed}: held-out EM {100 * final:.1f} ({record['total_seconds']:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--tasks", default=",".join(suite.TASKS))
    run.add_argument("--variants", default="ours-vocab,hard-3shot,peft-pt-vocab")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--steps", type=int, default=STEPS)
    run.add_argument("--eval-at", default=",".join(map(str, EVAL_AT)))
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--lr", type=float, default=None, help=f"the KV arms' learning rate (default {kv.KV_LR})")
    run.add_argument("--out", default=OUT)
    report = sub.add_parser("report")
    report.add_argument("--out", default=OUT)
    args = parser.parse_args()
    {"run": cmd_run, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
