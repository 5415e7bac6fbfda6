"""Scoring against the teacher, for training and for the held-out figures: KL(teacher || student) per token on the
assistant positions, greedy agreement with the teacher's first tokens, each reader's content score on the probes,
and the report `distill_prompt` hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..forward.routing import BASE
from . import content as distill_content
from .content import REPLY_TOKENS, ContentScore
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
class DistillReport:
    """What `distill_prompt` did and measured; `model.distill_report` of the model it returns."""

    mode: str
    prefix_tokens: int  # S: the system turn as the teacher reads it
    num_virtual_tokens: int
    steps: int
    batch_size: int
    lr: float
    seed: int
    init: str
    teacher_gap: float  # max |teacher adapter - base on the hard ids| / max |logit|, on one training row
    student: Figures
    none: Figures  # no system prompt at all
    train_seconds: float
    train_cpu_seconds: float
    samples: DistillSamples
    curve: list[CurvePoint] = field(default_factory=list)
    content: Optional[ContentScore] = None  # facts stated in greedy replies to the probes (None: no probes)
    turns_per_part: int = 0
    answer_weight: float = 0.0
    greedy_part_replies: bool = False
    quote_parts: int = 0
    kept_text: Optional[Figures] = None  # `keep_text` alone as the system turn, no soft tokens (None: nothing kept)
    kept_text_content: Optional[ContentScore] = None  # its content score, "student" being the kept text alone
    kl_top_k: int = 0  # trained on the teacher's top-k tokens (0: its full distribution)

    @property
    def gap_closed(self) -> float:
        return gap_closed(self.student, self.none)

    @property
    def kept_text_gap_closed(self) -> Optional[float]:
        """The share of the gap the kept text alone closes (None: nothing kept)."""
        return None if self.kept_text is None else gap_closed(self.kept_text, self.none)

    def lines(self) -> list[str]:
        s, n, rows = self.student, self.none, self.samples
        return [
            f"distilled a {self.prefix_tokens}-token system prompt ({self.mode} mode) into {self.num_virtual_tokens} "
            f"soft tokens: {self.steps} steps, batch {self.batch_size}, lr {self.lr:g}, seed {self.seed}, init "
            f"{self.init}, {len(rows.train)} training rows from {len(rows.train_turns)} user turns"
            f"{' the teacher wrote' if rows.sampled_turns else ''}"
            + (" by self-study" if rows.self_study else "")
            + (f", KL on the teacher's top {self.kl_top_k} tokens" if self.kl_top_k else "")
            + (" (and the teacher's greedy reply to each question about a part)" if self.greedy_part_replies else "")
            + (f" (and {self.quote_parts} quoting each part's own text)" if self.quote_parts else "")
            + f"; {self.train_seconds:.0f} s of training"
            + (f", {rows.seconds[0]:.0f} s drawing the teacher's samples" if rows.seconds else ""),
            f"teacher check: the frozen hard-prompt adapter equals the base fed the hard tokens within "
            f"{self.teacher_gap:.1e} (relative)",
            f"held out ({len(rows.held_out_turns)} user turns never trained on, {len(rows.held_out)} continuations):",
            f"  per-token KL vs the teacher: student {s.kl:.4f}, no system prompt {n.kl:.4f}, gap closed "
            f"{self.gap_closed:.1%}",
            f"  greedy agreement with the teacher: first token {s.first_token:.0%} (no system prompt "
            f"{n.first_token:.0%}), first 16 tokens {s.first_16:.0%} (no system prompt {n.first_16:.0%})",
            *self._kept_text_lines(),
            *self._content_lines(),
        ]

    def _kept_text_lines(self) -> list[str]:
        k, gap = self.kept_text, self.kept_text_gap_closed
        if k is None:
            return []
        return [
            f"  the kept text alone as the system prompt (no soft tokens): KL {k.kl:.4f}, gap closed {gap:.1%}, "
            f"first token {k.first_token:.0%}, first 16 tokens {k.first_16:.0%}: the soft tokens add "
            f"{self.gap_closed - gap:+.1%} of the gap"
        ]

    def _content_lines(self) -> list[str]:
        c = self.content
        if c is None:
            return []
        if not c.probes:
            return ["content: no probe had a fact to check (the teacher's replies stated none of the prompt's words)"]
        lines = [
            f"content ({c.probes} probe questions never trained on, greedy replies of up to {REPLY_TOKENS} tokens): "
            f"share of each probe's facts stated: teacher {c.teacher:.2f}, student {c.student:.2f}, no system "
            f"prompt {c.none:.2f}; the student keeps {c.kept:.0%} of the teacher's gain"
        ]
        k = self.kept_text_content
        if k is not None:
            lines.append(
                f"  the kept text alone: {k.student:.2f}, keeping {k.kept:.0%} (where it keeps as much as the "
                "student, the soft tokens carry the tone, not these facts)"
            )
        if self.samples.drafted_probes:
            lines.append(
                "  (these probes are built from the prompt's own words, as the questions about each part are: "
                "they can overstate what reaches a user's own questions; pass probes with facts (CLI: --probe-file) "
                "to measure that)"
            )
        return lines

    def metrics(self) -> dict:
        """The figures for the adapter's model card (`softprompt_plus_metrics`)."""
        return {
            "distilled_from": f"a {self.prefix_tokens}-token system prompt, {self.mode} mode",
            "student_inputs": "peft_softprompt_plus.student_inputs(tokenizer, conversations, "
            f"chat={self.mode == 'chat'})",
            "held_out_kl_student": round(self.student.kl, 4),
            "held_out_kl_no_system_prompt": round(self.none.kl, 4),
            "held_out_gap_closed": round(self.gap_closed, 4),
            "greedy_first_token_agreement": round(self.student.first_token, 4),
            "greedy_first_16_agreement": round(self.student.first_16, 4),
            **(
                {
                    "content_probes": self.content.probes,
                    "content_teacher": round(self.content.teacher, 4),
                    "content_student": round(self.content.student, 4),
                    "content_no_system_prompt": round(self.content.none, 4),
                    "content_kept": round(self.content.kept, 4),
                }
                if self.content is not None and self.content.probes
                else {}
            ),
            **(
                {
                    "held_out_kl_kept_text_alone": round(self.kept_text.kl, 4),
                    "held_out_gap_closed_kept_text_alone": round(self.kept_text_gap_closed, 4),
                }
                if self.kept_text is not None
                else {}
            ),
            **(
                {"content_kept_text_alone": round(self.kept_text_content.student, 4)}
                if self.kept_text_content is not None and self.kept_text_content.probes
                else {}
            ),
        }
