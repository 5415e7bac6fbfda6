"""KV prompts served by vLLM: a V1 KV connector that writes a KV adapter's keys/values into the cache slots of a
placeholder prefix, so vLLM serves `prompt_level="kv"` adapters by name behind `softprompt-plus serve`.

Imported by vLLM's processes only (it needs vLLM), named in vLLM's `--kv-transfer-config`:

    {"kv_connector": "SoftPromptKVConnector", "kv_role": "kv_both",
     "kv_connector_module_path": "peft_softprompt_plus.integrations.vllm_kv",
     "kv_connector_extra_config": {"folder": SHARE}}

A request's prompt starts with N placeholder ids and its `kv_transfer_params` hold `{"softprompt_plus_kv": HASH}`:
the connector reports those N positions as computed (never rounded to a block: padding would shift the text and add
keys attention reads) and writes `SHARE/HASH.safetensors` (`[layers, 2, Hkv, N, hd]`, published by the front) into
their slots with the attention backend's own cache writer, so the cache layout (CPU or GPU) is the backend's
business. Requests carry the hash as `cache_salt` too: vLLM's prefix cache hashes blocks by token ids, and every
adapter's placeholders are the same ids. Checked by `bench/vllm_check.py --parts kv` on vLLM for CPU 0.32.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from safetensors.torch import load_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from .._names import VLLM_KV_PARAM as PARAM
from .._names import VLLM_KV_SERVED as SERVED
from .._names import VLLM_KV_TENSOR as TENSOR

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger(__name__)
_HASH = re.compile(r"^[0-9a-f]{16,64}$")


@functools.lru_cache(maxsize=64)
def shared_prompt(folder: str, digest: str) -> torch.Tensor:
    """`folder/digest.safetensors` as float32 `[layers, 2, Hkv, N, hd]`; content-addressed, so it never changes."""
    if not _HASH.match(digest):
        raise ValueError(f"`{PARAM}` must be a content hash (hex), got {digest!r}.")
    return load_file(os.path.join(folder, f"{digest}.safetensors"))[TENSOR]


def _digest(request: "Request") -> Optional[str]:
    return (request.kv_transfer_params or {}).get(PARAM)


@dataclass
class _PromptLoad:
    """One request's KV prompt positions for the worker to write into the cache."""

    prompt_hash: str  # the KV prompt's content hash: `SHARE/<prompt_hash>.safetensors`
    first_position: int  # the first prompt position to write (those before it are in the cache already)
    cache_slots: list[int]  # the cache slot of each position first_position..first_position+len(cache_slots)-1


@dataclass
class SoftPromptKVMetadata(KVConnectorMetadata):
    loads: list[_PromptLoad] = field(default_factory=list)


class SoftPromptKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._folder = extra.get("folder")
        if not isinstance(self._folder, str) or not os.path.isdir(self._folder):
            raise ValueError(
                f"`kv_connector_extra_config.folder` must be the folder `softprompt-plus serve --kv-share` publishes "
                f"KV prompts to, got {self._folder!r}."
            )
        self._block_size = vllm_config.cache_config.block_size
        self._matched_from: dict[str, int] = {}  # request id -> tokens found locally when it was matched
        self._served: set[str] = set()
        self._pending: list[_PromptLoad] = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._dtype = vllm_config.model_config.dtype  # what the cache writer takes keys/values in

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        digest = _digest(request)
        if digest is None:
            return 0, False
        try:
            n = shared_prompt(self._folder, digest).shape[-2]
        except (OSError, ValueError, KeyError) as err:  # not served: the front sees no SERVED mark and refuses
            log.error("KV prompt %r can't be read from %s: %s", digest, self._folder, err)
            return 0, False
        # The last prompt token must be computed for its logits: at most L - 1 positions come from the adapter (the
        # front always sends text after the placeholders).
        end = min(n, request.num_prompt_tokens - 1)
        if end < n:
            return 0, False
        self._matched_from[request.request_id] = num_computed_tokens
        self._served.add(request.request_id)
        return max(0, end - num_computed_tokens), False  # not rounded to a block: the V1 scheduler takes any count

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        first = self._matched_from.pop(request.request_id, None)  # positions 0..first-1 are in the cache already
        if num_external_tokens == 0 or first is None:
            return
        # `blocks` are all the request's blocks, so a request re-admitted after preemption is written again.
        block_ids = blocks.get_block_ids()[0]
        size = self._block_size
        slots = [block_ids[p // size] * size + p % size for p in range(first, first + num_external_tokens)]
        self._pending.append(_PromptLoad(_digest(request), first_position=first, cache_slots=slots))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta, self._pending = SoftPromptKVMetadata(self._pending), []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        self._matched_from.pop(request.request_id, None)
        if request.request_id in self._served:
            self._served.discard(request.request_id)
            return False, {SERVED: _digest(request)}  # the front checks this before it answers
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SoftPromptKVMetadata) or not meta.loads:
            return
        names = sorted(self._kv_caches, key=extract_layer_index)  # adapter layer i is the i-th attention layer
        for load in meta.loads:
            prompt = shared_prompt(self._folder, load.prompt_hash)  # [layers, 2, Hkv, N, hd]
            if prompt.shape[0] != len(names):
                raise ValueError(f"KV prompt {load.prompt_hash} has {prompt.shape[0]} layers, the model {len(names)}.")
            end = load.first_position + len(load.cache_slots)
            for i, name in enumerate(names):
                cache = self._kv_caches[name]
                layer = forward_context.no_compile_layers[name]
                keys, values = prompt[i, :, :, load.first_position : end].permute(0, 2, 1, 3)  # 2 x [T, Hkv, hd]
                slots = torch.tensor(load.cache_slots, dtype=torch.int64, device=cache.device)
                layer.impl.do_kv_cache_update(
                    layer,
                    keys.to(cache.device, self._dtype).contiguous(),
                    values.to(cache.device, self._dtype).contiguous(),
                    cache,
                    slots,
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return
