"""The one module that touches PEFT internals: the `PeftType` member, the method's registration, and `PATCHES`, the
table of PEFT functions this package replaces (each one runs PEFT's own code for every other adapter type)."""

from __future__ import annotations

import inspect
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import peft
import peft.mapping_func
from peft import PeftModel
from peft.tuners.lora import variants as lora_variants
from peft.utils import register_peft_method
from peft.utils.peft_types import PeftType
from torch import nn

from .._names import METHOD, PREFIX
from ..files import hub, loading, model_card, reading, saving
from ..forward import attention, routing

PEFT_CHECKED = "0.21.2"  # the PEFT release every patch below was written and tested against


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


SOFTPROMPT_PLUS = _extend_str_enum(PeftType, METHOD, METHOD)


def _is_ours(peft_model) -> bool:
    return getattr(peft_model, "peft_type", None) == METHOD


def _original(owner, name: str) -> Callable:
    value = inspect.getattr_static(owner, name)  # as defined (or inherited), not bound
    value = getattr(value, "__func__", value)  # a classmethod's function
    return getattr(value, "_softprompt_plus_original", value)


# ---------------------------------------------------------------------------------------------- the replacements


# PeftModel.__init__ reads `model.is_gradient_checkpointing` (peft_model.py:184 in 0.21.2), an alias transformers 5
# deprecated with a FutureWarning, so every attach and load warned about a line of PEFT's. Hidden here, where PEFT
# raises it (every constructor path and import order meets it: `get_peft_model`, `from_pretrained`, AutoPeftModel*),
# for our adapters and that message only. catch_warnings swaps the process-wide filters while PEFT's __init__ runs
# and puts back the list it saved, so two threads interleaving it could leave one's filter in place for good: our
# swaps take a lock (the serve front loads adapters from worker threads). Python < 3.14 has no per-thread filters, so
# a thread outside this library running its own catch_warnings at the same moment is not covered.
_PEFT_OWN_WARNING = r"`is_gradient_checkpointing` is deprecated"
_FILTERS = threading.RLock()


def softprompt_plus_peft_model_init(self, model, peft_config, *args, **kwargs):
    """PEFT's own, without its deprecation warning for our adapters."""
    init = _original(PeftModel, "__init__")
    if getattr(peft_config, "peft_type", None) != METHOD:
        return init(self, model, peft_config, *args, **kwargs)
    with _FILTERS, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PEFT_OWN_WARNING, category=FutureWarning)
        return init(self, model, peft_config, *args, **kwargs)


def softprompt_plus_save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
    """Ours: written to a staging folder and swapped in atomically, with our model card (saving.py)."""
    save = _original(PeftModel, "save_pretrained")
    if not _is_ours(self):
        return save(self, save_directory, *args, is_main_process=is_main_process, **kwargs)
    saving.check_directory(save_directory)
    if not is_main_process:  # other ranks write nothing, but must join the state-dict collectives
        return save(self, save_directory, *args, is_main_process=False, **kwargs)

    def write_into(staging: str):
        result = save(self, staging, *args, is_main_process=True, **kwargs)
        saving.write_beside(self, staging, kwargs.get("state_dict"))  # a residual encoder, to resume training
        model_card.write_model_card(self, staging, adapter_ref=os.fspath(save_directory))
        return result

    return saving.atomic_save(write_into, save_directory)


def softprompt_plus_push_to_hub(self, repo_id: str, *args, **kwargs):
    """Ours: transformers' generic push would replace our model card (hub.py)."""
    if not _is_ours(self):
        return _original(PeftModel, "push_to_hub")(self, repo_id, *args, **kwargs)
    return hub.push_to_hub(self, repo_id, *args, **kwargs)


def softprompt_plus_create_or_update_model_card(self, output_dir: str):
    """Ours: PEFT's card plus our section (the Trainer writes cards through this too)."""
    _original(PeftModel, "create_or_update_model_card")(self, output_dir)
    if _is_ours(self):
        model_card.write_model_card(self, output_dir, adapter_ref=output_dir)


def softprompt_plus_from_pretrained(cls, model, model_id, *args, **kwargs):
    """A local adapter folder is checked before PEFT touches `model`; the adapter's starting values are not computed
    (the load overwrites them); a failed load hands `model` back as it came."""
    folder = os.path.join(os.fspath(model_id), kwargs.get("subfolder") or "") if _is_path(model_id) else None
    if folder is not None and os.path.isdir(folder) and kwargs.get("config") is None:
        reading.check_folder(folder, model)
    before = loading.BaseState.capture(model) if isinstance(model, nn.Module) else None
    try:
        with loading.loading():
            return _original(PeftModel, "from_pretrained")(cls, model, model_id, *args, **kwargs)
    except Exception:
        if before is not None and attention.is_installed(getattr(model, "config", None)):
            before.restore(model)
        raise


def softprompt_plus_load_adapter(self, model_id, adapter_name: str, *args, **kwargs):
    """A local adapter folder is checked before PEFT adds anything to the model; a trainable load of a residual
    adapter reads the encoder saved beside it."""
    load = _original(PeftModel, "load_adapter")
    if not _is_ours(self):
        return load(self, model_id, adapter_name, *args, **kwargs)
    folder = os.path.join(os.fspath(model_id), kwargs.get("subfolder") or "") if _is_path(model_id) else None
    if folder is not None and os.path.isdir(folder):
        reading.check_folder(folder, self.get_base_model())
    with loading.loading_from(self.base_model, model_id, kwargs), loading.loading():
        return load(self, model_id, adapter_name, *args, **kwargs)


