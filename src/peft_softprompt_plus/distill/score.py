"""Scoring against the teacher, for training and for the held-out figures: KL(teacher || student) per token on the
assistant positions, greedy agreement with the teacher's first tokens, each reader's content score on the probes,
and the score stage's record (`Scores`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..forward.routing import BASE
from . import content as distill_content
from .content import ContentScore
from .data import left_padded
from .teacher import TEACHER, DistillSamples, Sample, greedy


@dataclass
class ScoredBatch:
    kwargs: dict  # input_ids, attention_mask [B, L] (left-padded) and logits_to_keep
    scored: torch.Tensor  # [B, K] True where a kept position is an assistant position


def scored_batch(samples: list[Sample], pad_id: int, device) -> ScoredBatch:
    """Left-padded rows; only the last K positions (K = the most scored positions of any row) get logits."""
    batch = left_padded([s.ids for s in samples], pad_id)
    counts = torch.tensor([len(s.ids) - s.first for s in samples])  # [B] scored positions per row
    keep = int(counts.max())
    scored = torch.arange(keep).unsqueeze(0) >= keep - counts.unsqueeze(1)  # [B, K]; rows end at the last column
    kwargs = {k: v.to(device) for k, v in batch.items()}
    return ScoredBatch({**kwargs, "logits_to_keep": keep}, scored.to(device))


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, scored: torch.Tensor, top_k: int = 0):
    """KL(teacher || student) = sum_v p_t (log p_t - log p_s) at each scored position: `[P]`, in float32. With
    `top_k`, the teacher's distribution is cut to its `top_k` likeliest tokens and renormalised (as Cartridges train):
    the student's full log-probabilities are read at those tokens only."""
    teacher = teacher_logits[scored].float().log_softmax(-1)  # [P, V]
    student = student_logits[scored].float().log_softmax(-1)  # [P, V]
    if top_k:
        top, index = teacher.topk(top_k, dim=-1)  # [P, k]
        teacher, student = top.log_softmax(-1), student.gather(-1, index)  # [P, k] each
    return (teacher.exp() * (teacher - student)).sum(-1)  # [P]


def teacher_logits(model, batch: ScoredBatch) -> torch.Tensor:
    """Teacher logits `[B, K, V]` without autograd: its stored prompt pass (the hard prefix) is read, not run again."""
    with torch.no_grad():
        rows = batch.scored.shape[0]
        return model(**batch.kwargs, adapter_names=[TEACHER] * rows).logits


def student_logits(model, batch: ScoredBatch, adapter: str) -> torch.Tensor:
    return model(**batch.kwargs, adapter_names=[adapter] * batch.scored.shape[0]).logits  # [B, K, V]


def weighted_kl(model, batch: ScoredBatch, adapter: str, answer_weight: float, top_k: int = 0, student=None):
    """The mean KL(teacher || student) over the batch's scored tokens; with `answer_weight` > 0 each token weighs
    `(1 - w) + w * d / mean(d)`, d its KL(teacher || no system prompt): the tokens the system prompt decides (its
    facts, its refusals) count more than those any reply would have. `top_k` cuts the trained KL to the teacher's
    likeliest tokens (`token_kl`); the weights always read the full distributions. `student`: the student's logits
    `[B, K, V]` computed elsewhere (another library's model trained by this loop), else `adapter`'s."""
    teacher = teacher_logits(model, batch)  # [B, K, V], no autograd
    student = student_logits(model, batch, adapter) if student is None else student
    kl = token_kl(teacher, student, batch.scored, top_k)  # [P]
    if not answer_weight:
        return kl.mean()
    with torch.no_grad():
        none = model(**batch.kwargs, adapter_names=[BASE] * batch.scored.shape[0]).logits
        decided = token_kl(teacher, none, batch.scored)  # [P]
        weights = (1 - answer_weight) + answer_weight * decided / decided.mean().clamp(min=1e-8)
    return (kl * weights).sum() / weights.sum()


def text_nll(model, ids: Sequence[int], adapter: str) -> torch.Tensor:
    """The mean next-token loss of `adapter` reading `ids` after its prompt: memorising a text (`prompt_text_weight`
    trains the student on the system turn's own ids this way, beside the KL)."""
    row = torch.tensor([list(ids)], device=model.get_input_embeddings().weight.device)  # [1, S]
    logits = model(input_ids=row, attention_mask=torch.ones_like(row), adapter_names=[adapter]).logits  # [1, S, V]
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), row[0, 1:])


