"""Prompt distillation: a long system prompt compressed into a few soft tokens (`distill_prompt`). The inputs the
student reads (data), the teacher's samples (teacher), the held-out figures (score), the loop (run)."""

import importlib

# What 0.2.0's module `peft_softprompt_plus.distill` held, now in their homes (kept until 0.4.0).
_OLD = {"distill_prompt": "peft_softprompt_plus.distill.run", "main": "peft_softprompt_plus.apps.distill_job"}


def __getattr__(name: str):
    if name not in _OLD:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .._moved import warn_moved

    warn_moved(f"{__name__}.{name}", f"{_OLD[name]}.{name}")
    value = getattr(importlib.import_module(_OLD[name]), name)
    globals()[name] = value  # warned once, like any moved path
    return value
