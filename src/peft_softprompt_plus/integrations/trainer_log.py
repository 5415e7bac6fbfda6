"""`LeaveOneOutLogCallback`: leave-one-out's reach in the Trainer's own log. Each logged step gains
`leave_one_out_matched` and `leave_one_out_unmatched`, the training rows so far whose adapter does leave-one-out and
that were, or were not, one of its demonstrations (`forward_state.leave_one_out`), so a run where no row matched is
seen in the log it already reads, beside the one warning."""

from __future__ import annotations

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .._names import BANK


class LeaveOneOutLogCallback(TrainerCallback):
    """Adds the leave-one-out counts of the model's soft-prompt tuner to each Trainer log entry."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        tuner = next((m for m in kwargs["model"].modules() if hasattr(m, BANK) and hasattr(m, "forward_state")), None)
        if tuner is None or logs is None:
            return
        counts = tuner.forward_state.leave_one_out
        entry = {"leave_one_out_matched": counts["matched"], "leave_one_out_unmatched": counts["unmatched"]}
        logs.update(entry)  # what the progress bar and the reporters print after this callback
        if state.log_history:  # the record the Trainer keeps (a copy of `logs` made before the callbacks ran)
            state.log_history[-1].update(entry)