def softprompt_plus_set_adapter(self, adapter_name, *args, **kwargs):
    """Ours: one existing name (PEFT's own message hides the adapter list), or a list of KV adapters read composed
    (PEFT's own would fail on a list: unhashable). PEFT's `active_adapter` names the first, so `active_peft_config`
    still answers; the tuner holds the list."""
    if _is_ours(self) and isinstance(adapter_name, (list, tuple)) and len(adapter_name) > 1:
        kv = [name for name, config in self.peft_config.items() if config.prompt_level == "kv"]
        routing.composition(list(adapter_name), list(self.peft_config), kv, "`set_adapter`")
        self.base_model.set_adapter(list(adapter_name), *args, **kwargs)
        self.active_adapter = adapter_name[0]
        return None
    if _is_ours(self):
        if isinstance(adapter_name, (list, tuple)) and len(adapter_name) == 1:
            adapter_name = adapter_name[0]
        routing.check_adapter_name(adapter_name, list(self.peft_config), "set_adapter")
    return _original(PeftModel, "set_adapter")(self, adapter_name, *args, **kwargs)


def softprompt_plus_delete_adapter(self, adapter_name):
    """Ours: one existing name, PEFT's message with the adapter list (the last one may go, as in PEFT)."""
    if _is_ours(self):
        routing.check_adapter_name(adapter_name, list(self.peft_config), "delete_adapter")
    return _original(PeftModel, "delete_adapter")(self, adapter_name)


def softprompt_plus_get_peft_model(model, peft_config, *args, **kwargs):
    """Ours: `model` must be a module (PEFT fails deep inside on a string such as a Hub id)."""
    if getattr(peft_config, "peft_type", None) == METHOD and not isinstance(model, nn.Module):
        raise TypeError(
            f"`model` must be a torch.nn.Module (a loaded transformers model), got {type(model).__name__} {model!r}. "
            f"Load it first, e.g. AutoModelForCausalLM.from_pretrained({model!r})."
        )
    return _original(peft.mapping_func, "get_peft_model")(model, peft_config, *args, **kwargs)


def softprompt_plus_is_alora_relevant_in_batch(model, adapter_names=None):
    """PEFT's own, over the entries that can name an aLoRA adapter: a row's composition of KV adapters (a list) is
    unhashable, and PEFT looks every entry up in `peft_config` before the forward reaches the tuner."""
    names = None if adapter_names is None else [name for name in adapter_names if isinstance(name, str)]
    return _original(lora_variants, "is_alora_relevant_in_batch")(model, names)


def _is_path(model_id) -> bool:
    return isinstance(model_id, (str, os.PathLike))


@dataclass(frozen=True)
class Patch:
    owner: object
    name: str
    replacement: Callable
    reason: str
    is_classmethod: bool = False


PATCHES: tuple[Patch, ...] = (
    Patch(PeftModel, "__init__", softprompt_plus_peft_model_init, "PEFT's own deprecation warning, not the user's"),
    Patch(PeftModel, "save_pretrained", softprompt_plus_save_pretrained, "crash-safe save, our model card"),
    Patch(PeftModel, "push_to_hub", softprompt_plus_push_to_hub, "transformers' push replaces our model card"),
    Patch(PeftModel, "create_or_update_model_card", softprompt_plus_create_or_update_model_card, "our card section"),
    Patch(PeftModel, "from_pretrained", softprompt_plus_from_pretrained, "diagnose files; roll back", True),
    Patch(PeftModel, "load_adapter", softprompt_plus_load_adapter, "diagnose damaged files; resume an encoder"),
    Patch(PeftModel, "set_adapter", softprompt_plus_set_adapter, "name errors that list the adapters"),
    Patch(PeftModel, "delete_adapter", softprompt_plus_delete_adapter, "name errors that list the adapters"),
    Patch(peft.mapping_func, "get_peft_model", softprompt_plus_get_peft_model, "a clear error for a non-module"),
    Patch(peft, "get_peft_model", softprompt_plus_get_peft_model, "the same function, as `from peft import` sees it"),
    Patch(
        lora_variants,
        "is_alora_relevant_in_batch",
        softprompt_plus_is_alora_relevant_in_batch,
        "a composition entry in `adapter_names` is a list",
    ),
)


def _apply(patch: Patch) -> None:
    original = _original(patch.owner, patch.name)  # PEFT's own, even when a reload patches again

    def replacement(*args, **kwargs):
        return patch.replacement(*args, **kwargs)

    replacement.__name__ = replacement.__qualname__ = patch.replacement.__name__
    replacement.__doc__ = patch.replacement.__doc__
    replacement._softprompt_plus_original = original
    setattr(patch.owner, patch.name, classmethod(replacement) if patch.is_classmethod else replacement)


def register(config_cls, model_cls) -> None:
    """Register config + tuner with PEFT and apply `PATCHES`; importing twice (or reloading) is harmless."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    if SOFTPROMPT_PLUS in PEFT_TYPE_TO_CONFIG_MAPPING:
        # A reload creates new classes: point PEFT at them rather than keeping stale ones.
        PEFT_TYPE_TO_CONFIG_MAPPING[SOFTPROMPT_PLUS] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[SOFTPROMPT_PLUS] = model_cls
    else:
        register_peft_method(name=METHOD.lower(), config_cls=config_cls, model_cls=model_cls, prefix=PREFIX)
    PEFT_TYPE_TO_PREFIX_MAPPING[SOFTPROMPT_PLUS] = PREFIX
    for patch in PATCHES:
        _apply(patch)
