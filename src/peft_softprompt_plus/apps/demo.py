"""The main job, end to end and offline: teach a frozen model a task through a soft prompt only, then save,
reload and generate.

By default the embedded tiny GPT-2 is first pretrained (a few seconds) on two tagged tasks, "up a b" (b follows a)
and "down a b" (b precedes a). The soft prompt must then learn to stand in for the missing tag on untagged pairs,
and is scored on numbers it never saw during prompt tuning. `--model smollm2` runs the real job instead: the real
checkpoint from the package index learns the capitals task (capitals.py), scored on held-out countries against a
hard 3-shot prompt.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
from peft import PeftModel, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..method.config import SoftPromptPlusConfig
from . import capitals
from .capitals import left_padded
from .fetch import CHECKPOINTS, fetch_checkpoint
from .tiny import tiny_gpt2, tiny_tokenizer

WORDS = [" two", " three", " four", " five", " six", " seven", " eight", " nine", " ten"]
TAGS = {"up": +1, "down": -1}
TRAIN_WORDS = WORDS[1:6]  # three .. seven: the prompt is tuned on these
HELD_OUT = WORDS[6:]  # eight, nine, ten: never seen while tuning the prompt


@dataclass
class DemoResult:
    accuracy_without_prompt: float
    accuracy_with_prompt: float
    accuracy_after_reload: float
    adapter_dir: str
    samples: list


def pairs(words: list[str], step: int) -> list[tuple[str, str]]:
    return [(a, WORDS[WORDS.index(a) + step]) for a in words if 0 <= WORDS.index(a) + step < len(WORDS)]


def encode(tokenizer, prefix: str, a: str, b: str) -> tuple[list[int], list[int]]:
    """Token ids of `prefix + a + b`, with a label only on b's first token (the answer)."""
    head = tokenizer(prefix + a, add_special_tokens=False)["input_ids"]
    answer = tokenizer(b, add_special_tokens=False)["input_ids"][:1]
    return head + answer, [-100] * len(head) + answer


def pretrain_tiny(steps: int, seed: int, progress: bool):
    """A tiny GPT-2 that knows both tagged tasks, so the prompt has something to select."""
    tokenizer = tiny_tokenizer()
    model = tiny_gpt2(seed=seed, vocab_size=len(tokenizer), n_layer=2, n_embd=64).train()
    # GPT-2 names no loss and transformers warns when it falls back to this one; the name isn't saved with the model.
    model.loss_type = "ForCausalLM"
    rows = [encode(tokenizer, " " + tag, a, b) for tag, step in TAGS.items() for a, b in pairs(WORDS, step)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in tqdm(range(steps), desc="pretraining tiny GPT-2", disable=not progress):
        batch = left_padded(rng.choices(rows, k=32), tokenizer.pad_token_id)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), tokenizer


@torch.no_grad()
def accuracy(model, tokenizer, words: list[str]) -> float:
    """Share of held-out `a` whose greedy next token is the first token of the number before it."""
    rows = [encode(tokenizer, "", a, b) for a, b in pairs(words, TAGS["down"])]
    batch = left_padded(rows, tokenizer.pad_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, L, V]
    guess = logits[:, -2].argmax(-1)  # the position before the answer predicts it
    return (guess == batch["labels"][:, -1]).float().mean().item()


def run_demo(
    model_path: Optional[str] = None,
    num_virtual_tokens: int = 8,
    steps: int = 150,
    pretrain_steps: int = 400,
    out_dir: Optional[str] = None,
    seed: int = 0,
    progress: bool = True,
) -> DemoResult:
    torch.manual_seed(seed)
    work = tempfile.mkdtemp(prefix="softprompt-plus-demo-")
    if model_path is None:
        base, tokenizer = pretrain_tiny(pretrain_steps, seed, progress)
        model_path = os.path.join(work, "tiny-gpt2")
        base.save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(model_path).eval()
    before = accuracy(base, tokenizer, HELD_OUT)

    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens, prompt_init="vocab", init_seed=seed
    )
    model = get_peft_model(base, config)
    rows = [encode(tokenizer, "", a, b) for a, b in pairs(TRAIN_WORDS, TAGS["down"])]
    batch = left_padded(rows, tokenizer.pad_token_id)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    model.train()
    bar = tqdm(range(steps), desc="tuning the soft prompt", disable=not progress)
    for step in bar:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    after = accuracy(model, tokenizer, HELD_OUT)

    out_dir = out_dir or os.path.join(work, "adapter")
    model.save_pretrained(out_dir)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path).eval(), out_dir)
    reloaded_acc = accuracy(reloaded, tokenizer, HELD_OUT)
    samples = []
    for word in HELD_OUT:
        ids = tokenizer(word, return_tensors="pt", add_special_tokens=False)
        out = reloaded.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        samples.append((word.strip(), tokenizer.decode(out[0, ids["input_ids"].shape[1] :]).strip()))
    return DemoResult(before, after, reloaded_acc, out_dir, samples)


