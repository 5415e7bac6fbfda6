"""A model's sliding windows, read from its config in one place: the demonstrations start, the forward's KV checks and
the fold (files/fold.py) all ask here."""

from __future__ import annotations

from typing import Any, Optional

ModelConfig = Any  # a transformers PreTrainedConfig (the text config of a multimodal one)


def text_config(config: ModelConfig) -> ModelConfig:
    """The config that describes the language model's layers: a multimodal config's text config, else itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_windows(model_config: ModelConfig) -> list[Optional[int]]:
    """Each layer's sliding window, as the families' attention reads it: the config's `sliding_window` on every
    layer, or on the `sliding_attention` layers of its `layer_types`; None where a layer has none."""
    config = text_config(model_config)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def smallest_window(model_config: Optional[ModelConfig]) -> Optional[int]:
    """The narrowest sliding window any layer of the model reads with (`layer_windows`), None where none has one:
    the one reading of a model's windows that the demonstrations start, the forward's KV checks and the fold use."""
    if model_config is None or not getattr(text_config(model_config), "sliding_window", None):
        return None
    windows = [w for w in layer_windows(model_config) if w]
    return min(windows) if windows else None
