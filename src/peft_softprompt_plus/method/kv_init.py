"""A KV prompt's starting keys/values and the base they belong to. Every `prompt_init` keeps its meaning: the input
prompt it names, run once through the frozen model, its keys/values kept; `adapter` lifts a saved input adapter
exactly (its hard prefix and suffix folded in) or copies a saved KV adapter. What the keys depend on (`kv_base`) is
recorded at attach and compared at every later attach, so a mismatched base is refused."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn

from ..forward import kv_pass, validation
from ..forward import paths as forward_paths
from ..forward.kv_pass import KVLayout, record_of
from ..forward.windows import text_config
from . import demonstrations, placement
from .enums import KVSelection
from .prompt_init import initial_prompt

Config = Any  # a SoftPromptPlusConfig

# Config entries the stored keys depend on beside the layers' shapes: rotary embeddings and how positions are encoded.
_KEY_SETTINGS = ("rope", "rotary", "position_embedding_type")


def base_facts(model: nn.Module, layout: KVLayout) -> dict:
    """What a KV prompt's keys depend on in `model`: its type, the layers' key shapes and its rotary settings (a
    JSON round trip, as the saved config holds them)."""
    config = text_config(model.config)
    settings = {k: v for k, v in sorted(config.to_dict().items()) if any(word in k for word in _KEY_SETTINGS)}
    facts = {
        "model_type": getattr(config, "model_type", None),
        "layers": len(layout.modules),
        "kv_heads": layout.heads,
        "head_dim": layout.head_dim,
        "settings": settings,
    }
    return json.loads(json.dumps(facts, default=str))


def differences(saved: dict, facts: dict) -> list[str]:
    """`saved` against `facts`, entry by entry: each one that differs, as `name: saved != here`."""
    out = []
    for key in sorted(set(saved) | set(facts)):
        if key == "settings":
            continue
        if saved.get(key) != facts.get(key):
            out.append(f"{key}: {saved.get(key)!r} != {facts.get(key)!r}")
    settings, here = saved.get("settings") or {}, facts.get("settings") or {}
    differ = [k for k in sorted(set(settings) | set(here)) if settings.get(k) != here.get(k)]
    return out + [f"{k}: {settings.get(k)!r} != {here.get(k)!r}" for k in differ]


def check_base(saved: Optional[dict], facts: dict, where: str) -> None:
    """Refuse keys recorded on another base (`saved`, a config's `kv_base`), naming what differs."""
    if saved is None:
        return
    differ = differences(saved, facts)
    if differ:
        raise ValueError(
            f"{where} holds keys/values recorded on another base model (`kv_base`; saved != this base): "
            f"{'; '.join(differ)}. A KV prompt is the attention's own keys and values, which these decide: load it "
            "into the base it was trained on, or start a new KV prompt on this one (lift an input adapter with "
            "prompt_init='adapter' if you have one)."
        )


@torch.no_grad()
def run_once(model: nn.Module, prompt: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The keys/values every attention layer makes of the input prompt `prompt` `[N, D]` at positions 0..N-1 in the
    frozen model, dropout off: `[layers, 2, Hkv, N, hd]` float32."""
    embedding = model.get_input_embeddings()
    rows = forward_paths.RowPrompts([prompt.to(device=embedding.weight.device, dtype=embedding.weight.dtype)])
    with kv_pass.dropout_off(model):
        record, _ = forward_paths.prompt_pass(model, rows, in_text=0)
    return record_of(record.layers, layout)


def _lift(config: Config, saved: dict, values: torch.Tensor, model: nn.Module, layout: KVLayout) -> torch.Tensor:
    """An input adapter's prompt as KV: its `[prefix; soft; suffix]` run once, so the KV prompt computes the logits it
    computed. Its length must be this config's N: padding would add keys it never had, cutting would drop some."""
    source = SimpleNamespace(
        prompt_prefix_ids=saved.get("prompt_prefix_ids"), prompt_suffix_ids=saved.get("prompt_suffix_ids")
    )
    embedding = model.get_input_embeddings()
    soft = values.to(device=embedding.weight.device, dtype=embedding.weight.dtype)
    whole = placement.around(soft, embedding, source)  # [P+N+S, D]
    if whole.shape[0] != config.num_virtual_tokens:
        prefix, suffix = placement.hard_ids(source)
        raise ValueError(
            f"`prompt_init_adapter`={config.prompt_init_adapter!r} is an input adapter of {whole.shape[0]} "
            f"positions (prompt_prefix_ids {len(prefix)} + {values.shape[0]} soft + prompt_suffix_ids {len(suffix)}), "
            f"and a lift keeps every one: pass num_virtual_tokens={whole.shape[0]}, got {config.num_virtual_tokens}."
        )
    return run_once(model, whole, layout)


def _copy(config: Config, saved: dict, values: torch.Tensor, facts: dict) -> torch.Tensor:
    """A KV adapter's keys/values as they are (same N, same base)."""
    folder = f"`prompt_init_adapter`={config.prompt_init_adapter!r}"
    check_base(saved.get("kv_base"), facts, folder)
    if values.shape[-2] != config.num_virtual_tokens:
        raise ValueError(
            f"{folder} is a KV adapter of {values.shape[-2]} positions; copying it keeps them all: pass "
            f"num_virtual_tokens={values.shape[-2]}, got {config.num_virtual_tokens}."
        )
    if config.kv_text_start is None:
        config.kv_text_start = saved.get("kv_text_start")
    return values.float().clone()


def _from_adapter(config: Config, model: nn.Module, layout: KVLayout, facts: dict) -> torch.Tensor:
    from ..files import reading

    folder = config.prompt_init_adapter
    try:
        saved, values = reading.read_adapter_values(folder)
    except reading.AdapterFileError as err:
        raise ValueError(f"`prompt_init_adapter`={folder!r} can't start this prompt: {err}") from err
    if config.chat_format is None:
        config.chat_format = saved.get("chat_format")
    if saved.get("prompt_level") == "kv":
        return _copy(config, saved, values, facts)
    return _lift(config, saved, values, model, layout)


def _from_input_prompt(config: Config, model: nn.Module, layout: KVLayout, facts: dict, owner) -> torch.Tensor:
    return run_once(model, initial_prompt(config, model.get_input_embeddings(), model.config), layout)


# `prompt_init` -> its KV start and, where it chose positions per layer and head, each entry's origin
_KV_STARTS = {
    "adapter": lambda config, model, layout, facts, owner: (_from_adapter(config, model, layout, facts), None),
    "demonstrations": lambda config, model, layout, facts, owner: demonstrations.initial_values(
        config, model, layout, owner, run_once
    ),
}


def initial_values(
    config: Config, model: nn.Module, layout: KVLayout, facts: dict, owner=None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The starting `[layers, 2, Hkv, N, hd]` float32 keys/values for `config` (`prompt_level='kv'`), and each
    entry's origin `[layers, Hkv, N]` where the start chose positions per layer and head (else None); `owner` (the
    model's attention owner) runs eager where a start selects positions by attention."""
    start = _KV_STARTS.get(str(config.prompt_init))
    if start is None:  # every other init: the input prompt it names, run once
        return _from_input_prompt(config, model, layout, facts, owner), None
    return start(config, model, layout, facts, owner)


def _placeholder(config: Config, layout: KVLayout) -> torch.Tensor:
    """Values for an adapter being loaded, which the load overwrites: small noise, so no probe reads zeros."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(layout.shape(config.num_virtual_tokens), generator=generator) * 0.02


def _placeholder_origins(config: Config, layout: KVLayout) -> Optional[torch.Tensor]:
    """Origins for a per-head adapter being loaded (`[layers, Hkv, N]`), which the load overwrites; None for others."""
    if config.kv_selection != KVSelection.PER_HEAD.value:
        return None
    return torch.zeros(len(layout.modules), layout.heads, config.num_virtual_tokens, dtype=torch.long)


def starting_values(
    config: Config, model: nn.Module, layout: Optional[KVLayout], loading: bool, owner=None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """At attach: a KV prompt's starting `[layers, 2, Hkv, N, hd]` float32 keys/values, on a base that can read them
    (checked, and recorded in `config.kv_base`), with its text start filled in; and its entries' origins `[layers,
    Hkv, N]` where chosen per head (None otherwise). `loading`: the load overwrites both."""
    if config.prompt_init == "demonstrations" and not loading:
        demonstrations.resolve(config, model)  # N and the text start, before anything reads them
    why = validation.kv_refused(model, config, layout)
    if why:
        raise ValueError(why)
    facts = base_facts(model, layout)
    check_base(config.kv_base, facts, "This KV adapter's config")
    if loading:
        values, origins = _placeholder(config, layout), _placeholder_origins(config, layout)
    else:
        values, origins = initial_values(config, model, layout, facts, owner)
    config.kv_base = facts
    if config.kv_text_start is None:
        config.kv_text_start = config.num_virtual_tokens
    validation.check_kv_room(model, config)
    return values, origins
