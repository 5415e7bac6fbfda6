"""The scheduler side of this package's vLLM KV connector (`integrations/vllm_kv.py`), run without vLLM: the vLLM
names its module imports stand in as empty ones while it is imported, so the fake vLLM of test_serve.py marks a
request served exactly when the real connector's `get_num_new_matched_tokens` matches it (its `kv_transfer_params`
name a readable `<hash>.safetensors` in the connector's folder whose shape fits the engine's model, and the prompt
holds text after those positions), and returns the connector's reason where it refused one."""

from __future__ import annotations

import enum
import importlib
import itertools
import logging
import sys
import types
from typing import Optional

import torch

from peft_softprompt_plus.apps.tiny import tiny_config

_MODULE = "peft_softprompt_plus.integrations.vllm_kv"
_IDS = itertools.count()


class _Base:
    """vLLM's `KVConnectorBase_V1`: the connector's scheduler-side methods use none of it."""

    def __init__(self, vllm_config, role, kv_cache_config):
        self.role = role


def _stand_ins() -> dict[str, types.ModuleType]:
    base = types.ModuleType("base")
    base.KVConnectorBase_V1 = _Base
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
    base.KVConnectorRole = enum.Enum("KVConnectorRole", ["SCHEDULER", "WORKER"])
    logger = types.ModuleType("logger")
    logger.init_logger = logging.getLogger
    return {
        "vllm": types.ModuleType("vllm"),
        "vllm.distributed.kv_transfer.kv_connector.v1.base": base,
        "vllm.logger": logger,
    }


def _model_config(layers: int, kv_heads: int, head_size: int):
    """vLLM's `ModelConfig`, as far as the connector reads it."""
    return types.SimpleNamespace(
        dtype=torch.float32,
        get_total_num_hidden_layers=lambda: layers,
        get_total_num_kv_heads=lambda: kv_heads,
        get_head_size=lambda: head_size,
    )


def tiny_base() -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the tiny GPT-2 test_serve.py serves (`apps/tiny.py`)."""
    config = tiny_config(vocab_size=1)
    return config.n_layer, config.n_head, config.n_embd // config.n_head


def scheduler_connector(folder: str, model: Optional[tuple[int, int, int]] = None, block_size: int = 16):
    """The real connector class, built as vLLM's scheduler builds it with `kv_connector_extra_config.folder`, for an
    engine serving `model` (layers, KV heads, head size; the tiny base by default) with blocks of `block_size`; the
    stand-ins leave `sys.modules` once it is imported, so nothing else sees them."""
    names = [*_stand_ins(), _MODULE]
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sys.modules.update(_stand_ins())
    try:
        module = importlib.import_module(_MODULE)
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
    config = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={"folder": folder}),
        cache_config=types.SimpleNamespace(block_size=block_size),
        model_config=_model_config(*(model or tiny_base())),
    )
    return module.SoftPromptKVConnector(config, module.KVConnectorRole.SCHEDULER, None)


def served_mark(connector, body: dict) -> Optional[dict]:
    """What vLLM returns as a finished request's `kv_transfer_params` for upstream `body` (token ids in `prompt`):
    the connector is asked to match it when it is scheduled and for its mark when it finishes."""
    prompt = body.get("prompt")
    request = types.SimpleNamespace(
        request_id=f"cmpl-{next(_IDS)}",
        kv_transfer_params=body.get("kv_transfer_params"),
        num_prompt_tokens=len(prompt) if isinstance(prompt, list) else 0,
    )
    connector.get_num_new_matched_tokens(request, 0)
    return connector.request_finished(request, [])[1]
