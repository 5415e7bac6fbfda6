"""A KV prompt to and from PEFT's CARTRIDGE: the same keys/values in another layout. Ours is `[layers, 2, Hkv, N, hd]`;
CARTRIDGE saves `prompt_embeddings` `[N, layers * 2 * Hkv * hd]`, layer by layer, the key before the value."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from .._names import WEIGHT_FILES
from . import loading, reading, saving

CARTRIDGE = "CARTRIDGE"
SAVED = "prompt_embeddings"  # PEFT's key for a prompt-learning adapter's table


def as_cartridge(values: torch.Tensor) -> torch.Tensor:
    """`[layers, 2, Hkv, N, hd]` -> `[N, layers * 2 * Hkv * hd]`."""
    return values.permute(3, 0, 1, 2, 4).reshape(values.shape[3], -1)


def from_table(table: torch.Tensor, layers: int, heads: int, head_dim: int) -> torch.Tensor:
    """`[N, layers * 2 * Hkv * hd]` -> `[layers, 2, Hkv, N, hd]`."""
    return table.reshape(table.shape[0], layers, 2, heads, head_dim).permute(1, 2, 3, 0, 4)


def to_cartridge(model, save_directory, adapter_name: Optional[str] = None) -> None:
    """Write the KV adapter `adapter_name` (default: the active one) of `model` as a PEFT CARTRIDGE folder, which
    `PeftModel.from_pretrained(base, save_directory)` loads without this package; crash-safe as `save_pretrained`.
    PEFT fills the layer and head counts from the base when it loads it."""
    from peft import CartridgeConfig

    tuner = model.base_model
    name = adapter_name if adapter_name is not None else model.active_adapter
    config = tuner.peft_config.get(name) if isinstance(name, str) else None
    if config is None or config.prompt_level != "kv":
        raise ValueError(
            f"`adapter_name`={name!r} must name a KV adapter (prompt_level='kv') of `model`; its adapters: "
            f"{ {n: str(c.prompt_level) for n, c in tuner.peft_config.items()} }. An input prompt has no CARTRIDGE "
            "form."
        )
    if config.kv_text_start != config.num_virtual_tokens:
        raise ValueError(
            f"`adapter_name`={name!r} starts its text at kv_text_start={config.kv_text_start}, not at N="
            f"{config.num_virtual_tokens}: CARTRIDGE always starts the text at N, so its keys would be read at other "
            "distances. Only adapters whose text starts at N convert."
        )
    table = as_cartridge(tuner.prompt_bank.values(name).detach().float().cpu()).contiguous()
    cartridge = CartridgeConfig(
        task_type=str(config.task_type),
        num_virtual_tokens=config.num_virtual_tokens,
        num_frozen_tokens=config.kv_frozen_positions,
        base_model_name_or_path=config.base_model_name_or_path,
        inference_mode=True,
    )

    def write_into(folder: str) -> None:
        from safetensors.torch import save_file

        cartridge.save_pretrained(folder)
        save_file({SAVED: table}, os.path.join(folder, WEIGHT_FILES[0]), metadata={"format": "pt"})

    saving.atomic_save(write_into, save_directory)


def _read(folder: str) -> tuple[dict, torch.Tensor]:
    config = reading.read_config(folder)
    if config.get("peft_type") != CARTRIDGE:
        raise ValueError(
            f"`folder`={folder!r} holds a {config.get('peft_type')!r} adapter, not a PEFT {CARTRIDGE} one. Pass the "
            "folder a CARTRIDGE adapter's `save_pretrained` wrote."
        )
    path = reading.weights_file(folder)
    return config, reading.read_prompt(path, SAVED).float()


def from_cartridge(base: nn.Module, folder: str, adapter_name: str = "default", config: Optional[dict] = None):
    """A PeftModel with a KV adapter holding the PEFT CARTRIDGE at `folder`, on `base` (the base it was trained on):
    logits equal CARTRIDGE's forward. `config`: more `SoftPromptPlusConfig` fields (its frozen positions default to
    the cartridge's `num_frozen_tokens`; all of N frozen is refused, since then nothing trains)."""
    from peft import get_peft_model

    from ..method.config import SoftPromptPlusConfig

    config = dict(config or {})
    saved, table = _read(folder)
    n = table.shape[0]
    frozen = config.pop("kv_frozen_positions", saved.get("num_frozen_tokens", 1))
    if frozen >= n:
        raise ValueError(
            f"`folder`={folder!r} is a CARTRIDGE of {n} positions with num_frozen_tokens={frozen}: a KV adapter keeps "
            "at least one position to train. Pass `kv_frozen_positions=` below N."
        )
    kv = SoftPromptPlusConfig(
        task_type=saved.get("task_type") or "CAUSAL_LM",
        num_virtual_tokens=n,
        prompt_level="kv",
        kv_frozen_positions=frozen,
        **config,
    )
    with loading.loading():  # the cartridge's values replace the start: none is computed
        model = get_peft_model(base, kv, adapter_name=adapter_name)
    bank = model.base_model.prompt_bank
    expected = tuple(bank.values(adapter_name).shape)  # [layers, 2, Hkv, N, hd] of this base
    if table.shape[1] != expected[0] * 2 * expected[2] * expected[4]:
        model.unload()
        raise ValueError(
            f"`folder`={folder!r} holds a CARTRIDGE table of shape {list(table.shape)}, but this base's keys/values "
            f"for {n} positions are {list(expected)} = {expected[0] * 2 * expected[2] * expected[4]} values per "
            f"position ({json.dumps(saved.get('base_model_name_or_path'))} is its base). Pass the base it was trained "
            "on."
        )
    values = from_table(table, expected[0], expected[2], expected[4])
    with torch.no_grad():
        bank.prompts[adapter_name].copy_(values[..., frozen:, :])
        if frozen:
            bank.sinks[adapter_name].copy_(values[..., :frozen, :])
    return model
