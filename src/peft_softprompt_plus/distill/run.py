"""`distill_prompt`: a long system prompt compressed into a few soft tokens of a frozen model (Wingate et al. 2022).
The teacher is the model reading the hard prompt, the student reads a soft prompt in its place, and the loss is
KL(teacher || student) on the next-token distributions of the assistant positions, over turns and continuations the
teacher samples. Only the student's prompt trains, and only the student stays in the returned model."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from peft import PeftModel

from . import content as distill_content
from . import data as distill_data
from . import score as distill_score
from .options import DistillOptions, from_keywords
from .prepare import STUDENT, Given, Preparation, prepare, resolved
from .report import DistillReport
from .score import Figures, Scores
from .teacher import KEPT_ONLY, TEACHER, DistillSamples, attach_teacher
from .train import Training, start, train

__all__ = ["STUDENT", "distill_prompt"]


def distill_prompt(
    model,
    tokenizer,
    system_prompt: str,
    options: Optional[DistillOptions] = None,
    *,
    user_turns: Optional[Sequence[str]] = None,
    held_out_turns: Optional[Sequence[str]] = None,
    probes: Optional[Sequence[Union[str, distill_content.Probe]]] = None,
    samples: Optional[DistillSamples] = None,
    progress: Optional[Callable[[str], None]] = None,
    **old_keywords,
) -> PeftModel:
    """Train `options.num_virtual_tokens` soft tokens that make the frozen `model` behave as it does after
    `system_prompt`; `options` (a `DistillOptions`, default: its defaults) says how. The data: the user turns to train
    on and to hold out (default: the teacher writes them), the content probes, samples from an earlier report, and a
    `progress` callable given one line at a time.

    Returns a PeftModel holding the student alone (adapter "default"; `save_pretrained` writes a normal adapter
    folder) with `model.distill_report` (a `DistillReport`). Its inputs are formatted by `student_inputs`. The 0.3
    keywords (`old_keywords`: `steps=...`) still work, with a FutureWarning, until 0.4.0. See docs/distillation.md."""
    o = resolved(from_keywords(options, old_keywords))
    log = progress or (lambda line: None)
    given = Given(user_turns=user_turns, held_out_turns=held_out_turns, probes=probes, samples=samples)
    prep = prepare(model, tokenizer, system_prompt, o, given, log)
    o = prep.options
    began = start(prep, o)

    def evaluate() -> Figures:
        return distill_score.figures(
            prep.model, prep.samples, STUDENT, prep.pad_id, prep.prompt.stop_ids, o.batch_size
        )

    training = train(prep, o, began, evaluate, log)
    scores = _score(prep, o, tokenizer, training, evaluate, log)
    report = DistillReport(
        options=o, mode=prep.prompt.mode, prefix_tokens=len(prep.prompt.prefix_ids), init=began.init,
        teacher_gap=prep.teacher_gap, samples=prep.samples, student=scores.student, none=scores.none,
        train_seconds=training.seconds, train_cpu_seconds=training.cpu_seconds, curve=training.curve,
        content=scores.content, kept_text=scores.kept_text, kept_text_content=scores.kept_text_content,
        kept_positions=began.kept_positions, facts=began.facts,
    )  # fmt: skip
    model = prep.model
    model.delete_adapter(TEACHER)
    if scores.kept_text is not None:
        model.delete_adapter(KEPT_ONLY)
    model.softprompt_plus_metrics = report.metrics()
    model.distill_report = report
    for line in report.lines():
        log(line)
    return model


def _score(prep: Preparation, o: DistillOptions, tokenizer, training: Training, evaluate, log) -> Scores:
    """The score stage: the trained student's held-out figures (the curve's last point when it is the last step), no
    system prompt's, the kept text's alone, and each one's content on the probes."""
    model, samples, pad, stops = prep.model, prep.samples, prep.pad_id, prep.prompt.stop_ids
    curve = training.curve
    student = curve[-1].held_out if curve and curve[-1].step == o.steps else evaluate()
    none = distill_score.none_figures(model, samples, pad, stops, o.batch_size)
    kept_only = None
    if o.keep_text is not None:  # the kept text alone as the system turn: what the soft tokens add over it
        attach_teacher(model, distill_data.kept_ids(tokenizer, prep.prompt, o.keep_text, False), KEPT_ONLY)
        kept_only = distill_score.figures(model, samples, KEPT_ONLY, pad, stops, o.batch_size)
    readers = (STUDENT, KEPT_ONLY) if kept_only is not None else (STUDENT,)
    content = distill_score.content_scores(model, tokenizer, prep.prompt, samples, readers, pad, o.batch_size, log)
    return Scores(
        student=student, none=none, content=content.get(STUDENT), kept_text=kept_only,
        kept_text_content=content.get(KEPT_ONLY),
    )  # fmt: skip
