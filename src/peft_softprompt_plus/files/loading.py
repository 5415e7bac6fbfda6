"""Loading a saved adapter into a live model: its state dict under the live names (checked, a KV prompt split into
its frozen and trained positions), a residual adapter's encoder read back to train on, and the base handed back as
it came when a load fails. Reading and checking the files themselves is `reading.py`'s."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from typing import Optional

import torch
from torch import nn

from .._names import (
    BANK,
    ENCODER_FILE,
    ORIGINS,
    RAW_KEY,
    SAVED_KEY,
    SAVED_KV_KEY,
    SAVED_ORIGINS_KEY,
    SINKS,
    prompt_key,
)
from ..forward.state import BaseSettings
from .reading import AdapterFileError, diagnose_kv, diagnose_prompt, missing_because

__all__ = ["AdapterFileError"]  # its import path since 0.1

logger = logging.getLogger(__name__)


class BaseState(BaseSettings):
    """What attaching changes on a base model, to hand it back unchanged after a load that failed half-way: the
    settings prompting changes, and any `modules_to_save` copies PEFT put in."""

    def restore(self, model: nn.Module) -> None:
        from peft.utils.other import AuxiliaryTrainingWrapper

        for name, module in list(model.named_modules()):
            if isinstance(module, AuxiliaryTrainingWrapper):  # `modules_to_save` copies: put the original back
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, module.original_module)
        super().restore(model)


_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("softprompt_plus_loading", default=False)


@contextlib.contextmanager
def loading():
    """While PEFT attaches an adapter whose weights it then loads from a folder: its starting values are never read,
    so they are not computed (no tokenizer, no source folder, no prompt pass)."""
    token = _LOADING.set(True)
    try:
        yield
    finally:
        _LOADING.reset(token)


def is_loading() -> bool:
    return _LOADING.get()


def loading_from(tuner, model_id, kwargs: dict):
    """While PEFT loads an adapter from `model_id`, `resume_state` can find the file saved beside it."""
    source = (os.fspath(model_id), kwargs.get("subfolder"), kwargs.get("revision"), kwargs.get("token"))
    return tuner.forward_state.loading_from(source)


def _source_file(source) -> Optional[str]:
    if source is None:
        return None
    model_id, subfolder, revision, token = source
    local = os.path.join(model_id, subfolder or "", ENCODER_FILE)
    if os.path.isdir(model_id):
        return local if os.path.isfile(local) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(model_id, ENCODER_FILE, subfolder=subfolder, revision=revision, token=token)
    except EntryNotFoundError:
        return None


def remapped_for_load(tuner, bank_name: str, adapter_name: str, state_dict: dict) -> dict[str, torch.Tensor]:
    """A saved adapter's state dict under the live model's names (PEFT's `_remap_adapter_state_dict_for_load`),
    checked: an AdapterFileError names what doesn't fit. A KV prompt's saved keys/values are split into its frozen
    leading positions and the trained rest, as the bank holds them."""
    bank = getattr(tuner, BANK)
    kv = tuner.peft_config[adapter_name].prompt_level == "kv"
    key = SAVED_KV_KEY if kv else SAVED_KEY
    saved = [k for k in state_dict if k.endswith(key)]
    expected = tuple(bank.values(adapter_name).shape)
    diagnose = (
        (lambda v: diagnose_kv(v, expected, "The saved adapter"))
        if kv
        else (lambda v: diagnose_prompt(v, expected, "The saved adapter"))
    )
    problems = [diagnose(state_dict[k]) for k in saved]
    if not saved:
        other = SAVED_KEY if kv else SAVED_KV_KEY
        problems.append(
            f"The adapter weights hold no soft prompt (no key ending in {key!r}; found {sorted(state_dict)[:5]}): "
            + (
                missing_because(key, [other])
                if any(k.endswith(other) for k in state_dict)
                else "it is not a softprompt-plus adapter."
            )
        )
    origins = [k for k in state_dict if k.endswith(SAVED_ORIGINS_KEY)]
    problems.append(_origins_problem(tuner, adapter_name, [state_dict[k] for k in origins]))
    problem = next((p for p in problems if p), None)
    if problem:
        raise AdapterFileError(problem)
    remapped = {k: v for k, v in state_dict.items() if k not in saved and k not in origins}
    for k in origins:
        remapped[prompt_key(adapter_name, bank_name, ORIGINS)] = state_dict[k]
    for k in saved:
        value, frozen = state_dict[k], bank.sinks[adapter_name].shape[-2] if adapter_name in bank.sinks else 0
        remapped[prompt_key(adapter_name, bank_name)] = value[..., frozen:, :]
        if frozen:
            remapped[prompt_key(adapter_name, bank_name, SINKS)] = value[..., :frozen, :]
    # Training on from a reparameterised adapter: the raw prompt and encoder saved beside the folded table.
    remapped.update(resume_state(tuner, bank_name, adapter_name))
    return remapped


def _origins_problem(tuner, adapter_name: str, found: list) -> Optional[str]:
    """What is wrong with a per-head KV adapter's saved origins (`[layers, Hkv, N]` int context positions, each
    head's in order), or with origins saved for an adapter that has none; None when they fit."""
    bank, config = getattr(tuner, BANK), tuner.peft_config[adapter_name]
    expected = tuple(bank.origins[adapter_name].shape) if adapter_name in bank.origins else None
    if expected is None:
        return (
            f"The saved adapter holds {SAVED_ORIGINS_KEY!r} (per-head origins), but its config has "
            f"kv_selection={config.kv_selection!r}: restore adapter_config.json from the same save."
            if found
            else None
        )
    if not found:
        return (
            f"The saved adapter has kv_selection='per_head' but holds no {SAVED_ORIGINS_KEY!r} (each entry's context "
            "position): restore adapter_model.safetensors from the same save as adapter_config.json."
        )
    value = found[0]
    if value.is_floating_point() or tuple(value.shape) != expected:
        return (
            f"The saved adapter's {SAVED_ORIGINS_KEY!r} is {str(value.dtype).removeprefix('torch.')} of shape "
            f"{list(value.shape)}, but its config needs int64 of shape {list(expected)} ([layers, Hkv, N]): restore "
            "it from the same save as adapter_config.json."
        )
    # Context positions, each head's in order: a fold moves the text start, never the origins, so no bound above.
    if value.numel() and (int(value.min()) < 0 or not bool((value.diff(dim=-1) > 0).all())):
        return (
            f"The saved adapter's {SAVED_ORIGINS_KEY!r} is not each head's context positions in order (its smallest "
            f"is {int(value.min())}): restore it from the same save as adapter_config.json."
        )
    return None


def resume_state(tuner, bank_name: str, adapter_name: str) -> dict[str, torch.Tensor]:
    """State-dict entries that restore a reparameterised adapter's raw prompt and encoder for more training; `{}`
    for a plain one. Without the file beside the adapter, the folded table trains on as a plain prompt."""
    bank = getattr(tuner, BANK)
    if adapter_name not in bank.encoders:
        return {}
    path = _source_file(tuner.forward_state.encoder_source)
    if path is None:
        logger.warning(
            "Adapter %r was trained with reparameterization='residual', but its folder has no %s (only the "
            "folded prompt was kept): it trains on as a plain prompt from the folded values.",
            adapter_name,
            ENCODER_FILE,
        )
        del bank.encoders[adapter_name]
        return {}
    from safetensors.torch import load_file

    tensors = load_file(path)
    expected = {RAW_KEY: bank.prompts[adapter_name].shape}
    expected.update({f"encoder.{k}": v.shape for k, v in bank.encoders[adapter_name].state_dict().items()})
    found = {k: v.shape for k, v in tensors.items()}
    if found != expected:
        raise AdapterFileError(
            f"{path!r} does not fit adapter {adapter_name!r}: it holds {_shapes(found)}, but the adapter's config "
            f"(num_virtual_tokens, residual_hidden, residual_layer_norm) needs {_shapes(expected)}. Restore it from "
            "the same save as adapter_config.json."
        )
    prefix = f"{bank_name}.softprompt_plus_"
    out = {prompt_key(adapter_name, bank_name): tensors[RAW_KEY]}
    out.update({f"{prefix}encoder.{adapter_name}.{k[8:]}": v for k, v in tensors.items() if k != RAW_KEY})
    return out


def _shapes(shapes: dict) -> str:
    return ", ".join(f"{k} {list(v)}" for k, v in sorted(shapes.items()))
