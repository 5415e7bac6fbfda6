"""KV prompts served by vLLM: a V1 KV connector that writes a KV adapter's keys/values into the cache slots of a
placeholder prefix, so vLLM serves `prompt_level="kv"` adapters by name behind `softprompt-plus serve`.

Imported by vLLM's processes only (it needs vLLM), named in vLLM's `--kv-transfer-config`:

    {"kv_connector": "SoftPromptKVConnector", "kv_role": "kv_both",
     "kv_connector_module_path": "peft_softprompt_plus.integrations.vllm_kv",
     "kv_connector_extra_config": {"folder": SHARE}}

(`"cache_bytes"` there bounds the verified prompts each process keeps, 1 GiB by default.) A request's prompt starts
with N placeholder ids, its `kv_transfer_params` hold `{"softprompt_plus_kv": HASH}` and its `cache_salt` is the
adapter's (secret, from the front): the connector reports those N positions as computed (never rounded to a block:
padding would shift the text and add keys attention reads) and writes `SHARE/HASH.safetensors` (`[layers, 2, Hkv, N,
hd]`, published by the front, hashed again whenever a process reads it) into their slots with the attention backend's
own cache writer, so the cache layout (CPU or GPU) is the backend's business. Checked by `bench/vllm_check.py` on vLLM
for CPU 0.32.

No block computed from the placeholders is ever served as the prompt's: vLLM's prefix cache hashes blocks by token ids
and salt, so a salt under which a request ran without its KV prompt (refused here, failed on a worker, or naming none)
is retired for good (`kv_connector_requests.SaltBook`), and the front moves the adapter to a fresh one.

Across ranks each worker writes only its own layers and KV heads (`kv_connector_core.py` holds the mapping and the
checks). Whatever a request holds, nothing raises inside vLLM: every field is type-checked, a KV prompt that can't be
served matches 0 positions and its reason comes back as `{VLLM_KV_REFUSED: reason}` in the finished request's
`kv_transfer_params`, and a worker that can't fill a layer writes nothing, logs why and reports the blocks as failed
loads (vLLM then fails that request and evicts those blocks: `kv_load_failure_policy="fail"`, its default, which this
connector requires).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from .._names import VLLM_KV_REFUSED as REFUSED
from .._names import VLLM_KV_SERVED as SERVED
from . import kv_connector_core as core
from . import kv_connector_requests as requests

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = init_logger(__name__)


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
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        if policy != "fail":  # "recompute" would compute a failed write from the placeholders and serve it
            raise ValueError(
                f"`kv_load_failure_policy` must be 'fail' for this connector, got {policy!r}: a KV prompt a worker "
                "could not write would be recomputed from its placeholder ids and answered as the adapter's."
            )
        model = vllm_config.model_config
        self._model = core.ModelShape(
            layers=model.get_total_num_hidden_layers(),
            kv_heads=model.get_total_num_kv_heads(),
            head_size=model.get_head_size(),
        )
        self._block_size = vllm_config.cache_config.block_size
        self._prompt_cache = core.PromptCache(extra.get("cache_bytes", core.DEFAULT_CACHE_BYTES))  # verified, by bytes
        self._salts = requests.SaltBook()
        self._matched_from: dict[str, int] = {}  # request id -> tokens found locally when it was matched
        self._served: dict[str, requests.Named] = {}  # request id -> the KV prompt matched for it
        self._refused: dict[str, str] = {}  # request id -> why its KV prompt was not applied
        self._loading: dict[str, tuple[str, set[int]]] = {}  # request id -> (its salt, the blocks a worker writes)
        self._pending: list[_PromptLoad] = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._heads = range(0)  # this worker's KV heads, set with its caches
        self._load_errors: set[int] = set()
        self._dtype = model.dtype  # what the cache writer takes keys/values in

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        try:
            return self._match(request, num_computed_tokens), False
        except Exception as err:  # noqa: BLE001  a raise here stops the engine for every request it holds
            self._refuse(request, None, f"{type(err).__name__}: {err}")
            return 0, False

    def _match(self, request: "Request", computed: int) -> int:
        """How many positions the connector writes for `request`; a refusal is recorded and matches 0."""
        salt = getattr(request, "cache_salt", None)
        named, reason = requests.named_prompt(request.kv_transfer_params, salt)
        if named is None and reason is None:  # not this connector's: its blocks are the placeholders' if it sent them
            self._salts.without_prompt(salt)
            return 0
        if reason is None:
            reason = self._salts.why_not(named.salt)
        if reason is None:
            positions, reason = core.match(
                self._folder, named.digest, self._model, request.num_prompt_tokens, computed, self._prompt_cache
            )
        if reason is not None:  # the request runs without it; the front turns the reason into its error
            self._refuse(request, salt, reason)
            return 0
        self._refused.pop(request.request_id, None)
        self._matched_from[request.request_id] = computed
        self._served[request.request_id] = named
        self._salts.served(named.salt)
        return positions  # not rounded to a block: the V1 scheduler takes any count

    def _refuse(self, request: "Request", salt, reason: str) -> None:
        """`request` runs on the placeholders: every block it computes is cached under its salt, so the salt is
        retired (`SaltBook`) and the reason returned with the finished request."""
        request_id = getattr(request, "request_id", None)
        log.error("KV prompt not applied to request %s: %s", request_id, reason)
        self._salts.retire(salt, "a request under it was refused")
        self._refused[request_id] = reason
        self._served.pop(request_id, None)
        self._matched_from.pop(request_id, None)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        first = self._matched_from.pop(request.request_id, None)  # positions 0..first-1 are in the cache already
        named = self._served.get(request.request_id)
        if num_external_tokens == 0 or first is None or named is None:
            return
        # `blocks` are all the request's blocks, so a request re-admitted after preemption is written again.
        slots = core.cache_slots(blocks.get_block_ids()[0], self._block_size, first, num_external_tokens)
        self._pending.append(_PromptLoad(named.digest, first_position=first, cache_slots=slots))
        self._loading[request.request_id] = (named.salt, core.blocks_of(slots, self._block_size))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta, self._pending = SoftPromptKVMetadata(self._pending), []
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        """A worker that could not write a request's KV prompt reports its blocks: vLLM fails that request (its
        `kv_load_failure_policy="fail"`) and evicts the blocks; the salt is retired too, so nothing of that salt
        computed meanwhile is served as the prompt's."""
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        for salt, blocks in list(self._loading.values()) if invalid else ():
            if blocks & invalid:
                self._salts.retire(salt, "a worker failed to write its KV prompt")

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        self._matched_from.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        reason = self._refused.pop(request.request_id, None)
        named = self._served.pop(request.request_id, None)
        if reason is not None:
            return False, {REFUSED: reason}
        if named is not None:
            return False, {SERVED: named.digest}  # the front checks this
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self._kv_caches = kv_caches
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self._heads = core.rank_heads(self._model.kv_heads, tp_size, tp_rank)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SoftPromptKVMetadata) or not meta.loads:
            return
        attention = forward_context.no_compile_layers
        # A cache without an attention layer's shape (not one this connector fills) holds 0 heads: a misfit if the
        # prompt has its layer, never a KeyError here.
        shapes = {name: attention.get(name) for name in self._kv_caches}
        layers = {
            name: core.LayerShape(getattr(layer, "num_kv_heads", 0), getattr(layer, "head_size", 0))
            for name, layer in shapes.items()
        }
        for load in meta.loads:
            try:
                prompt = self._prompt_cache(self._folder, load.prompt_hash)  # [layers, 2, Hkv, N, hd]
                count, write = len(load.cache_slots), self._writer(attention, load.cache_slots)
                reason = core.load_prompt(
                    prompt, layers, self._heads, self._model.layers, load.first_position, count, write
                )
            except Exception as err:  # noqa: BLE001  a raise in a worker kills the engine for every request
                reason = f"{type(err).__name__}: {err}"
            if reason is not None:  # vLLM ends this request (its kv_load_failure_policy), the engine goes on
                log.error("KV prompt %s not written on this rank: %s", load.prompt_hash, reason)
                self._load_errors |= core.blocks_of(load.cache_slots, self._block_size)

    def _writer(self, attention: dict[str, Any], cache_slots: list[int]) -> core.Writer:
        """Writes a layer's keys/values into `cache_slots` with its attention backend's own cache writer."""

        def write(name: str, keys: torch.Tensor, values: torch.Tensor) -> None:  # 2 x [T, Hr, hd]
            cache, layer = self._kv_caches[name], attention[name]
            slots = torch.tensor(cache_slots, dtype=torch.int64, device=cache.device)
            keys, values = (t.to(cache.device, self._dtype).contiguous() for t in (keys, values))
            layer.impl.do_kv_cache_update(layer, keys, values, cache, slots)

        return write

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return
