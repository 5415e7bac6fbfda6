"""A KV adapter folded so that its text starts at N (method/rotary_fold.py): from a loaded model (returned, or
rewritten in place) or a saved folder (returned, or written as a new folder), with `kv_text_start` = N. For an engine
that places the text right after the prompt (vLLM), and for CARTRIDGE export."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from typing import Any, Optional

import torch

from .._names import CONFIG_FILE, WEIGHT_FILES
from ..method import kv_prompt
from ..method.rotary_fold import fold_kv_prompt
from . import reading, saving


def _checked_kv(config: dict, where: str) -> None:
    if config.get("prompt_level") != "kv":
        raise ValueError(
            f"{where} is an adapter of prompt_level={config.get('prompt_level')!r}: only a KV adapter "
            "(prompt_level='kv') stores keys to fold. An input prompt's keys are computed at N already."
        )


def _base_config(saved: dict, folder: str):
    from transformers import AutoConfig

    base = saved.get("base_model_name_or_path")
    try:
        return AutoConfig.from_pretrained(base)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"`model_config` is None, and the base of `source`={folder!r} ({base!r}) has no config that loads here "
            f"({type(err).__name__}). Pass `model_config=AutoConfig.from_pretrained(<the base's folder>)`."
        ) from err


def _from_folder(folder: str, model_config) -> tuple[dict, torch.Tensor, Any]:
    saved, values = reading.read_adapter_values(folder)
    _checked_kv(saved, f"`source`={folder!r}")
    model_config = model_config if model_config is not None else _base_config(saved, folder)
    # The saved `kv_base` against this config, as an attach checks it: the shape from the values, the rest here.
    layers, _, heads, _, head_dim = values.shape
    layout = SimpleNamespace(modules=range(layers), heads=heads, head_dim=head_dim)
    facts = kv_prompt.base_facts(SimpleNamespace(config=model_config), layout)
    kv_prompt.check_base(saved.get("kv_base"), facts, f"`source`={folder!r}")
    return saved, values, model_config


def _install(tuner, name: str, values: torch.Tensor) -> None:
    bank = tuner.prompt_bank
    frozen = bank.sinks[name].shape[-2] if name in bank.sinks else 0
    with torch.no_grad():
        if frozen:
            bank.sinks[name].copy_(values[..., :frozen, :])
        bank.prompts[name].copy_(values[..., frozen:, :])


def _from_model(model, adapter_name: Optional[str], model_config, in_place: bool) -> tuple[dict, torch.Tensor]:
    tuner = model.base_model
    name = adapter_name if adapter_name is not None else model.active_adapter
    config = tuner.peft_config.get(name) if isinstance(name, str) else None
    if config is None:
        raise ValueError(
            f"`adapter_name`={name!r} must name an adapter of `source`; its adapters: {sorted(tuner.peft_config)}."
        )
    _checked_kv({"prompt_level": str(config.prompt_level)}, f"`adapter_name`={name!r}")
    bank_values = tuner.prompt_bank.values(name).detach()  # [layers, 2, Hkv, N, hd]
    model_config = model_config if model_config is not None else model.get_base_model().config
    n = config.num_virtual_tokens
    folded = fold_kv_prompt(bank_values.float().cpu(), model_config, config.kv_text_start, n)
    saved = json.loads(json.dumps(config.to_dict(), default=str))
    saved["kv_text_start"] = n
    if in_place:
        _install(tuner, name, folded.to(bank_values.device))
        config.kv_text_start = n
    return saved, folded


def fold_adapter(
    source, adapter_name: Optional[str] = None, model_config=None, in_place: bool = False
) -> tuple[dict, torch.Tensor]:
    """A KV adapter folded to start its text at N: its config as `adapter_config.json` holds it, with
    `kv_text_start` = N, and its `[layers, 2, Hkv, N, hd]` float32 keys/values re-rotated (`fold_kv_prompt`).

    `source`: a PeftModel (`adapter_name`, default the active one; `in_place=True` also rewrites that adapter, so
    `to_cartridge` can export it), or a saved adapter folder (`model_config`: its base's transformers config, default
    the one at its `base_model_name_or_path`; a config that differs from its `kv_base` is refused). An adapter that
    starts at N already comes back unchanged. Refused, with the reason, where the fold is not exact."""
    if isinstance(source, (str, os.PathLike)):
        if in_place:
            raise ValueError("`in_place`=True rewrites a loaded model's adapter; for a folder use `save_folded`.")
        saved, values, model_config = _from_folder(os.fspath(source), model_config)
        n = saved["num_virtual_tokens"]
        start = saved.get("kv_text_start") or n
        saved = {**saved, "kv_text_start": n}
        return saved, fold_kv_prompt(values, model_config, start, n)
    if not hasattr(source, "base_model") or not hasattr(source.base_model, "prompt_bank"):
        raise ValueError(
            f"`source` must be a PeftModel holding a softprompt-plus KV adapter or an adapter folder, got "
            f"{type(source).__name__}."
        )
    return _from_model(source, adapter_name, model_config, in_place)


def _all_tensors(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def save_folded(folder, save_directory, model_config=None) -> dict:
    """Write the KV adapter at `folder`, folded to start its text at N (`fold_adapter`), as a new adapter folder
    `save_directory` that `PeftModel.from_pretrained` loads (crash-safe, as `save_pretrained`); returns its config.
    Its other tensors (`modules_to_save` copies) and files come along; its model card doesn't (it describes the
    unfolded adapter)."""
    folder = os.fspath(folder)
    config, values = fold_adapter(folder, model_config=model_config)
    weights = reading.weights_file(folder)
    tensors = {**_all_tensors(weights), reading.saved_key(config): values.contiguous()}

    def write_into(staging: str) -> None:
        from safetensors.torch import save_file

        skip = {CONFIG_FILE, "README.md", *WEIGHT_FILES}
        for name in sorted(set(os.listdir(folder)) - skip):
            source = os.path.join(folder, name)
            copy = shutil.copytree if os.path.isdir(source) else shutil.copy2
            copy(source, os.path.join(staging, name))
        with open(os.path.join(staging, CONFIG_FILE), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        save_file(tensors, os.path.join(staging, WEIGHT_FILES[0]), metadata={"format": "pt"})

    saving.atomic_save(write_into, save_directory)
    return config
