"""The one module that touches PEFT internals: the `PeftType` member, method registration, and the two
`PeftModel` hooks (model card, crash-safe save, Hub push) that PEFT offers no public extension point for."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

from peft import PeftModel
from peft.utils import register_peft_method
from peft.utils.peft_types import PeftType

NAME = "SOFTPROMPT_PLUS"
PREFIX = "softprompt_plus_"

# staging dir -> the directory the user asked for, so the model card names the real location.
_STAGED_FOR: dict[str, str] = {}


def _extend_str_enum(enum_cls, name: str, value: str):
    """Add a member to a `(str, Enum)` class in place; returns the existing member when already present."""
    if name in enum_cls._member_map_:
        return enum_cls._member_map_[name]
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    # `EnumType.__setattr__` refuses names already in the member map, so bind the class attribute first.
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


SOFTPROMPT_PLUS = _extend_str_enum(PeftType, NAME, NAME)


def register(config_cls, model_cls) -> None:
    """Register config + tuner with PEFT; importing the package twice (or reloading it) is harmless."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    if SOFTPROMPT_PLUS in PEFT_TYPE_TO_CONFIG_MAPPING:
        # A reload creates new classes: point PEFT at them rather than keeping stale ones.
        PEFT_TYPE_TO_CONFIG_MAPPING[SOFTPROMPT_PLUS] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[SOFTPROMPT_PLUS] = model_cls
    else:
        register_peft_method(name=NAME.lower(), config_cls=config_cls, model_cls=model_cls, prefix=PREFIX)
    PEFT_TYPE_TO_PREFIX_MAPPING[SOFTPROMPT_PLUS] = PREFIX
    _install_peft_model_hooks()


def _is_ours(peft_model) -> bool:
    return getattr(peft_model, "peft_type", None) == SOFTPROMPT_PLUS


def _install_peft_model_hooks() -> None:
    if getattr(PeftModel, "_softprompt_plus_hooked", False):
        return
    original_card = PeftModel.create_or_update_model_card
    original_save = PeftModel.save_pretrained
    original_push = PeftModel.push_to_hub

    @functools.wraps(original_card)
    def create_or_update_model_card(self, output_dir: str):
        original_card(self, output_dir)
        if _is_ours(self):
            from .model_card import write_model_card

            write_model_card(self, output_dir, adapter_ref=_STAGED_FOR.get(os.path.abspath(output_dir), output_dir))

    @functools.wraps(original_save)
    def save_pretrained(self, save_directory: str, *args, is_main_process: bool = True, **kwargs):
        if not _is_ours(self) or not is_main_process:
            return original_save(self, save_directory, *args, is_main_process=is_main_process, **kwargs)
        return _atomic_save(functools.partial(original_save, self, *args, **kwargs), save_directory)

    @functools.wraps(original_push)
    def push_to_hub(self, repo_id: str, *args, **kwargs):
        if not _is_ours(self):
            return original_push(self, repo_id, *args, **kwargs)
        from .hub import push_to_hub as push  # transformers' generic push would replace our model card

        return push(self, repo_id, *args, **kwargs)

    PeftModel.create_or_update_model_card = create_or_update_model_card
    PeftModel.save_pretrained = save_pretrained
    PeftModel.push_to_hub = push_to_hub
    PeftModel._softprompt_plus_hooked = True


def _atomic_save(save_into, save_directory: str):
    """Write the adapter into a sibling temp dir, then move each file into place with `os.replace`.

    A failure while writing (disk full, interrupt, bad tensor) leaves the adapter already on disk untouched.
    """
    if os.path.isfile(save_directory):
        raise ValueError(f"`save_directory` must be a directory, got the file {save_directory!r}. Pass a folder path.")
    target = os.path.abspath(save_directory)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".softprompt-plus-save-", dir=parent)
    _STAGED_FOR[staging] = target
    try:
        # `save_pretrained` merges into an existing README; seed it so the user's card text survives.
        readme = os.path.join(target, "README.md")
        if os.path.isfile(readme):
            shutil.copy2(readme, os.path.join(staging, "README.md"))
        result = save_into(staging)
        _move_tree(staging, target)
        return result
    finally:
        _STAGED_FOR.pop(staging, None)
        shutil.rmtree(staging, ignore_errors=True)


def _move_tree(src: str, dst: str) -> None:
    # Weights before config: a reader that sees the new config must find weights that fit it.
    order = {"adapter_model.safetensors": 0, "adapter_model.bin": 0, "adapter_config.json": 1}
    for root, _dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        out = os.path.normpath(os.path.join(dst, rel))
        os.makedirs(out, exist_ok=True)
        for name in sorted(files, key=lambda f: order.get(f, 2)):
            os.replace(os.path.join(root, name), os.path.join(out, name))