@dataclass
class RealDemoResult:
    checkpoint: str
    held_out: int
    zero_shot: float
    three_shot: float
    with_prompt: float
    after_reload: float
    train_seconds: float
    adapter_dir: str
    samples: list


def run_real_demo(
    name: str = "smollm2",
    num_virtual_tokens: int = 20,
    steps: int = 120,
    out_dir: Optional[str] = None,
    seed: int = 0,
    progress: bool = True,
    held_out: Optional[int] = None,
) -> RealDemoResult:
    """The capitals task on a real checkpoint: tune a soft prompt, save, reload, and score held-out countries
    against the frozen model with no prompt and with a hard 3-shot prompt. `held_out` scores only that many."""
    torch.manual_seed(seed)
    path = fetch_checkpoint(name)
    split = capitals.load_split()
    split = capitals.Split(split.train, split.held_out[:held_out])
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    zero = capitals.exact_match(base, tokenizer, split.held_out)
    three = capitals.exact_match(base, tokenizer, split.held_out, capitals.few_shot_prefix(split.train[:3]))
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens, init_seed=seed)
    model = get_peft_model(base, config)
    bar = tqdm(total=steps, desc=f"tuning a {num_virtual_tokens}-token prompt", disable=not progress)
    curve = capitals.tune(model, tokenizer, split, steps=steps, seed=seed, on_step=lambda loss: _tick(bar, loss))
    bar.close()
    tuned = capitals.exact_match(model, tokenizer, split.held_out)
    out_dir = out_dir or os.path.join(tempfile.mkdtemp(prefix="softprompt-plus-demo-"), "adapter")
    model.save_pretrained(out_dir)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path).eval(), out_dir)
    countries = [country for country, _ in split.held_out[:5]]
    answers = capitals.greedy_answers(reloaded, tokenizer, countries)
    after = capitals.exact_match(reloaded, tokenizer, split.held_out)
    samples = list(zip(countries, answers, strict=True))
    return RealDemoResult(name, len(split.held_out), zero, three, tuned, after, curve.seconds[-1], out_dir, samples)


def _tick(bar, loss: float) -> None:
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.3f}", refresh=False)


def _print_real(result: RealDemoResult) -> None:
    print(f"{result.checkpoint}: held-out exact match on {result.held_out} countries never seen in training")
    print(f"  frozen model, no prompt:        {result.zero_shot:.1%}")
    print(f"  frozen model, hard 3-shot:      {result.three_shot:.1%}")
    print(f"  learned soft prompt:            {result.with_prompt:.1%}  ({result.train_seconds:.0f} s of training)")
    print(f"  after save + from_pretrained:   {result.after_reload:.1%}")
    print(f"adapter saved to {result.adapter_dir}")
    for country, answer in result.samples:
        print(f"  {country} -> {answer}")


def main(args) -> int:
    if args.model in CHECKPOINTS:
        steps = args.steps if args.steps is not None else 120
        _print_real(run_real_demo(args.model, steps=steps, out_dir=args.output_dir, seed=args.seed))
        return 0
    steps = args.steps if args.steps is not None else 150
    result = run_demo(model_path=args.model, steps=steps, out_dir=args.output_dir, seed=args.seed)
    print(f"held-out accuracy, frozen model without prompt: {result.accuracy_without_prompt:.0%}")
    print(f"held-out accuracy, frozen model with the learned prompt: {result.accuracy_with_prompt:.0%}")
    print(f"held-out accuracy after save + PeftModel.from_pretrained: {result.accuracy_after_reload:.0%}")
    print(f"adapter saved to {result.adapter_dir}")
    for word, continuation in result.samples:
        print(f"  generate({word!r}) -> {continuation!r}")
    return 0
