"""`GradientFlowCallback`: after the first real optimizer step of a `transformers.Trainer` run, confirm that the soft
prompt received a gradient and moved; otherwise report the cause with the codes of `check_gradient_flow`."""

from __future__ import annotations

from typing import Optional

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from . import flow as gradient_flow
from .findings import GradientFlowReport

_ON_FAILURE = ("raise", "warn")


class GradientFlowCallback(TrainerCallback):
    """Checks the first optimizer step of training: the prompt got a finite, non-zero gradient and changed.

    `on_failure="raise"` stops training with a `GradientFlowError`; `"warn"` emits a `GradientFlowWarning` and goes
    on. Either way `callback.report` holds the `GradientFlowReport`. Steps skipped by fp16 loss scaling are not
    judged; the next one is.
    """

    def __init__(self, on_failure: str = "raise"):
        if on_failure not in _ON_FAILURE:
            raise ValueError(f"`on_failure` must be one of {list(_ON_FAILURE)}, got {on_failure!r}.")
        self.on_failure = on_failure
        self.report: Optional[GradientFlowReport] = None
        self._before: Optional[dict] = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        # Fails here, before any compute, for a model without a soft prompt to watch.
        gradient_flow.prompts_of(kwargs["model"])

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.report is None:
            self._before = gradient_flow.step_snapshot(kwargs["model"])

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        optimizer = kwargs.get("optimizer")
        if self.report is not None or self._before is None or getattr(optimizer, "step_was_skipped", False):
            return
        self.report = gradient_flow.diagnose_step(kwargs["model"], optimizer, self._before)
        self._before = None
        gradient_flow.handle_failure(self.report, self.on_failure)
