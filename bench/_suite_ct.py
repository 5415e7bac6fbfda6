"""The task suite's context-tuning arms (bench_suite.py): a KV prompt started from k demonstrations' keys/values
(`prompt_init="demonstrations"`), trained with leave-one-out and position dropout, in two regimes; the ablations;
PEFT PREFIX_TUNING from the same demonstrations' text through its own `initialize_kv_prefix_from_text`; and hard
k-shot with the same demonstrations.

- few-shot: the training rows are the k demonstrations (Context Tuning's setting, where leave-one-out matters);
- many-shot: the demonstrations are among the task's training rows.

An arm is `ct-k{k}[-n{N}][-many][-noloo][-drop{p}]` (ours; N: the most attended positions kept, all by default),
`peft-prefix-demos-k{k}[-n{N}][-many]` or `peft-cartridge-demos-k{k}[-n{N}][-many]` (PEFT's first N positions), or
`hard-demos-k{k}`. `-perhead`: ours with `kv_selection="per_head"`. The
demonstrations are `pick_demonstrations(split.train, k, seed)`, each written as a training row reads
(`"Paris -> France\\n"`), with no separator, so a training row's ids are a demonstration's (recorded: `matched`)."""

from __future__ import annotations

import dataclasses
import re

import torch
from _suite_kv import DESCRIPTIONS
from peft import CartridgeConfig, PrefixTuningConfig, get_peft_model
from peft.tuners.cartridge.utils import initialize_kv_prefix_from_text

from peft_softprompt_plus import SoftPromptPlusConfig, pick_demonstrations
from peft_softprompt_plus.apps import capitals

CT_LR = 1e-3  # Context Tuning's (its train.py); not swept here
CHECKED = 40  # held-out items on which hard k-shot is also read as text, to check the start against it
_ARM = re.compile(
    r"^(ct|peft-prefix-demos|peft-cartridge-demos|hard-demos)-k(\d+)((?:-n\d+|-many|-noloo|-perhead|-desc|-drop[0-9.]+)*)$"
)


@dataclasses.dataclass(frozen=True)
class Arm:
    kind: str  # "ct", "peft-prefix-demos", "peft-cartridge-demos" or "hard-demos"
    k: int
    n: int | None = None  # kept positions (None: all)
    many: bool = False
    leave_one_out: bool = True
    dropout: float = 0.0
    per_head: bool = False  # N selected per layer and KV head (`kv_selection="per_head"`), not whole positions
    described: bool = False  # the task's one-line description (the KV arms' start) before the demonstrations


def parse(name: str) -> Arm | None:
    match = _ARM.match(name)
    if match is None:
        return None
    kind, k, options = match.group(1), int(match.group(2)), match.group(3)
    n = re.search(r"-n(\d+)", options)
    drop = re.search(r"-drop([0-9.]+)", options)
    return Arm(
        kind, k, int(n.group(1)) if n else None, "-many" in options, "-noloo" not in options,
        float(drop.group(1)) if drop else 0.0, "-perhead" in options, "-desc" in options,
    )  # fmt: skip


def demonstrations(
    split, arm: Arm, seed: int, form: capitals.Form, task: str
) -> tuple[list[tuple[str, str]], list[str]]:
    """The k training pairs, and each written as the model reads a training row (after the task's description, its
    own line that no training row matches, with `-desc`)."""
    pairs = [split.train[i] for i in pick_demonstrations(split.train, arm.k, seed)]
    described = [DESCRIPTIONS[task] + "\n"] if arm.described else []
    return pairs, described + [form.question(key) + form.answer(value) for key, value in pairs]


def train_split(split, arm: Arm, pairs):
    """What the arm trains on: the k demonstrations (few-shot), or every training row (many-shot)."""
    return split if arm.many else dataclasses.replace(split, train=list(pairs))


def build(arm: Arm, texts: list[str]):
    def make(base, seed, tokenizer, split):
        if arm.kind in PEFT_CONFIGS:
            return _peft(arm, texts, base, seed, tokenizer)
        config = SoftPromptPlusConfig(
            task_type="CAUSAL_LM", prompt_level="kv", prompt_init="demonstrations", prompt_init_texts=texts,
            demonstration_separator="", tokenizer_name_or_path=tokenizer.name_or_path,
            num_virtual_tokens=arm.n, kv_leave_one_out=arm.leave_one_out, kv_position_dropout=arm.dropout,
            kv_selection="per_head" if arm.per_head else "shared",
        )  # fmt: skip
        return get_peft_model(base, config)

    return make


PEFT_CONFIGS = {  # PEFT's KV methods, each started from the demonstrations' text at N (its first N positions)
    "peft-prefix-demos": lambda n: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n),
    "peft-cartridge-demos": lambda n: CartridgeConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=n, num_frozen_tokens=1
    ),
}


def _peft(arm: Arm, texts, base, seed, tokenizer):
    context = "".join(texts)
    length = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    torch.manual_seed(seed)  # PEFT draws its placeholder values from the global generator
    model = get_peft_model(base, PEFT_CONFIGS[arm.kind](arm.n or length))
    initialize_kv_prefix_from_text(model, tokenizer, text=context, use_chat_template=False)
    return model


def matched(model, tokenizer, split, form) -> float | None:
    """The share of training rows that a demonstration's ids match (leave-one-out's reach; None: not ours)."""
    config = getattr(model, "peft_config", {}).get("default")
    ids = getattr(config, "demonstration_ids", None)
    if not ids:
        return None
    own = {tuple(i) for i in ids}
    rows = [capitals.encode(tokenizer, key, value, form=form)[0] for key, value in split.train]
    return sum(tuple(r) in own for r in rows) / len(ids)


def hard_shots(base, tokenizer, split, arm: Arm, pairs, texts, form) -> dict:
    """Hard k-shot on every held-out item, read through the untrained demonstrations start: the same keys/values as
    the text (`tests/method/test_demonstrations.py`), computed once instead of once per item, which made the text
    arm 5x the cost of a trained one. The text itself is read on the first CHECKED items (`text_agrees`)."""
    prefix = capitals.few_shot_prefix(pairs, form)
    text = capitals.matches(base, tokenizer, split.held_out[:CHECKED], prefix, form=form)
    model = build(dataclasses.replace(arm, kind="ct"), texts)(base, 0, tokenizer, split)
    items = capitals.matches(model.eval(), tokenizer, split.held_out, form=form)
    return dict(steps=[0], cpu=[0.0], items=[items], validation=[None], text_agrees=items[:CHECKED] == text)
