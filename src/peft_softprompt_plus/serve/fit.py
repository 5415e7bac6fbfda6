"""Adapters made to fit the engine before anything is sent to it: each one checked against the base the front serves
(the base it was trained on, its width); a KV adapter's shape checked against the engine's model as vLLM reads the
base's config before anything is published for vLLM's connector (`kv_fields.py`), and its keys folded so that its text
starts right after its N positions, where vLLM places it (`files/fold.py`); a request the fold would change
is refused."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..files.fold import check_fold_window, fold_kv_prompt, fold_refused
from ..forward.windows import text_config
from ..integrations.kv_connector_core import ModelShape, prompt_misfit
from .requests import FrontError

# vLLM 0.32's `ModelArchConfigConvertorBase.get_total_num_kv_heads`: the first of these the text config has, else
# its attention heads (a model without grouped-query attention has as many KV heads as heads).
_KV_HEAD_ATTRIBUTES = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")


def check_base(name: str, folder: str, config: dict, base_name: str, width: int, prompt, kv: bool) -> None:
    """Refuse an adapter trained on another base than the front's `base_name` (by folder name), or an input adapter
    whose `prompt` (`[N, D]`) isn't the base's `width` wide."""
    trained_on = config.get("base_model_name_or_path") or ""
    other = os.path.basename(os.path.normpath(trained_on)) if trained_on else ""
    if other and other != base_name:
        raise FrontError(
            400,
            f"adapter {name!r} ({folder}) was trained on {trained_on!r}, not on this server's base {base_name!r}. "
            "Serve it with a front started on that base.",
        )
    if not kv and prompt.shape[-1] != width:
        raise FrontError(
            400,
            f"adapter {name!r} ({folder}) holds a prompt {prompt.shape[-1]} wide, but this base's hidden size is "
            f"{width}: it was trained on another model.",
        )


def engine_shape(model_config) -> ModelShape:
    """The engine's model as vLLM 0.32 reads the base's config (`ModelArchConfigConvertorBase`): its text config's
    `num_hidden_layers`, its KV heads, and `head_dim` where set (> 0), else hidden size over attention heads."""
    config = text_config(model_config)
    heads = getattr(config, "num_attention_heads", 0)
    kv_heads = next((getattr(config, a) for a in _KV_HEAD_ATTRIBUTES if getattr(config, a, None) is not None), heads)
    head_dim = getattr(config, "head_dim", None)
    head_size = head_dim if head_dim else (getattr(config, "hidden_size", 0) // heads if heads else 0)
    return ModelShape(getattr(config, "num_hidden_layers", 0), kv_heads, head_size)


def check_shape(name: str, folder: str, config: dict, shape: tuple[int, ...], engine: ModelShape) -> None:
    """Refuse, at load, a KV adapter whose keys/values (`shape`, `[layers, 2, Hkv, N, hd]`) or recorded `kv_base`
    don't fit the engine's model: vLLM's connector would match none of its positions."""
    base = config.get("kv_base")
    shapes = [tuple(shape)]
    if base:  # what the keys were recorded on: an engine of that shape is the one they fit
        shapes.append((base.get("layers"), 2, base.get("kv_heads"), shape[-2], base.get("head_dim")))
    for found in shapes:
        misfit = prompt_misfit(found, engine)
        if misfit is not None:
            raise FrontError(
                400,
                f"adapter {name!r} ({folder}) doesn't fit the engine's model ({engine.layers} layers, "
                f"{engine.kv_heads} KV heads of size {engine.head_size}, read from the base's config): {misfit}. "
                "Serve it with a front and a vLLM started on the base it was trained on.",
            )


def check_foldable(name: str, folder: str, config: dict, model_config) -> None:
    """Refuse, before it is built, a KV adapter whose text starts past its N positions on a model where moving the
    text to N can't be exact (absolute positions, length-dependent rotary), with the fold's reason."""
    n, start = config.get("num_virtual_tokens"), config.get("kv_text_start")
    why = None if start in (None, n) else fold_refused(model_config)
    if why is not None:
        raise FrontError(
            400,
            f"adapter {name!r} ({folder}) starts its text at position kv_text_start={start}, not N={n}: vLLM places "
            "a prompt's tokens at 0..L-1, so the front folds its keys to start the text at N, and this base can't "
            f"be folded exactly: {why}. Serve it with the library's `generate`.",
        )


def at_n(values: torch.Tensor, start: int, model_config) -> tuple[torch.Tensor, Optional[int]]:
    """`values` (`[layers, 2, Hkv, N, hd]`, stored for a text at `start`) as vLLM reads them, the text at N, and the
    start they were folded from (None: nothing moved)."""
    n = values.shape[-2]
    if start == n:
        return values, None
    try:
        return fold_kv_prompt(values, model_config, start, n), start
    except ValueError as err:
        raise FrontError(400, f"the KV prompt can't be folded to start its text at N={n}: {err}") from err


def check_window(adapter, model_config, text_length: int) -> None:
    """Refuse a request of `text_length` positions (its text and every token it may generate) to a folded KV
    prompt whose prompt-to-text distances a sliding window would cut differently than at its own start."""
    if adapter is None or adapter.folded_from is None:
        return
    try:
        check_fold_window(model_config, adapter.positions, adapter.folded_from, adapter.positions, text_length)
    except ValueError as err:
        raise FrontError(
            400,
            f"adapter {adapter.name!r} is served folded from text start {adapter.folded_from} to "
            f"{adapter.positions}, and this request's text and max_tokens take {text_length} positions: {err}",
        ) from err
