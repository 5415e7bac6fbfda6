"""Prompt distillation's teacher: the frozen base reading the hard system prompt, held as a second, frozen adapter
whose `[S, D]` prompt is the prefix tokens' own input embeddings (its keys/values are then computed once, stored, and
read by every batch), and what it samples: user turns, continuations, and greedy references for the held-out turns."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..forward.routing import BASE
from ..method.config import SoftPromptPlusConfig
from .data import Prepared, cut_turn, fits, left_padded, opener_ids

TEACHER = "softprompt_plus_teacher"
KEPT_ONLY = "softprompt_plus_kept_text"  # `keep_text` alone as the system turn, no soft tokens: a baseline reader
AGREEMENT_TOKENS = 16  # greedy agreement is judged on the first 16 tokens
TURN_TOKENS = 48  # the longest user turn the teacher samples


def attach_teacher(model, prefix_ids: list[int], name: str = TEACHER) -> None:
    """Add the teacher adapter (or another hard reader, `name`) to `model` (a softprompt-plus PeftModel): the hard
    prefix as a frozen prompt.

    Exact where the model embeds ids by its input embedding alone (every transformers decoder: a scale or position
    embedding applies to `inputs_embeds` as to ids): prompt positions 0..S-1 then the text from S are what the base
    computes on the prefix's tokens followed by the text's."""
    # init_seed: the placeholder values (overwritten below) must not draw from the caller's generator.
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=len(prefix_ids),
        inference_mode=True,
        validate_gradients="off",
        init_seed=0,
    )
    model.add_adapter(name, config)
    embedding = model.get_input_embeddings()
    with torch.no_grad():
        rows = embedding(torch.tensor(prefix_ids, device=embedding.weight.device))  # [S, D]
        prompt = model.base_model.prompt(name)
        prompt.copy_(rows.float())
    prompt.requires_grad_(False)


@torch.no_grad()
def teacher_gap(model, prefix_ids: list[int], text_ids: list[int]) -> float:
    """Max |logit| difference between the teacher adapter on `text_ids` and the base fed the hard token ids, relative
    to the largest logit: the proof, on this model, that the teacher is the hard prompt."""
    device = model.get_input_embeddings().weight.device
    text = torch.tensor([text_ids], device=device)  # [1, L]
    teacher = model(input_ids=text, adapter_names=[TEACHER]).logits  # [1, L, V]
    hard = torch.tensor([prefix_ids + text_ids], device=device)  # [1, S+L]
    base = model(input_ids=hard, adapter_names=[BASE]).logits[:, len(prefix_ids) :]  # [1, L, V]
    return ((teacher - base).abs().max() / base.abs().max().clamp(min=1.0)).item()


@dataclass
class Sample:
    """One training or scoring row: the student's text (the turn's suffix, then a teacher continuation) and the index
    of the first scored position: the last suffix token, which predicts the first assistant token."""

    ids: list[int]
    first: int


@dataclass
class DistillSamples:
    """What the teacher produced for one system prompt; reusable across students (`distill_prompt(samples=...)`)."""

    mode: str
    prefix_ids: list[int]
    train_turns: list[str]
    held_out_turns: list[str]
    train: list[Sample] = field(default_factory=list)
    held_out: list[Sample] = field(default_factory=list)
    held_out_prompts: list[list[int]] = field(default_factory=list)  # each held-out turn's suffix ids
    teacher_greedy: list[list[int]] = field(default_factory=list)  # [AGREEMENT_TOKENS] per held-out turn
    sampled_turns: bool = False
    self_study: bool = False  # the teacher wrote its turns from SELF_STUDY_SEEDS
    seconds: Optional[tuple[float, float]] = None  # (wall, cpu) it took to draw them
    probes: list = field(default_factory=list)  # content.Probe: questions never trained on, scored for content
    probe_replies: dict = field(default_factory=dict)  # "teacher" / "none" -> greedy reply per probe, drawn once
    drafted_probes: bool = False  # the probes were built from the prompt's parts (none were given)


def _normal(turn: str) -> str:
    return " ".join(turn.split()).casefold()


def unique_turns(turns: Sequence[str]) -> list[str]:
    """Non-empty turns, the first of each set of duplicates (spacing and case ignored)."""
    seen: dict[str, str] = {}
    for turn in turns:
        if turn.strip():
            seen.setdefault(_normal(turn), turn.strip())
    return list(seen.values())


def split_turns(turns: list[str], held_out: Optional[Sequence[str]], fraction: float, seed: int):
    """(train, held out): given held-out turns are taken out of training; otherwise a seeded `fraction` is kept out."""
    if held_out is not None:
        kept = {_normal(t) for t in held_out}
        return [t for t in turns if _normal(t) not in kept], unique_turns(held_out)
    order = turns[:]
    random.Random(seed).shuffle(order)
    count = max(1, round(fraction * len(order)))
    return order[count:], order[:count]


def generate_rows(model, rows: list[list[int]], adapter: str, pad_id: int, stop_ids, **how) -> list[list[int]]:
    """New tokens per row, each cut after its first stop token."""
    device = model.get_input_embeddings().weight.device
    batch = {k: v.to(device) for k, v in left_padded(rows, pad_id).items()}
    names = [adapter] * len(rows)
    out = model.generate(**batch, adapter_names=names, pad_token_id=pad_id, eos_token_id=stop_ids, **how)
    cut = []
    for new in out[:, batch["input_ids"].shape[1] :].tolist():  # [B, new]
        end = next((i + 1 for i, t in enumerate(new) if t in stop_ids), len(new))
        cut.append(new[:end])
    return cut


def sampling(max_new_tokens: int) -> dict:
    # Temperature 1 and no top-k/top-p: the teacher's own distribution, the one the student must match.
    return dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens)


@torch.no_grad()
def greedy(model, prompts: list[list[int]], adapter: str, pad_id: int, stop_ids: list[int], batch_size: int):
    """The first AGREEMENT_TOKENS greedy tokens per prompt, read through `adapter` (BASE: no prompt at all)."""
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        new = generate_rows(model, chunk, adapter, pad_id, stop_ids, do_sample=False, max_new_tokens=AGREEMENT_TOKENS)
        out.extend(row + [pad_id] * (AGREEMENT_TOKENS - len(row)) for row in new)
    return out


def _written_turns(model, tokenizer, prepared: Prepared, count: int, batch_size: int, pad_id: int, how) -> list[str]:
    """`count` distinct turns the teacher writes on the base, round after round: `how` is (the rows of round r, the
    stop ids, which written turns to keep, what the error calls them)."""
    rows_of, stops, keep, kind = how
    rounds, turns = 8 * (count // batch_size + 1), []
    for round_ in range(rounds):  # a model that repeats itself must not loop for ever
        new = generate_rows(model, rows_of(round_), BASE, pad_id, stops, **sampling(TURN_TOKENS))
        turns = unique_turns(turns + [t for t in (cut_turn(tokenizer, prepared, row) for row in new) if keep(t)])
        if len(turns) >= count:
            return turns[:count]
    if len(turns) < 2:
        raise ValueError(
            f"The teacher wrote only {len(turns)} distinct {kind}(s) in {rounds} rounds; pass `user_turns` (CLI: "
            "--user-file) instead."
        )
    return turns


@torch.no_grad()
def sample_turns(model, tokenizer, prepared: Prepared, count: int, batch_size: int, pad_id: int) -> list[str]:
    """`count` distinct user turns the teacher writes itself, after the system prompt and the template's user-turn
    opener. Read from the base on the hard ids (a plain prefix may open with no token of text at all)."""
    head = prepared.prefix_ids + opener_ids(tokenizer, prepared)
    stops = list(dict.fromkeys(prepared.stop_ids + tokenizer("\n", add_special_tokens=False)["input_ids"][-1:]))
    how = (lambda _: [head] * batch_size, stops, lambda turn: True, "user turn")
    return _written_turns(model, tokenizer, prepared, count, batch_size, pad_id, how)


# Self-study (as in Cartridges): the teacher, reading the system prompt, is asked as its assistant to write a user's
# message of one of five kinds; the messages become training turns that the teacher then answers. Written here, one
# instruction per kind, so the turns cover the prompt's content in forms a user's own first line rarely takes.
SELF_STUDY_SEEDS = {
    "structuring": "Write one message a user could send you asking to arrange some of the information in your "
    "instructions as a short list or table. Reply with the message only.",
    "summarising": "Write one message a user could send you asking for a short summary of one part of the "
    "information in your instructions. Reply with the message only.",
    "questions": "Write one question a user could ask you whose answer is a fact stated in your instructions. Reply "
    "with the question only.",
    "use cases": "Think of a real situation in which someone needs the information in your instructions, and write "
    "the message they would send you. Reply with the message only.",
    "creative": "Write one playful or creative request a user could send you about the information in your "
    "instructions. Reply with the request only.",
}


@torch.no_grad()
def self_study_turns(model, tokenizer, prepared: Prepared, count: int, batch_size: int, pad_id: int) -> list[str]:
    """`count` distinct user turns written by the teacher from SELF_STUDY_SEEDS, the kinds taken in turn; read from
    the base on the hard ids, each seed instruction as the user's turn and the teacher's reply as the new turn."""
    heads = [prepared.prefix_ids + prepared.suffix_ids(tokenizer, seed) for seed in SELF_STUDY_SEEDS.values()]

    def rows_of(round_: int) -> list[list[int]]:
        return [heads[(round_ * batch_size + i) % len(heads)] for i in range(batch_size)]

    keep = lambda turn: bool(turn) and fits(prepared, tokenizer, turn)  # noqa: E731
    how = (rows_of, prepared.stop_ids, keep, "self-study turn")
    return _written_turns(model, tokenizer, prepared, count, batch_size, pad_id, how)


def _continuations(model, suffixes: list[list[int]], pad_id: int, stop_ids, batch_size: int, **how) -> list[Sample]:
    samples = []
    for start in range(0, len(suffixes), batch_size):
        chunk = suffixes[start : start + batch_size]
        new = generate_rows(model, chunk, TEACHER, pad_id, stop_ids, **how)
        samples.extend(Sample(suffix + cont, len(suffix) - 1) for suffix, cont in zip(chunk, new, strict=True))
    return samples


@torch.no_grad()
def sample_continuations(
    model, suffixes: list[list[int]], per_turn: int, max_new_tokens: int, pad_id: int, stop_ids, batch_size: int
) -> list[Sample]:
    """`per_turn` teacher continuations of each suffix, sampled at temperature 1, as scored rows."""
    rows = [suffix for suffix in suffixes for _ in range(per_turn)]
    return _continuations(model, rows, pad_id, stop_ids, batch_size, **sampling(max_new_tokens))


@torch.no_grad()
def greedy_continuations(
    model, suffixes: list[list[int]], max_new_tokens: int, pad_id: int, stop_ids, batch_size: int
):
    """The teacher's greedy continuation of each suffix, as scored rows: its likeliest reply, the one a probe reads.
    A small teacher sampled at temperature 1 rarely states the prompt's facts (bench/RESULTS.md: 29 of 372 rows); its
    greedy reply often does. The loss on these rows is still the full KL at every position: only the text differs."""
    return _continuations(
        model, suffixes, pad_id, stop_ids, batch_size, do_sample=False, max_new_tokens=max_new_tokens
    )


def quoted_rows(tokenizer, prepared, parts, count: int) -> list[Sample]:
    """Rows whose reply is a part's own text, after `count` questions asking to quote it (`quote_parts`)."""
    rows = []
    for part in parts:
        reply = tokenizer(" ".join(part.text.split()), add_special_tokens=False)["input_ids"]
        for question in part.quotes(count):
            if fits(prepared, tokenizer, question):
                suffix = prepared.suffix_ids(tokenizer, question)
                rows.append(Sample(suffix + reply, len(suffix) - 1))
    return rows
