"""bench_distill_content.py's arms and their files: each arm's options (`ARMS`), where a seed's teacher samples and
an arm's adapter are kept (bench/out/), and the prompt folders under bench/distill_content/."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import NamedTuple

DATA = Path(__file__).resolve().parent / "distill_content"
OUT = Path(__file__).resolve().parent / "out"


class Arm(NamedTuple):
    """One arm's options; arms with the same turns_per_part and greedy_part_replies share the teacher's samples."""

    turns_per_part: int
    answer_weight: float
    num_virtual_tokens: float  # an int N, or a share of the system turn's positions below 1 (0.25: a quarter)
    in_system_turn: bool = False
    greedy_part_replies: bool = False
    quote_parts: int = 0
    keep_facts: bool = False  # keep the prompt's facts as hard text (`keep_text`: the prompt folder's kept.txt)
    prompt_level: str = "input"  # "kv": a KV student
    prompt_init: str = "text"  # a KV student's start: "text" (the first N tokens' keys/values) or "selected"


_KV = (False, False, 0, False, "kv")  # a KV student: no system-turn placement, no kept text
ARMS = {
    "generic turns (0.3 defaults)": (0, 0.0, 16, False, False),
    "+ 3 turns per part": (3, 0.0, 16, False, False),
    "+ 3 turns per part, answer weight 0.5": (3, 0.5, 16, False, False),
    "+ 3 turns per part, answer weight 0.5, N=32": (3, 0.5, 32, False, False),
    "+ 3 turns per part, answer weight 0.5, N=64": (3, 0.5, 64, False, False),
    "+ 3 turns per part, answer weight 1.0, N=64": (3, 1.0, 64, False, False),
    "+ in the system turn": (3, 0.5, 16, True, False),
    "+ in the system turn, N=32": (3, 0.5, 32, True, False),
    "+ in the system turn, N=64": (3, 0.5, 64, True, False),
    "+ greedy part replies, answer weight 0.5, N=64": (3, 0.5, 64, False, True),
    "+ greedy part replies, N=64": (3, 0.0, 64, False, True),
    "+ greedy and quoted part replies, answer weight 0.5, N=64": (3, 0.5, 64, False, True, 3),
    "+ 3 turns per part, answer weight 0.5, N=16, facts kept as hard text": (3, 0.5, 16, False, False, 0, True),
    "+ in the system turn, N=16, facts kept as hard text": (3, 0.5, 16, True, False, 0, True),
    "+ 3 turns per part, answer weight 0.5, N=64, facts kept as hard text": (3, 0.5, 64, False, False, 0, True),
    "KV, selected start, 3 turns per part, answer weight 0.5, N=32": (3, 0.5, 32, *_KV, "selected"),
    "KV, text start, 3 turns per part, answer weight 0.5, N=32": (3, 0.5, 32, *_KV, "text"),
}
ARMS["+ 3 turns per part, answer weight 0.5, N=32, facts kept as hard text"] = (3, 0.5, 32, False, False, 0, True)
ARMS["PEFT CARTRIDGE, text start, 3 turns per part, answer weight 0.5, N=32"] = (3, 0.5, 32, *_KV, "text")
for _n in (8, 16, 64, 128):  # the N curve of the KV student
    ARMS[f"KV, selected start, 3 turns per part, answer weight 0.5, N={_n}"] = (3, 0.5, _n, *_KV, "selected")
# A KV student keeping the facts (kept.txt) as the teacher's own keys/values: N counts them, "kept+n" selects n more.
_KEPT_KV = (False, False, 0, True, "kv", "selected")
for _n in (0, 16, 32):
    ARMS[f"KV, facts kept as keys/values, 3 turns per part, answer weight 0.5, N=kept+{_n}"] = (3, 0.5, _n, *_KEPT_KV)
ARMS["KV, facts kept as keys/values, no part turns, N=kept+32"] = (0, 0.0, 32, *_KEPT_KV)
ARMS["KV, facts kept as keys/values, greedy and quoted part replies, answer weight 0.5, N=kept+32"] = (
    3, 0.5, 32, False, True, 3, True, "kv", "selected"
)  # fmt: skip
# The compressing students (issue 63): N as a share of the system turn's positions, the turn's length read per prompt.
for _share, _name in ((1 / 16, "1/16"), (1 / 8, "1/8"), (1 / 4, "1/4"), (1 / 2, "1/2")):
    ARMS[f"KV, selected start, 3 turns per part, answer weight 0.5, N={_name} of the turn"] = (
        3, 0.5, _share, *_KV, "selected"
    )  # fmt: skip
ARMS["PEFT CARTRIDGE, text start, 3 turns per part, answer weight 0.5, N=1/4 of the turn"] = (
    3, 0.5, 1 / 4, *_KV, "text"
)  # fmt: skip
DEFAULT_ARMS = list(ARMS)[:3]


def num_virtual_tokens(arm: Arm, tokenizer, system_prompt: str, keep_text) -> int:
    """The arm's N: a share of the system turn's positions rounded (an N below 1), or a KV student keeping the facts
    counts their positions (and the template's) plus its own N."""
    from peft_softprompt_plus.distill.data import kept_positions, prepare

    if arm.num_virtual_tokens < 1:
        return max(1, round(arm.num_virtual_tokens * len(prepare(tokenizer, system_prompt, True, 1).prefix_ids)))
    if not (arm.keep_facts and arm.prompt_level == "kv"):
        return arm.num_virtual_tokens

    facts, frame = kept_positions(tokenizer, prepare(tokenizer, system_prompt, True, 1), keep_text)
    return len(set(facts) | set(frame) | {0}) + arm.num_virtual_tokens


def tag(data: Path) -> str:
    """ "" for the bike-shop prompt (the earlier files' names kept), else "-<folder>"."""
    return "" if data == DATA else f"-{data.name}"


def keep_text(data: Path, keep: bool):
    """A "facts kept" arm's passages: the prompt folder's kept.txt, one per paragraph (its paragraphs of facts)."""
    return [p.strip() for p in (data / "kept.txt").read_text().strip().split("\n\n")] if keep else None


def samples(data: Path, seed: int, per_part: int, length: int, greedy: bool, quotes: int, fresh: bool, study=False):
    """The teacher's samples kept from an earlier process for this seed, turns per part, continuation length, greedy
    part replies and quoting questions, or None."""
    tail = (
        ("" if length == 24 else f"-len{length}")
        + ("-greedy" if greedy else "")
        + (f"-quote{quotes}" if quotes else "")
        + ("-selfstudy" if study else "")
    )  # the earlier files' names kept
    path = OUT / f"distill_content_samples{tag(data)}-seed{seed}-parts{per_part}{tail}.pkl"
    return path, (None if fresh or not path.exists() else pickle.loads(path.read_bytes()))


def knobs(args) -> str:
    """The recipe flags that change an arm's adapter, for its folder's name ("" at their defaults)."""
    return "".join(
        tag for tag, on in ((f" lr {args.lr}", args.lr is not None), (" self-study", args.self_study),
                            (f" top {args.kl_top_k}", args.kl_top_k), (f" sink {args.kv_frozen_positions}",
                                                                        args.kv_frozen_positions is not None),
                            (f" text {args.prompt_text_weight}", getattr(args, "prompt_text_weight", 0))) if on
    )  # fmt: skip


def adapter_dir(data: Path, name: str, seed: int) -> Path:
    return OUT / ("adapter" + tag(data) + "-" + re.sub(r"\W+", "-", name).strip("-") + f"-seed{seed}")
