"""The report of `distill_prompt` (`model.distill_report`): the options it ran with and what each stage measured,
printed line by line (`lines`), saved as JSON (`save`), and summed up for the model card (`metrics`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from .content import REPLY_TOKENS, ContentScore
from .options import DistillOptions
from .score import CurvePoint, Figures, gap_closed
from .teacher import DistillSamples


@dataclass
class DistillReport:
    """What `distill_prompt` did and measured; `model.distill_report` of the model it returns."""

    options: DistillOptions  # as it ran: every None of the caller's replaced by the student form's default
    mode: str
    prefix_tokens: int  # S: the system turn as the teacher reads it
    init: str  # the start, in words
    teacher_gap: float  # max |teacher adapter - base on the hard ids| / max |logit|, on one training row
    samples: DistillSamples
    student: Figures
    none: Figures  # no system prompt at all
    train_seconds: float
    train_cpu_seconds: float
    curve: list[CurvePoint] = field(default_factory=list)
    content: Optional[ContentScore] = None  # facts stated in greedy replies to the probes (None: no probes)
    kept_text: Optional[Figures] = None  # `keep_text` alone as the system turn, no soft tokens (None: nothing kept)
    kept_text_content: Optional[ContentScore] = None  # its content score, "student" being the kept text alone
    # A KV student's N positions kept as the teacher's own keys/values, never trained: a kept passage's (`facts`)
    # and the template's own around the system prompt; the rest are selected and trained.
    kept_positions: int = 0
    facts: int = 0

    @property
    def gap_closed(self) -> float:
        return gap_closed(self.student, self.none)

    @property
    def kept_text_gap_closed(self) -> Optional[float]:
        """The share of the gap the kept text alone closes (None: nothing kept)."""
        return None if self.kept_text is None else gap_closed(self.kept_text, self.none)

    def lines(self) -> list[str]:
        s, n, rows, o = self.student, self.none, self.samples, self.options
        return [
            f"distilled a {self.prefix_tokens}-token system prompt ({self.mode} mode) into {o.num_virtual_tokens} "
            f"soft tokens: {o.steps} steps, batch {o.batch_size}, lr {o.lr:g}, seed {o.seed}, init {self.init}, "
            f"{len(rows.train)} training rows from {len(rows.train_turns)} user turns"
            f"{' the teacher wrote' if rows.sampled_turns else ''}"
            + (" by self-study" if rows.self_study else "")
            + (f", KL on the teacher's top {o.kl_top_k} tokens" if o.kl_top_k else "")
            + (f", the system turn's text at weight {o.prompt_text_weight}" if o.prompt_text_weight else "")
            + (" (and the teacher's greedy reply to each question about a part)" if o.greedy_part_replies else "")
            + (f" (and {o.quote_parts} quoting each part's own text)" if o.quote_parts else "")
            + f"; {self.train_seconds:.0f} s of training"
            + (f", {rows.seconds[0]:.0f} s drawing the teacher's samples" if rows.seconds else ""),
            "options: " + ", ".join(f"{name}={value!r}" for name, value in self.options_dict().items()),
            *self._kv_lines(),
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

    def _kv_lines(self) -> list[str]:
        if not self.kept_positions:
            return []
        n, kept = self.options.num_virtual_tokens, self.kept_positions
        return [
            f"KV positions: {n} = {self.facts} kept facts + {kept - self.facts} of the template's system turn (the "
            f"teacher's own keys/values, never trained) + {n - kept} selected and trained"
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

    def options_dict(self) -> dict:
        """The options it ran with, as JSON takes them (`DistillOptions(**report.options_dict())` runs them again)."""
        return {name: list(v) if isinstance(v, tuple) else v for name, v in dataclasses.asdict(self.options).items()}

    def save(self, path) -> None:
        """The options, the figures (`metrics`) and the held-out curve as JSON at `path`, written whole or not at all
        (a file already there is replaced only by a complete one)."""
        record = {
            "options": self.options_dict(),
            "init": self.init,
            "metrics": self.metrics(),
            "curve": [
                {"step": p.step, "seconds": p.seconds, "train_kl": p.train_kl, **dataclasses.asdict(p.held_out)}
                for p in self.curve
            ],
        }
        folder = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as out:
            json.dump(_finite(record), out, indent=2, allow_nan=False)  # NaN (no probe had a fact) as null
        os.replace(out.name, path)

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
                    "kv_kept_fact_positions": self.facts,
                    "kv_kept_template_positions": self.kept_positions - self.facts,
                    "kv_selected_positions": self.options.num_virtual_tokens - self.kept_positions,
                }
                if self.kept_positions
                else {}
            ),
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


def _finite(value):
    """`value` with every NaN or infinity as None: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
