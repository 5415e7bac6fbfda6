"""`DistillOptions`: how `distill_prompt` trains a student, in one documented object. The standard library only, so
`softprompt-plus distill` builds it (one flag per field) before any heavy import.

The 0.3 keywords (`distill_prompt(..., steps=200, lr=3e-2)`) still work, as these fields, with a FutureWarning at the
caller's line until 0.4.0 (`from_keywords`)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from .._moved import REMOVED_IN, user_stacklevel


def _option(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class DistillOptions:
    """Every choice `distill_prompt` makes, with the measured defaults. `None` means the student form's own default
    (`refusals.LEVEL_DEFAULTS`). See docs/distillation.md."""

    # The student.
    num_virtual_tokens: Optional[int] = _option(
        None,
        "Soft tokens N (a KV student: N keys/values per layer). None: 16 for an input student; for a KV one 32 "
        "selected positions, plus the kept ones with keep_text, at most the system turn's length.",
    )
    prompt_level: str = _option("input", "'input' (N input vectors) or 'kv' (N keys/values per layer).")
    prompt_init: Optional[str] = _option(
        None, "The start: 'text', 'vocab', 'random', or for a KV student 'selected' (default: the form's own)."
    )
    kv_frozen_positions: Optional[int] = _option(
        None, "A KV student's frozen leading positions, the attention sink (None: 1, the KV recipe's)."
    )
    in_system_turn: bool = _option(False, "Place the soft tokens inside the template's system turn.")
    keep_text: Optional[Union[str, Sequence[str]]] = _option(
        None,
        "A passage of the system prompt (or a list of them) kept as hard text after the soft tokens; a KV student "
        "keeps its positions as the teacher's own keys/values, counted in N and never trained.",
    )
    chat: bool = _option(True, "Through the model's chat template (False: a plain text prefix).")
    # What the teacher writes.
    sampled_turns: int = _option(64, "User turns the teacher writes when none are given.")
    self_study: Optional[bool] = _option(
        None, "The teacher writes its turns from five kinds of seed instruction (default: on for a KV student)."
    )
    turns_per_part: int = _option(0, "Training questions about each part of the system prompt.")
    greedy_part_replies: bool = _option(
        False, "Also train on the teacher's greedy reply to each question about a part."
    )
    quote_parts: int = _option(0, "Rows per part whose reply is the part's own text, 0 to 3.")
    samples_per_turn: int = _option(4, "Teacher continuations per training turn.")
    held_out_samples_per_turn: int = _option(2, "Teacher continuations per held-out turn.")
    max_new_tokens: int = _option(24, "Length of the teacher's continuations.")
    held_out_fraction: float = _option(0.2, "Share of the user turns held out when no held-out turns are given.")
    # Training.
    steps: int = _option(200, "Optimizer steps.")
    batch_size: int = _option(8, "Rows per step.")
    lr: Optional[float] = _option(None, "AdamW learning rate (default: the form's own).")
    answer_weight: float = _option(0.0, "Weight tokens by how much the system prompt changes them, 0 to 1.")
    kl_top_k: int = _option(0, "Train on the teacher's k likeliest tokens, renormalised (0: its full distribution).")
    prompt_text_weight: float = _option(
        0.0,
        "Add this weight times a next-token loss on the system turn's own text, read after the soft prompt (0: off).",
    )
    seed: int = _option(0, "Random seed: the samples, the split and the batches.")
    evaluate_at: Sequence[int] = _option((), "Steps (0: before training) whose held-out figures go in the curve.")


FIELDS = tuple(f.name for f in dataclasses.fields(DistillOptions))


def help_of(name: str) -> str:
    """A field's help text, without its final full stop (the CLI adds its default)."""
    return next(f.metadata["help"] for f in dataclasses.fields(DistillOptions) if f.name == name).rstrip(".")


def from_keywords(options: Optional[DistillOptions], keywords: dict) -> DistillOptions:
    """`options`, or the 0.3 keywords as options with a FutureWarning at the caller of `distill_prompt`; an unknown
    keyword is a TypeError naming it, and options with keywords beside them a ValueError."""
    unknown = sorted(set(keywords) - set(FIELDS))
    if unknown:
        raise TypeError(
            f"distill_prompt() got unexpected keyword argument(s) {unknown}. Its options are the fields of "
            f"DistillOptions: {list(FIELDS)}."
        )
    if options is not None and not isinstance(options, DistillOptions):
        raise ValueError(
            f"distill_prompt: `options` must be a DistillOptions, got {type(options).__name__}. Build one with "
            "DistillOptions(num_virtual_tokens=..., steps=...)."
        )
    if not keywords:
        return options if options is not None else DistillOptions()
    if options is not None:
        raise ValueError(
            f"distill_prompt: pass the options in `options` or as keywords, not both (got both, keywords "
            f"{sorted(keywords)}). Move them into DistillOptions."
        )
    named = ", ".join(f"{k}={v!r}" for k, v in keywords.items())
    warnings.warn(
        f"distill_prompt(..., {named}) is deprecated and stops working in {REMOVED_IN}; pass "
        f"distill_prompt(..., DistillOptions({named})).",
        FutureWarning,
        stacklevel=user_stacklevel(),
    )
    return DistillOptions(**keywords)


# `softprompt-plus distill`'s flags that are not a field of the same name, and the field each one sets.
CLI_ALIASES = {"plain": "chat", "keep_file": "keep_text"}


def from_cli(args) -> DistillOptions:
    """The DistillOptions that `softprompt-plus distill`'s flags name, one flag per field (`--plain` sets
    `chat=False`; `--keep-file` is read into `args.keep_text` first)."""
    given = {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}
    given.update(chat=not args.plain, keep_text=args.keep_text)
    return DistillOptions(**given)
