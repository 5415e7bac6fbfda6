"""The adapter's README model card: how to load it (starting with the import that registers the method)."""

from __future__ import annotations

import os
from typing import Optional

from huggingface_hub import ModelCard

TAGS = ("peft", "softprompt-plus", "prompt-tuning", "soft-prompt")


def usage_snippet(base_model: str, repo_or_path: str, task_type: str) -> str:
    auto = {"SEQ_CLS": "AutoModelForSequenceClassification"}.get(task_type, "AutoModelForCausalLM")
    return (
        "```python\n"
        "import peft_softprompt_plus  # registers SOFTPROMPT_PLUS with PEFT; loading fails with KeyError without it\n"
        "from peft import PeftModel\n"
        f"from transformers import {auto}\n\n"
        f'base = {auto}.from_pretrained("{base_model}")\n'
        f'model = PeftModel.from_pretrained(base, "{repo_or_path}")\n'
        "```\n"
    )


def write_model_card(peft_model, output_dir: str, adapter_ref: Optional[str] = None) -> None:
    """Add our section to the card PEFT wrote in `output_dir`; `adapter_ref` is what users pass to load it."""
    path = os.path.join(output_dir, "README.md")
    card = ModelCard.load(path)
    config = peft_model.active_peft_config
    base_model = config.base_model_name_or_path or card.data.get("base_model") or "BASE_MODEL"
    card.data["library_name"] = "peft"
    if config.base_model_name_or_path:
        card.data["base_model"] = config.base_model_name_or_path
    card.data["tags"] = sorted(set(card.data.get("tags") or []) | set(TAGS))
    task = str(getattr(config.task_type, "value", config.task_type or "CAUSAL_LM"))
    heading = "## Soft prompt (peft-softprompt-plus)"
    lines = card.text.split("\n")
    if heading in lines:  # re-saving: replace our section, keep everything the user wrote
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines = lines[:start] + lines[end:]
    metrics = getattr(peft_model, "softprompt_plus_metrics", None) or {}
    section = [
        heading,
        "",
        f"- method: SOFTPROMPT_PLUS (soft prompt through `inputs_embeds`, {config.num_virtual_tokens} virtual tokens)",
        f"- init: `{config.prompt_init}`",
        f"- task: `{task}`",
        f"- base model: `{base_model}`",
        *[f"- {k}: {v}" for k, v in sorted(metrics.items())],
        "",
        "### How to load",
        "",
        usage_snippet(base_model, adapter_ref or output_dir, task),
    ]
    card.text = "\n".join(section + [""] + lines)
    card.save(path)
