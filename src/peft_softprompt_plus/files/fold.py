"""The rotary fold: a KV prompt's stored keys re-rotated so that a text starting at another position reads them as
the text at the old start did. Rotary attention reads q_m . k_p through R((p - m) theta) alone, so rotating every
stored key by (to - from) theta per frequency pair is exact; values don't change. Where it is not exact, refused.

The whole fold lives here: the keys' arithmetic (`fold_kv_prompt`, `fold_refused`, `check_fold_window`) and a KV
adapter folded so that its text starts at N (`kv_text_start` = N), from a loaded model (returned, or rewritten in
place) or a saved folder (returned, or written as a new folder): for an engine that places the text right after
the prompt (vLLM), and for CARTRIDGE export."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from .._names import CONFIG_FILE, WEIGHT_FILES
from ..forward.windows import layer_windows, text_config
from ..method import kv_init
from . import reading, saving

ModelConfig = Any  # a transformers PreTrainedConfig (the text config of a multimodal one)


@dataclass(frozen=True)
class LayerRotary:
    """One attention layer's rotary, as its model computes it: `inv_freq` `[r/2]` float32 over the first r dims of
    each head (None: the layer has no rotary); `interleaved` pairs dims (2i, 2i+1), else (i, i + r/2) (rotate-half).
    `attention_scaling` is what transformers multiplies cos/sin by (YaRN, longrope): the stored keys already carry
    it, so a re-rotation never applies it."""

    inv_freq: Optional[torch.Tensor]
    interleaved: bool
    attention_scaling: float = 1.0


def _rope_type(config: ModelConfig, layer_type: Optional[str] = None) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get(layer_type, params) if layer_type else params
    return params.get("rope_type", "default")


def _shared(config: ModelConfig, rope, layer: int) -> tuple[torch.Tensor, float]:
    return rope.inv_freq, float(rope.attention_scaling)


def _by_layer_type(config: ModelConfig, rope, layer: int) -> tuple[torch.Tensor, float]:
    # Gemma-3: sliding and full layers have their own rope base and scaling, one buffer per layer type.
    kind = config.layer_types[layer]
    return getattr(rope, f"{kind}_inv_freq"), float(getattr(rope, f"{kind}_attention_scaling"))


def _unless_no_rope(config: ModelConfig, rope, layer: int) -> Optional[tuple[torch.Tensor, float]]:
    # SmolLM3: `no_rope_layers[i]` is 1 where layer i uses rotary, 0 where its keys carry no position.
    return _shared(config, rope, layer) if config.no_rope_layers[layer] else None


class _GPTJRope:
    """GPT-J keeps a sin/cos table, not `inv_freq`: its frequencies as `create_sinusoidal_positions` computes them."""

    def __init__(self, config: ModelConfig) -> None:
        dim = config.rotary_dim or config.hidden_size
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
        self.attention_scaling = 1.0


@dataclass(frozen=True)
class _Family:
    module: str  # transformers.models.<module>.modeling_<module>
    rotary: str  # its rotary embedding class, built from the config as the model builds it
    interleaved: bool = False  # GPT-J's rotate_every_two; the others' rotate_half
    layer: Callable = _shared  # (config, rope, layer) -> (inv_freq, attention_scaling), or None: no rotary there
    build: Optional[Callable] = None  # instead of the class, where the family has no inv_freq buffer


# The families whose pairing and per-layer rotary were read in their modeling files (transformers 5.x) and are
# tested exact (tests/files/test_fold.py). Partial rotary needs no entry: `inv_freq` has r/2 frequencies.
FAMILIES: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaRotaryEmbedding"),
    "mistral": _Family("mistral", "MistralRotaryEmbedding"),
    "qwen2": _Family("qwen2", "Qwen2RotaryEmbedding"),
    "qwen3": _Family("qwen3", "Qwen3RotaryEmbedding"),
    "gemma": _Family("gemma", "GemmaRotaryEmbedding"),
    "gemma2": _Family("gemma2", "Gemma2RotaryEmbedding"),
    "gemma3_text": _Family("gemma3", "Gemma3RotaryEmbedding", layer=_by_layer_type),
    "phi3": _Family("phi3", "Phi3RotaryEmbedding"),
    "gpt_neox": _Family("gpt_neox", "GPTNeoXRotaryEmbedding"),
    "smollm3": _Family("smollm3", "SmolLM3RotaryEmbedding", layer=_unless_no_rope),
    "gptj": _Family("gptj", "GPTJRotaryEmbedding", interleaved=True, build=_GPTJRope),
}
ABSOLUTE = {"gpt2", "opt", "gpt_neo", "gpt_bigcode", "biogpt", "xglm"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn", "proportional"}  # frequencies fixed once, from the config
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}  # transformers recomputes them from the sequence's length


def fold_refused(model_config: ModelConfig) -> Optional[str]:
    """Why keys stored for `model_config` can't be folded exactly, whatever the request; None if they can."""
    config = text_config(model_config)
    kind = getattr(config, "model_type", None)
    if kind in ABSOLUTE:
        return (
            f"{kind} adds learned absolute position embeddings to its inputs: the text's own hidden states change "
            "with its position, so no change to the stored keys moves the text"
        )
    if kind not in FAMILIES:
        return f"{kind!r} is not a family whose rotary this fold knows exactly (known: {sorted(FAMILIES)})"
    layer_types = sorted(set(getattr(config, "layer_types", None) or [])) if kind == "gemma3_text" else [None]
    for rope_type in sorted({_rope_type(config, t) for t in layer_types}):
        if rope_type in LENGTH_DEPENDENT_ROPE:
            return (
                f"its rope_type {rope_type!r} recomputes the frequencies from the sequence's length, so the stored "
                "keys' rotation depends on how long the text that made them was"
            )
        if rope_type not in STATIC_ROPE:
            return f"its rope_type {rope_type!r} is not one this fold knows (known: {sorted(STATIC_ROPE)})"
    return None


