"""Errors every layer may raise: this module imports nothing of the package."""


class NotSoftPromptPlusModel(TypeError, ValueError):
    """`model` is not a PeftModel holding SOFTPROMPT_PLUS adapters. A TypeError (the wrong kind of object), and a
    ValueError too, as `push_to_hub` raised before 0.3: code that caught either keeps working."""


def not_ours(model) -> NotSoftPromptPlusModel:
    """The one error every public entry point raises for a `model` that isn't ours."""
    kind = getattr(model, "peft_type", None)
    held = f" holding {getattr(kind, 'value', kind)} adapters" if kind is not None else ""
    return NotSoftPromptPlusModel(
        f"`model` must be a PeftModel with a SOFTPROMPT_PLUS adapter, got {type(model).__name__}{held}. Pass the "
        "model `get_peft_model(base, SoftPromptPlusConfig(...))` or `PeftModel.from_pretrained` returned."
    )
