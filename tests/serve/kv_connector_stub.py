"""The scheduler side of this package's vLLM KV connector (`integrations/vllm_kv.py`), run without vLLM: the vLLM
names its module imports stand in as empty ones while it is imported, so the fake vLLM of test_app.py marks a
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

from peft_softprompt_plus._names import VLLM_KV_PARAM
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
    """(layers, KV heads, head size) of the tiny GPT-2 test_app.py serves (`apps/tiny.py`)."""
    config = tiny_config(vocab_size=1)
    return config.n_layer, config.n_head, config.n_embd // config.n_head


def scheduler_connector(
    folder: str, model: Optional[tuple[int, int, int]] = None, block_size: int = 16, policy: str = "fail"
):
    """The real connector class, built as vLLM's scheduler builds it with `kv_connector_extra_config.folder`, for an
    engine serving `model` (layers, KV heads, head size; the tiny base by default) with blocks of `block_size` and
    vLLM's `kv_load_failure_policy`; the
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
        kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config={"folder": folder}, kv_load_failure_policy=policy
        ),
        cache_config=types.SimpleNamespace(block_size=block_size),
        model_config=_model_config(*(model or tiny_base())),
    )
    return module.SoftPromptKVConnector(config, module.KVConnectorRole.SCHEDULER, None)


def served_mark(connector, body: dict) -> Optional[dict]:
    """What vLLM returns as a finished request's `kv_transfer_params` for upstream `body` (token ids in `prompt`),
    with nothing in its prefix cache: the connector is asked to match it when it is scheduled and for its mark when
    it finishes."""
    return PrefixCache(connector, block_size=1 << 30).run(body)[1]


def _request(body: dict):
    prompt = body.get("prompt")
    return types.SimpleNamespace(
        request_id=f"cmpl-{next(_IDS)}",
        kv_transfer_params=body.get("kv_transfer_params"),
        cache_salt=body.get("cache_salt"),
        num_prompt_tokens=len(prompt) if isinstance(prompt, list) else 0,
    )


ADAPTER, BASE, MIXED = "the adapter's answer", "the base's answer", "a wrong answer"


class PrefixCache:
    """vLLM's V1 prefix cache as the connector meets it (vLLM 0.32, `v1/core/kv_cache_utils.py`): a request's full
    blocks of `block_size` ids are hashed by a chain over their ids, the first with the request's `cache_salt`; the
    leading blocks already cached count as computed, the connector is asked for the positions after them, and the
    rest is computed from the ids. Each cached block remembers where each of its positions came from (the KV prompt
    it was written from, or the id it was computed from), so `run` answers as the engine would: the adapter's answer
    where every one of the named prompt's positions holds that prompt, the base's where none does, else a wrong one."""

    def __init__(self, connector, block_size: int):
        self.connector, self.block_size = connector, block_size
        self.blocks: dict[tuple, tuple] = {}  # chain hash -> each position's source
        self.positions: dict[str, int] = {}  # a KV prompt's N, once the connector matched it

    def run(self, body: dict) -> tuple[str, Optional[dict]]:
        """(the answer, the finished request's `kv_transfer_params`) for upstream `body`."""
        prompt, request = list(body.get("prompt") or []), _request(body)
        chain, sources = [], []
        for start in range(0, len(prompt) - len(prompt) % self.block_size, self.block_size):
            previous = chain[-1] if chain else ("salt", request.cache_salt)
            chain.append((previous, tuple(prompt[start : start + self.block_size])))
        for key in chain:  # the leading blocks already computed
            if key not in self.blocks:
                break
            sources += self.blocks[key]
        computed = len(sources)
        matched, _ = self.connector.get_num_new_matched_tokens(request, computed)
        digest = _named(body)
        if matched:
            self.positions[digest] = computed + matched
        sources += [("kv", digest, p) for p in range(computed, computed + matched)]
        sources += [("id", i) for i in prompt[len(sources) :]]
        for index, key in enumerate(chain):  # vLLM caches every full block of the prompt
            self.blocks.setdefault(key, tuple(sources[index * self.block_size : (index + 1) * self.block_size]))
        mark = self.connector.request_finished(request, [])[1]
        return self._answer(digest, sources), mark

    def _answer(self, digest, sources: list) -> str:
        written = [s for s in sources if s[0] == "kv"]
        if digest is None or not written:
            return BASE if not written else MIXED
        positions = self.positions.get(digest, len(sources) + 1)
        wanted = [("kv", digest, p) for p in range(positions)]
        return ADAPTER if sources[:positions] == wanted else MIXED


def _named(body: dict) -> Optional[str]:
    params = body.get("kv_transfer_params")
    return params.get(VLLM_KV_PARAM) if isinstance(params, dict) else None
