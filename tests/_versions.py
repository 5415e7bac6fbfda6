"""What differs between the transformers releases the suite runs on (docs/integrations.md, "Compatibility").

- The KV cache: 5.24 and later name the forward keyword and the output field `cache`; 5.22 and older only
  `past_key_values`.
- Checkpointing: 5.24 renamed gradient checkpointing to activation checkpointing (`activation_checkpointing_enable`,
  `is_activation_checkpointing`, `TrainingArguments(activation_checkpointing=...)`); the old names still work there
  with a FutureWarning (removal in v6) and are the only ones before. The library itself reads neither: it looks at
  the flag each checkpointed layer carries, which both names set.
"""

from __future__ import annotations

import dataclasses
import inspect

from transformers import GPT2LMHeadModel, PreTrainedModel, TrainingArguments

HAS_NEW_NAMES = hasattr(PreTrainedModel, "activation_checkpointing_enable")
CACHE = "cache" if "cache" in inspect.signature(GPT2LMHeadModel.forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a forward or `generate` returned, whatever the field is called."""
    return getattr(output, CACHE)


def checkpointing_on(model, reentrant: bool) -> None:
    """Turn checkpointing on with the current name (the old one before transformers 5.24)."""
    if HAS_NEW_NAMES:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def is_checkpointing(model) -> bool:
    return model.is_activation_checkpointing if HAS_NEW_NAMES else model.is_gradient_checkpointing


def checkpointing_arg(on: bool) -> dict:
    """The `TrainingArguments` keyword for it: `activation_checkpointing` where it exists."""
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}
