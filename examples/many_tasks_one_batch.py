"""Many tasks, one base: train two soft prompts in the same batches, save them, and serve both (and the bare base)
from one frozen model, each row of a batch picking its own task with `adapter_names`.

The embedded tiny GPT-2 is first pretrained on two tagged tasks ("up a b": b follows a; "down a b": b precedes a).
Prompt "up" must stand in for the tag "up", prompt "down" for "down"; both are tuned at once on untagged pairs.

    python examples/many_tasks_one_batch.py [--steps 150] [--output-dir DIR]      # about 20 s on 2 CPU cores, offline
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import peft_softprompt_plus  # noqa: F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.demo import (
    HELD_OUT,
    TAGS,
    TRAIN_WORDS,
    WORDS,
    encode,
    left_padded,
    pairs,
    pretrain_tiny,
)

TASKS = tuple(TAGS)  # ("up", "down"): one adapter per task


def task_rows(tokenizer, words, task):
    return [encode(tokenizer, "", a, b) for a, b in pairs(words, TAGS[task])]


def train(base, tokenizer, steps: int, seed: int):
    """One adapter per task, all trainable, tuned together on batches that mix the tasks row by row."""
    config = dict(task_type="CAUSAL_LM", num_virtual_tokens=8, prompt_init="vocab", init_seed=seed)
    model = get_peft_model(base, SoftPromptPlusConfig(**config), adapter_name=TASKS[0])
    for task in TASKS[1:]:
        model.add_adapter(task, SoftPromptPlusConfig(**config))
    model.set_requires_grad(list(TASKS), requires_grad=True)  # several prompts train at once
    rows = [(row, task) for task in TASKS for row in task_rows(tokenizer, TRAIN_WORDS, task)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        picked = rng.sample(rows, k=len(rows))
        batch = left_padded([row for row, _ in picked], tokenizer.pad_token_id)
        model(**batch, adapter_names=[task for _, task in picked]).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@torch.no_grad()
def serve(model, tokenizer, requests: list[tuple[str, str]]) -> list[str]:
    """One batched `generate` for requests `(task, text)`; task '__base__' runs the frozen model alone."""
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for _, text in requests]
    batch = left_padded([(ids, ids) for ids in encoded], tokenizer.pad_token_id)
    out = model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        adapter_names=[task for task, _ in requests],
        max_new_tokens=2,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    width = batch["input_ids"].shape[1]
    return [tokenizer.decode(row[width:]).strip() for row in out]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--output-dir", default=None, help="where to save the adapters (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    work = args.output_dir or tempfile.mkdtemp(prefix="softprompt-plus-tasks-")
    base, tokenizer = pretrain_tiny(400, args.seed, progress=False)
    base_dir = os.path.join(work, "tiny-gpt2")
    base.save_pretrained(base_dir)

    trained = train(base, tokenizer, args.steps, args.seed)
    trained.save_pretrained(work)  # one folder per adapter: work/up, work/down

    # Serving: one frozen base, every task's adapter loaded beside it.
    fresh = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    served = PeftModel.from_pretrained(fresh, os.path.join(work, TASKS[0]), adapter_name=TASKS[0])
    for task in TASKS[1:]:
        served.load_adapter(os.path.join(work, task), adapter_name=task)
    requests = [(task, a) for a in HELD_OUT[:2] for task in (*TASKS, "__base__")]  # words never tuned on
    answers = serve(served, tokenizer, requests)
    for (task, text), answer in zip(requests, answers, strict=True):
        print(f"  [{task:>8}] {text.strip():>6} -> {answer}")
    correct = {
        task: sum(
            answer.split()[:1] == [WORDS[WORDS.index(text) + TAGS[task]].strip()]  # the first word answers
            for (asked, text), answer in zip(requests, answers, strict=True)
            if asked == task
        )
        for task in TASKS
    }
    print("correct answers per task:", correct)
    return {"answers": answers, "requests": requests, "correct": correct}


if __name__ == "__main__":
    main()
