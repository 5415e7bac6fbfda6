"""The task suite's KV arms (bench_suite.py): this library's KV prompt from a lifted vocabulary start or from the keys
and values of a one-line task description, and PEFT 0.21's PREFIX_TUNING and CARTRIDGE started from the same
description by its own `initialize_kv_prefix_from_text` (PEFT 0.21 offers no other text start for PREFIX_TUNING).

PEFT's prefix methods are trained through their own forward. They are scored through an exact copy of their keys and
values in this library's KV adapter (PEFT's prefix `generate` is not trusted here); every run checks, on 8 held-out
items, that the copy's greedy answers equal PEFT's own uncached forwards and records it (`agrees`)."""

from __future__ import annotations

import bench_quality as q
import torch
from peft import CartridgeConfig, PrefixTuningConfig, get_peft_model
from peft.tuners.cartridge.utils import initialize_kv_prefix_from_text
from transformers import AutoModelForCausalLM

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps import capitals
from peft_softprompt_plus.distill import kv_start

# One line per task, as a user would describe it; at least N=20 tokens, so every start reads text alone.
DESCRIPTIONS = {
    "cities": "Each line gives the name of a large city, then an arrow, then the name of the country where that "
    "city lies.",
    "subdivisions": "Each line gives the name of a province, state or region, then an arrow, then the name of the "
    "country it belongs to.",
    "counties": "Each line gives the name of a county in the United States, then an arrow, then the name of the "
    "state where that county lies.",
    "emoji": "Each line gives one emoji character, then an arrow, then the English name of that emoji in lower "
    "case words.",
}
KV_LR = 3e-3  # bench/RESULTS.md: the KV arms' learning rate, swept on cities at seed 0


def variant(name: str, task: str, lr) -> tuple:
    """(q.Variant, copied): the KV arm `name` on `task` at `lr` (None: KV_LR)."""
    about, build, copied = VARIANTS[name]
    return q.Variant(about, lambda *args: build(*args, task), lr=KV_LR if lr is None else lr), copied


def _ours_kv(init: str, **options):
    def build(base, seed, tokenizer, split, task):
        text = {"prompt_init_text": DESCRIPTIONS[task], "tokenizer_name_or_path": tokenizer.name_or_path}
        config = {"num_virtual_tokens": q.N, "init_seed": seed, "prompt_level": "kv", "prompt_init": init, **options}
        config.update(text if init == "text" else {})
        return get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", **config))

    return build


def _peft_kv(make_config):
    def build(base, seed, tokenizer, split, task):
        torch.manual_seed(seed)  # PEFT draws its placeholder values from the global generator
        model = get_peft_model(base, make_config())
        # The plain tasks read no chat template; the description's keys/values are those of its plain tokens.
        initialize_kv_prefix_from_text(model, tokenizer, text=DESCRIPTIONS[task], use_chat_template=False)
        return model

    return build


def _prefix():
    return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=q.N)


def _cartridge():
    return CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=q.N, num_frozen_tokens=1)


# name -> (about, build(base, seed, tokenizer, split, task), scored through a copy); every arm trains at KV_LR
VARIANTS = {
    "ours-kv-vocab": (
        "this library, prompt_level='kv', a sampled-vocabulary start lifted, the sink frozen (kv_frozen_positions=1)",
        _ours_kv("vocab", kv_frozen_positions=1),
        False,
    ),
    "ours-kv-text": (
        "this library, prompt_level='kv', the task description's keys/values, the sink frozen (kv_frozen_positions=1)",
        _ours_kv("text", kv_frozen_positions=1),
        False,
    ),
    "ours-kv-text-nosink": (
        "this library, prompt_level='kv', the task description's keys/values, every position trained "
        "(kv_frozen_positions=0, as PEFT PREFIX_TUNING)",
        _ours_kv("text", kv_frozen_positions=0),
        False,
    ),
    "peft-prefix-text": ("PEFT PREFIX_TUNING from the task description's keys/values", _peft_kv(_prefix), True),
    "peft-cartridge-text": ("PEFT CARTRIDGE from the task description's keys/values", _peft_kv(_cartridge), True),
}


def copied_kv_scorer(path: str, n: int = q.N):
    """PEFT's `[N, layers*2*Hkv*hd]` table, copied into this library's KV adapter on a second copy of the base: on
    unpadded rows both read the N positions' keys/values and the text at positions N.. exactly."""
    evaluator = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path).eval(),
        SoftPromptPlusConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=n, prompt_level="kv", kv_frozen_positions=0,
            validate_gradients="off",
        ),
    )  # fmt: skip
    shape = evaluator.base_model.prompt_bank.values("default").shape  # [layers, 2, Hkv, N, hd]
    layers, _, heads, n, hd = shape

    def exact(model):
        table = model.get_prompt_embedding_to_save("default")  # [N, layers*2*Hkv*hd]
        values = table.view(n, layers, 2, heads, hd).permute(1, 2, 3, 0, 4)  # [layers, 2, Hkv, N, hd]
        kv_start.install(evaluator, "default", values.float())
        return evaluator

    return exact


def agrees(model, exact, tokenizer, split, form, rows: int = 8) -> bool:
    """PEFT's own uncached greedy answers on `rows` held-out items equal its copy's."""
    keys = [k for k, _ in split.held_out[:rows]]
    # One row at a time: PEFT's prefix forward gives a left-padded row shifted positions.
    own = capitals.greedy_answers(model, tokenizer, keys, cached=False, batch_size=1, form=form)
    return own == capitals.greedy_answers(exact(model), tokenizer, keys, form=form)