@torch.no_grad()
def held_out_kl(model, samples: list[Sample], adapter: str, pad_id: int, batch_size: int) -> float:
    """Mean per-token KL against the teacher over every scored position of `samples`; `adapter` BASE scores the
    model with no system prompt at all (the student's text alone)."""
    device = model.get_input_embeddings().weight.device
    total, count = 0.0, 0
    for start in range(0, len(samples), batch_size):
        batch = scored_batch(samples[start : start + batch_size], pad_id, device)
        kl = token_kl(teacher_logits(model, batch), student_logits(model, batch, adapter), batch.scored)  # [P]
        total, count = total + kl.sum().item(), count + kl.numel()
    return total / count


@dataclass
class Figures:
    """Held-out figures of one way of reading the turns (the student, or no system prompt) against the teacher."""

    kl: float  # mean per-token KL(teacher || this) on the assistant positions
    first_token: float  # share of held-out turns whose first greedy token is the teacher's
    first_16: float  # share whose first 16 greedy tokens are all the teacher's (EOS and padding included)


def agreement(tokens: list[list[int]], teacher: list[list[int]]) -> tuple[float, float]:
    first = sum(a[0] == b[0] for a, b in zip(tokens, teacher, strict=True)) / len(teacher)
    whole = sum(a == b for a, b in zip(tokens, teacher, strict=True)) / len(teacher)
    return first, whole


def figures(model, samples: DistillSamples, adapter: str, pad_id: int, stop_ids, batch_size: int) -> Figures:
    kl = held_out_kl(model, samples.held_out, adapter, pad_id, batch_size)
    tokens = greedy(model, samples.held_out_prompts, adapter, pad_id, stop_ids, batch_size)
    return Figures(kl, *agreement(tokens, samples.teacher_greedy))


def none_figures(model, samples: DistillSamples, pad_id: int, stop_ids, batch_size: int) -> Figures:
    """The baseline: the student's text with no system turn and no prompt (no default system prompt either)."""
    return figures(model, samples, BASE, pad_id, stop_ids, batch_size)


def content_scores(
    model, tokenizer, prepared, samples: DistillSamples, readers: Sequence[str], pad: int, batch_size: int, log
) -> dict[str, ContentScore]:
    """The content score of each adapter in `readers`, each in the student's place ({} without probes): greedy
    replies to every probe; the teacher's and no prompt's are drawn once and kept with the samples (a reused
    `samples` doesn't draw them again)."""
    if not samples.probes:
        return {}
    questions = [p.question for p in samples.probes]
    log(f"content: greedy replies to {len(questions)} probe questions")
    for reader, adapter in (("teacher", TEACHER), ("none", BASE)):
        if reader not in samples.probe_replies:
            samples.probe_replies[reader] = distill_content.replies(
                model, tokenizer, prepared, questions, adapter, pad, batch_size
            )
    scores = {}
    for adapter in readers:
        student = distill_content.replies(model, tokenizer, prepared, questions, adapter, pad, batch_size)
        replies = {**samples.probe_replies, "student": student}
        scores[adapter] = distill_content.score(replies, samples.probes, prepared.system_prompt)
    return scores


def gap_closed(student: Figures, none: Figures) -> float:
    """(KL_none - KL_student) / KL_none: the share of the no-system-prompt gap the student closes."""
    return (none.kl - student.kl) / none.kl if none.kl > 0 else float("nan")


@dataclass
class CurvePoint:
    step: int
    seconds: float  # training wall time up to this step
    train_kl: Optional[float]  # mean training KL of the last 10 steps (None before the first)
    held_out: Figures


@dataclass
class Scores:
    """The score stage's record: the trained student's held-out figures and content, the same for no system prompt,
    and for the kept text alone in the student's place (None: nothing kept)."""

    student: Figures
    none: Figures
    content: Optional[ContentScore] = None  # facts stated in greedy replies to the probes (None: no probes)
    kept_text: Optional[Figures] = None
    kept_text_content: Optional[ContentScore] = None
