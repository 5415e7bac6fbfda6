"""Reading a saved adapter, with every way it can be broken named: a missing or damaged file, invalid JSON, an
unknown `peft_type`, a prompt whose shape doesn't fit (virtual tokens told apart from hidden size), non-finite values.
Checked before PEFT touches the base model, so a failed load hands the model back as it came."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

import torch
from torch import nn

from .._names import BANK, CONFIG_FILE, ENCODER_FILE, METHOD, RAW_KEY, SAVED_KEY, WEIGHT_FILES, prompt_key
from ..forward.state import BaseSettings

logger = logging.getLogger(__name__)


class AdapterFileError(ValueError):
    """A saved adapter that can't be loaded; the message names the file, what is wrong, and the fix."""


def read_config(folder: str) -> dict:
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise AdapterFileError(
            f"{folder!r} holds no {CONFIG_FILE}: it is not a saved adapter (or the save didn't finish). Pass the "
            "folder that `save_pretrained` wrote."
        )
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterFileError(f"{path!r} is not valid JSON ({err}). Restore it from the saved adapter.") from err
    if not isinstance(config, dict):
        raise AdapterFileError(f"{path!r} must hold a JSON object, got {type(config).__name__}.")
    return config


def check_peft_type(config: dict, folder: str) -> None:
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    peft_type = config.get("peft_type")
    if peft_type not in {getattr(k, "value", k) for k in PEFT_TYPE_TO_CONFIG_MAPPING}:
        raise AdapterFileError(
            f"{os.path.join(folder, CONFIG_FILE)!r} has peft_type={peft_type!r}, which no PEFT method in this process "
            f"handles. A softprompt-plus adapter has peft_type={METHOD!r}; for another library's method, import "
            "that library first."
        )


def weights_file(folder: str) -> str:
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise AdapterFileError(
        f"{folder!r} has {CONFIG_FILE} but none of {list(WEIGHT_FILES)}: the save didn't finish or the weights were "
        "removed. Save the adapter again."
    )


def read_prompt(path: str) -> torch.Tensor:
    """The saved `[N, D]` prompt in `path` (safetensors or a torch pickle)."""
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                keys = list(handle.keys())
                value = handle.get_tensor(SAVED_KEY) if SAVED_KEY in keys else None
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            keys, value = list(state), state.get(SAVED_KEY)
    except Exception as err:  # noqa: BLE001 - any reader failure means a damaged file; say so with its cause
        raise AdapterFileError(
            f"{path!r} is damaged (truncated or not a weights file): {type(err).__name__}: {err}. Save the adapter "
            "again, or copy the file over once more."
        ) from err
    if value is None:
        raise AdapterFileError(
            f"{path!r} holds no soft prompt (no tensor {SAVED_KEY!r}; found {sorted(keys)[:5]}): it is not a "
            "softprompt-plus adapter."
        )
    return value


def diagnose_prompt(value: torch.Tensor, expected: tuple[int, int], where: str) -> Optional[str]:
    """Why `value` can't be a prompt of shape `expected` = (num_virtual_tokens, hidden size); None if it can."""
    num, dim = expected
    if value.dim() != 2:
        return (
            f"{where} holds a tensor of shape {list(value.shape)}; a soft prompt is [num_virtual_tokens, hidden size]."
        )
    if value.shape[0] != num:
        return (
            f"{where} holds {value.shape[0]} virtual tokens, but adapter_config.json says num_virtual_tokens={num}: "
            "the config was edited or comes from another save. Restore the adapter_config.json saved with it."
        )
    if value.shape[1] != dim:
        return (
            f"{where} holds a prompt of hidden size {value.shape[1]}, but this base model's is {dim}: the adapter was "
            "trained on another base. Load it into the base model it was trained on."
        )
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        return (
            f"{where} holds {bad} non-finite value(s) (NaN/inf) of {value.numel()}: the prompt diverged in training "
            "or the file is damaged. Load an earlier checkpoint."
        )
    return None


def check_folder(folder: str, base: Optional[nn.Module]) -> None:
    """Raise `AdapterFileError` for a local softprompt-plus adapter folder that can't load into `base`."""
    config = read_config(folder)
    check_peft_type(config, folder)
    if config.get("peft_type") != METHOD:
        return
    path = weights_file(folder)
    value = read_prompt(path)
    embedding = base.get_input_embeddings() if base is not None and hasattr(base, "get_input_embeddings") else None
    dim = embedding.embedding_dim if isinstance(embedding, nn.Embedding) else value.shape[-1]
    problem = diagnose_prompt(value, (config.get("num_virtual_tokens"), dim), repr(path))
    if problem:
        raise AdapterFileError(problem)


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
    checked: an AdapterFileError names what doesn't fit."""
    bank = getattr(tuner, BANK)
    saved = [k for k in state_dict if k.endswith(SAVED_KEY)]
    expected = tuple(bank.prompts[adapter_name].shape)
    problems = [diagnose_prompt(state_dict[k], expected, "The saved adapter") for k in saved]
    if not saved:
        problems.append(
            f"The adapter weights hold no soft prompt (no key ending in {SAVED_KEY!r}; found "
            f"{sorted(state_dict)[:5]}): it is not a softprompt-plus adapter."
        )
    problem = next((p for p in problems if p), None)
    if problem:
        raise AdapterFileError(problem)
    remapped = {k: v for k, v in state_dict.items() if k not in saved}
    remapped.update({prompt_key(adapter_name, bank_name): state_dict[k] for k in saved})
    # Training on from a reparameterised adapter: the raw prompt and encoder saved beside the folded table.
    remapped.update(resume_state(tuner, bank_name, adapter_name))
    return remapped


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
