"""The adapter's README model card: what the prompt is, what it was trained on, and how to load it (starting with
the import that registers the method)."""

from __future__ import annotations

import os
from typing import Optional

from huggingface_hub import ModelCard
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..method.tasks import task_name, task_of

TAGS = ("peft", "softprompt-plus", "prompt-tuning", "soft-prompt")
HEADING = "## Soft prompt (peft-softprompt-plus)"
# Markers around our section, so a re-save replaces exactly it, whatever headings the user's text uses.
START, END = "<!-- softprompt-plus:start -->", "<!-- softprompt-plus:end -->"
IMPORT_LINE = (
    "import peft_softprompt_plus  # registers SOFTPROMPT_PLUS with PEFT; loading fails with KeyError without it"
)


def _placement_lines(config) -> list[str]:
    """The hard tokens around the soft ones, where the config has them (`prompt_prefix_ids`, `prompt_suffix_ids`)."""
    return [
        f"- hard {part} ids (frozen): {ids}" + (f" = {text!r}" if text else "")
        for part, ids, text in (
            ("prefix", config.prompt_prefix_ids, config.prompt_prefix),
            ("suffix", config.prompt_suffix_ids, config.prompt_suffix),
        )
        if ids
    ]


def usage_snippet(base_model: str, repo_or_path: str, task_type: str) -> str:
    auto = task_of(task_type).auto_class
    return (
        "```python\n"
        f"{IMPORT_LINE}\n"
        "from peft import PeftModel\n"
        f"from transformers import {auto}\n\n"
        f'base = {auto}.from_pretrained("{base_model}")\n'
        f'model = PeftModel.from_pretrained(base, "{repo_or_path}")\n'
        "```\n"
    )


def is_hub_model_id(name: Optional[str]) -> bool:
    """True for `org/name`-style ids that are not a local path: the Hub refuses anything else as `base_model`."""
    if not name or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _base_model(peft_model, card: ModelCard) -> str:
    config = peft_model.active_peft_config
    name = config.base_model_name_or_path or card.data.get("base_model")
    return name or getattr(peft_model.get_base_model(), "name_or_path", "") or "BASE_MODEL"


def _drop_local_base_model(card: ModelCard, base_model: str) -> None:
    # The Hub rejects the whole commit when `base_model` is a local path (transformers#33922); the text keeps it.
    if is_hub_model_id(base_model):
        card.data["base_model"] = base_model
        return
    card.data.pop("base_model", None)
    tags = card.data.get("tags") or []
    card.data["tags"] = [t for t in tags if not str(t).startswith("base_model:")]


def _prompt_shape(peft_model) -> list[int]:
    """From the config and the model, not the tensors: under FSDP a rank holds a flat shard of them."""
    config = peft_model.active_peft_config
    if config.prompt_level == "kv":
        base = config.kv_base or {}
        return [base.get("layers"), 2, base.get("kv_heads"), config.num_virtual_tokens, base.get("head_dim")]
    return [config.num_virtual_tokens, peft_model.get_base_model().get_input_embeddings().embedding_dim]


# What the adapter is, per `prompt_level`.
_WHAT = {
    "input": (
        "A soft prompt of {n} virtual tokens for a frozen `{base}`, at positions 0..N-1 before the text (after a "
        "hard prefix, before a hard suffix, where the config has them). Where the model's attention runs through "
        "transformers' attention registry, the prompt enters at the attention: its keys and values are computed in "
        "a pass of their own and handed to every attention layer. Otherwise (`forward_path='concat'`, or families "
        "such as Bloom and Falcon) it is concatenated in front of the text's embeddings."
    ),
    "kv": (
        "A KV prompt for a frozen `{base}`: every attention layer's keys and values for {n} positions, trained "
        "directly and read by every layer's attention in front of the text's, which starts at position "
        "{start}. It predicts no text token 0: the loss runs over labels 1..."
    ),
}


def _level_lines(config) -> list[str]:
    if config.prompt_level != "kv":
        return [f"- forward path: `{config.forward_path}`"]
    return [
        "- prompt level: `kv`",
        f"- frozen leading positions (attention sink): {config.kv_frozen_positions}",
        f"- text starts at position: {config.kv_text_start}",
    ]


def _section(peft_model, base_model: str, adapter_ref: str, for_hub: bool) -> list[str]:
    config = peft_model.active_peft_config
    task = task_name(config.task_type)
    init = f"`{config.prompt_init}`"
    if config.prompt_init_text:
        init += f" from the text {config.prompt_init_text!r}"
    local_base = not is_hub_model_id(base_model)
    base_note = " (a local path: replace it with the Hub id of the same checkpoint)" if for_hub and local_base else ""
    metrics = getattr(peft_model, "softprompt_plus_metrics", None) or {}
    metric_lines = [f"  - {k}: {v}" for k, v in sorted(metrics.items())]
    what = _WHAT[str(config.prompt_level)].format(
        n=config.num_virtual_tokens, base=base_model, start=config.kv_text_start
    )
    return [
        HEADING,
        "",
        what,
        "",
        "- method: SOFTPROMPT_PLUS ([peft-softprompt-plus](https://pypi.org/project/peft-softprompt-plus/), a PEFT "
        "method registered from outside PEFT)",
        f"- base model: `{base_model}`{base_note}",
        f"- task: `{task}`",
        f"- num_virtual_tokens (N): {config.num_virtual_tokens}",
        *_placement_lines(config),
        f"- prompt shape: {_prompt_shape(peft_model)} float32",
        f"- init: {init}",
        *_level_lines(config),
        *(["- training metrics:", *metric_lines] if metric_lines else []),
        "",
        "### How to load",
        "",
        "`pip install peft-softprompt-plus`, then:",
        "",
        usage_snippet(base_model, adapter_ref, task),
        f"Inspect the prompt (norms; an input prompt's nearest vocabulary tokens): `softprompt-plus inspect "
        f"{adapter_ref}`.",
    ]


def write_model_card(peft_model, output_dir: str, adapter_ref: Optional[str] = None, for_hub: bool = False) -> None:
    """Add our section to the card PEFT wrote in `output_dir`; `adapter_ref` is what users pass to load it.

    `for_hub` keeps the YAML metadata acceptable to the Hub (no local path as `base_model`).
    Training metrics come from the optional dict `peft_model.softprompt_plus_metrics`.
    """
    path = os.path.join(output_dir, "README.md")
    card = ModelCard.load(path)
    base_model = _base_model(peft_model, card)
    card.data["library_name"] = "peft"
    if peft_model.active_peft_config.base_model_name_or_path:
        card.data["base_model"] = base_model
    card.data["tags"] = sorted(set(card.data.get("tags") or []) | set(TAGS))
    if for_hub:
        _drop_local_base_model(card, base_model)
    section = [START, *_section(peft_model, base_model, adapter_ref or output_dir, for_hub), END]
    card.text = "\n".join(section + [""] + _without_our_section(card.text.split("\n")))
    card.save(path)


def _without_our_section(lines: list[str]) -> list[str]:
    """The card's lines minus the section we wrote last time: re-saving replaces it and keeps what the user wrote."""
    if START in lines and END in lines[lines.index(START) :]:
        start = lines.index(START)
        end = lines.index(END, start) + 1
        if end < len(lines) and lines[end] == "":
            end += 1  # the blank line written after the section
        return lines[:start] + lines[end:]
    if HEADING in lines:  # a card written before the markers: the section ran to the next top-level heading
        start = lines.index(HEADING)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("# ", "## "))), len(lines))
        return lines[:start] + lines[end:]
    return lines
