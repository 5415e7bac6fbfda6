"""Reading a saved adapter, with every way it can be broken named: a missing or damaged file, invalid JSON, an
unknown `peft_type`, a prompt whose shape doesn't fit (virtual tokens told apart from hidden size; a KV prompt's
positions told apart from its base's layers and heads), non-finite values. Checked before PEFT touches the base
model, so a failed load hands the model back as it came."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from .._names import CONFIG_FILE, METHOD, SAVED_KEY, SAVED_KV_KEY, WEIGHT_FILES


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


def is_kv(config: dict) -> bool:
    """Whether a saved config is a KV prompt's (`prompt_level='kv'`; a config from before KV prompts has none)."""
    return config.get("prompt_level") == "kv"


def saved_key(config: dict) -> str:
    return SAVED_KV_KEY if is_kv(config) else SAVED_KEY


def read_prompt(path: str, key: str = SAVED_KEY) -> torch.Tensor:
    """The saved prompt in `path` (safetensors or a torch pickle) under `key`: an input prompt's `[N, D]` (SAVED_KEY),
    a KV prompt's `[layers, 2, Hkv, N, hd]` (SAVED_KV_KEY)."""
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                keys = list(handle.keys())
                value = handle.get_tensor(key) if key in keys else None
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            keys, value = list(state), state.get(key)
    except Exception as err:  # noqa: BLE001 - any reader failure means a damaged file; say so with its cause
        raise AdapterFileError(
            f"{path!r} is damaged (truncated or not a weights file): {type(err).__name__}: {err}. Save the adapter "
            "again, or copy the file over once more."
        ) from err
    if value is None:
        raise AdapterFileError(
            f"{path!r} holds no soft prompt (no tensor {key!r}; found {sorted(keys)[:5]}): "
            + missing_because(key, keys)
        )
    return value


def missing_because(key: str, keys: list) -> str:
    if key == SAVED_KEY and SAVED_KV_KEY in keys:
        return (
            "it holds a KV prompt, but its adapter_config.json says `prompt_level` is not 'kv'. Restore the config "
            "saved with it."
        )
    if key == SAVED_KV_KEY and SAVED_KEY in keys:
        return (
            "it holds an input prompt, but its adapter_config.json says prompt_level='kv'. Restore the config saved "
            "with it."
        )
    return "it is not a softprompt-plus adapter."


def _non_finite(value: torch.Tensor, where: str) -> Optional[str]:
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        return (
            f"{where} holds {bad} non-finite value(s) (NaN/inf) of {value.numel()}: the prompt diverged in training "
            "or the file is damaged. Load an earlier checkpoint."
        )
    return None


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
    return _non_finite(value, where)


def kv_shape(config: dict) -> Optional[tuple]:
    """The `[layers, 2, Hkv, N, hd]` a saved KV config's `kv_base` and N give its keys/values (None: not recorded)."""
    base = config.get("kv_base") or {}
    dims = (base.get("layers"), 2, base.get("kv_heads"), config.get("num_virtual_tokens"), base.get("head_dim"))
    return dims if all(isinstance(d, int) for d in dims) else None


def diagnose_kv(value: torch.Tensor, expected: Optional[tuple], where: str) -> Optional[str]:
    """Why `value` can't be a KV prompt of shape `expected` = `[layers, 2, Hkv, N, hd]`; None if it can."""
    layout = "[layers, 2 (key, value), key/value heads, num_virtual_tokens, head size]"
    if value.dim() != 5 or value.shape[1] != 2:
        return f"{where} holds a tensor of shape {list(value.shape)}; a KV prompt is {layout}."
    if expected is not None and value.shape[3] != expected[3]:
        return (
            f"{where} holds {value.shape[3]} positions, but adapter_config.json says "
            f"num_virtual_tokens={expected[3]}: the config was edited or comes from another save. Restore the "
            "adapter_config.json saved with it."
        )
    if expected is not None and tuple(value.shape) != tuple(expected):
        return (
            f"{where} holds keys/values of shape {list(value.shape)} = {layout}, but its config's `kv_base` says "
            f"{list(expected)}: the config was edited or comes from another save. Restore the adapter_config.json "
            "saved with it."
        )
    return _non_finite(value, where)


def _checked(folder: str, config: dict, dim: Optional[int] = None) -> torch.Tensor:
    """A softprompt-plus folder's prompt, checked against its `config` for either level (`dim`: the base's hidden
    size, None: the file's own); AdapterFileError names what is wrong."""
    path = weights_file(folder)
    value = read_prompt(path, saved_key(config))
    if is_kv(config):
        problem = diagnose_kv(value, kv_shape(config), repr(path))
    else:
        problem = diagnose_prompt(value, (config.get("num_virtual_tokens"), dim or value.shape[-1]), repr(path))
    if problem:
        raise AdapterFileError(problem)
    return value


def read_adapter_values(folder: str) -> tuple[dict, torch.Tensor]:
    """A saved softprompt-plus adapter's config and its float32 prompt (either level), every way it can be broken
    named (AdapterFileError)."""
    config = read_config(folder)
    check_peft_type(config, folder)
    if config.get("peft_type") != METHOD:
        raise AdapterFileError(f"{folder!r} is a {config.get('peft_type')!r} adapter, not a {METHOD} one.")
    return config, _checked(folder, config).float()


def check_folder(folder: str, base: Optional[nn.Module]) -> None:
    """Raise `AdapterFileError` for a local softprompt-plus adapter folder that can't load into `base`."""
    config = read_config(folder)
    check_peft_type(config, folder)
    if config.get("peft_type") != METHOD:
        return
    embedding = base.get_input_embeddings() if base is not None and hasattr(base, "get_input_embeddings") else None
    _checked(folder, config, embedding.embedding_dim if isinstance(embedding, nn.Embedding) else None)