def rotary_layers(model_config: ModelConfig) -> list[LayerRotary]:
    """Each attention layer's rotary, read from the model's own rotary embedding class built from `model_config`;
    a ValueError with the reason where the fold can't be exact."""
    why = fold_refused(model_config)
    if why:
        raise ValueError(f"`model_config` can't fold a KV prompt's keys: {why}. Serve this adapter at its own start.")
    config = text_config(model_config)
    family = FAMILIES[config.model_type]
    if family.build is not None:
        rope = family.build(config)
    else:
        module = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
        rope = getattr(module, family.rotary)(config)
    out = []
    for layer in range(config.num_hidden_layers):
        found = family.layer(config, rope, layer)
        inv_freq, scaling = found if found is not None else (None, 1.0)
        out.append(LayerRotary(inv_freq, family.interleaved, scaling))
    return out


def rotate_keys(keys: torch.Tensor, rotary: LayerRotary, shift: int) -> torch.Tensor:
    """`keys` `[..., N, hd]` (as the model stored them, rotated at their positions) rotated by `shift` positions:
    angles `shift * inv_freq` in float64, pairs as the family pairs them, dims past the rotary share unchanged."""
    if rotary.inv_freq is None or shift == 0:
        return keys.clone()
    half = rotary.inv_freq.shape[-1]
    if 2 * half > keys.shape[-1]:
        raise ValueError(
            f"The rotary of this model turns {2 * half} dims per head, but the keys have {keys.shape[-1]}: the keys "
            "were stored on another base. Fold them with the config of the model they came from."
        )
    angle = shift * rotary.inv_freq.to(device=keys.device, dtype=torch.float64)  # [r/2]
    cos, sin = angle.cos(), angle.sin()
    x = keys.to(torch.float64)
    turned, passed = x[..., : 2 * half], x[..., 2 * half :]
    # Interleaved: dims (2i, 2i+1) turn by frequency i; rotate-half: dims (i, i + r/2).
    a, b = (turned[..., 0::2], turned[..., 1::2]) if rotary.interleaved else (turned[..., :half], turned[..., half:])
    a2, b2 = a * cos - b * sin, b * cos + a * sin  # [..., N, r/2] each
    turned = torch.stack((a2, b2), dim=-1).flatten(-2) if rotary.interleaved else torch.cat((a2, b2), dim=-1)
    return torch.cat((turned, passed), dim=-1).to(keys.dtype)


def fold_kv_prompt(values: torch.Tensor, model_config: ModelConfig, from_start: int, to_start: int) -> torch.Tensor:
    """A KV prompt's `values` `[layers, 2, Hkv, N, hd]`, stored for a text starting at `from_start`, folded for a
    text starting at `to_start` (N for an engine that places the text right after the prompt): each layer's keys
    re-rotated by (to_start - from_start) positions, values unchanged. Exact for the families in `FAMILIES` with
    rotary whose frequencies don't depend on the sequence's length; refused, with the reason, elsewhere. A sliding
    window may still make a request differ: check it per request with `check_fold_window`."""
    if values.dim() != 5 or values.shape[1] != 2:
        raise ValueError(
            f"`values` must be a KV prompt's [layers, 2, Hkv, N, hd] keys/values, got shape {list(values.shape)}."
        )
    n = values.shape[-2]
    for name, start in (("from_start", from_start), ("to_start", to_start)):
        if not isinstance(start, int) or isinstance(start, bool) or start < n:
            raise ValueError(f"`{name}` must be an int >= N ({n}): the text starts after the prompt, got {start!r}.")
    if from_start == to_start:  # nothing moves: exact on any model, absolute positions included
        return values.clone()
    layers = rotary_layers(model_config)
    if len(layers) != values.shape[0]:
        raise ValueError(
            f"`values` has {values.shape[0]} layers, but `model_config` has {len(layers)}: fold the keys with the "
            "config of the model they were stored on."
        )
    keys = torch.stack([rotate_keys(values[i, 0], r, to_start - from_start) for i, r in enumerate(layers)])
    return torch.stack((keys, values[:, 1]), dim=1)  # [layers, 2, Hkv, N, hd]


def check_fold_window(
    model_config: ModelConfig, num_virtual_tokens: int, from_start: int, to_start: int, text_length: int
) -> None:
    """Refuse a request of `text_length` positions (its prompt text and every generated token) whose prompt-to-text
    distances a sliding window would cut differently after the fold. A query at text position j reads key p at
    distance start + j - p, kept while below the window W (transformers' `q - k < W`, by position, as engines
    measure it by cache slot), so some distance crosses W iff one in [lo - N + 1, lo + L - 1] (lo the smaller
    start) lies in [W - |shift|, W - 1]."""
    shift = abs(to_start - from_start)
    low = min(from_start, to_start)
    for layer, window in enumerate(layer_windows(model_config)):
        if not window or not shift:
            continue
        if max(low - num_virtual_tokens + 1, window - shift) <= min(low + text_length - 1, window - 1):
            raise ValueError(
                f"`text_length`={text_length} is too long to fold this KV prompt from start {from_start} to "
                f"{to_start} on layer {layer}, whose sliding window ({window}) would keep other prompt positions "
                f"after the fold. Keep text_length <= {window - max(from_start, to_start)} for this adapter, or serve "
                "it where the text starts at its own start."
            )


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
    facts = kv_init.base_facts(SimpleNamespace(config=model_config), layout)
    kv_init.check_base(saved.get("kv_base"), facts, f"`source`={folder!r}")
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
