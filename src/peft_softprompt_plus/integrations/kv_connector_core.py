"""The KV connector's logic without vLLM (`vllm_kv.py` runs it inside vLLM): which request it matches and for how
many positions, the cache slots of a block table, which layers and KV heads a rank writes under tensor and pipeline
parallelism, and the shape checks made before anything is written. Where a KV prompt doesn't fit, these functions
return the reason instead of raising: a raise inside vLLM kills the engine for every request it holds.

The mapping follows vLLM 0.32 (recorded from its own helpers by `tests/integrations/_record_vllm_kv_layout.py`):
- a rank holds `max(1, total_kv_heads // tp_size)` KV heads (`ModelConfig.get_num_kv_heads`), starting at head
  `(tp_rank // replicas) * per_rank` with `replicas = max(1, tp_size // total_kv_heads)` (`QKVParallelLinear`'s
  weight loader): with fewer KV heads than ranks, ranks hold copies of the same head;
- a rank's cache holds only its pipeline stage's layers, each named with its global index (`extract_layer_index`);
  layers past the model's own (a draft model's, MTP's) are left alone: vLLM verifies every drafted token.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from safetensors import SafetensorError, safe_open

from .._names import SAVED_KV_KEY
from .._names import VLLM_KV_PARAM as PARAM
from .._names import VLLM_KV_TENSOR as TENSOR
from ..files.content_hash import NOT_COMPUTED, content_hash

HASH = re.compile(r"[0-9a-f]{16,64}")  # whole strings only (fullmatch): `$` would take a trailing newline
DEFAULT_CACHE_BYTES = 1 << 30  # `kv_connector_extra_config.cache_bytes`: verified prompts kept per process
CONFIG_KEY = "softprompt_plus_config"  # a share file's metadata: the config its content hash counts, as JSON


@dataclass(frozen=True)
class ModelShape:
    """The engine's model, as a KV prompt must match it (vLLM's `ModelConfig`, before any parallelism)."""

    layers: int  # decoder layers: `get_total_num_hidden_layers()`, draft and MTP layers not counted
    kv_heads: int  # `get_total_num_kv_heads()`
    head_size: int  # `get_head_size()`


@dataclass(frozen=True)
class LayerShape:
    """One attention layer of a rank, as vLLM built it (its `num_kv_heads` is already this rank's share)."""

    num_kv_heads: int
    head_size: int


def file_metadata(config: dict) -> dict[str, str]:
    """The metadata a share file is published with: the fields of the adapter's `config` its content hash counts, so
    whoever reads the file can hash it again without the adapter's folder."""
    return {CONFIG_KEY: json.dumps({k: v for k, v in config.items() if k not in NOT_COMPUTED}, sort_keys=True)}


def verified_prompt(path: str, digest: str) -> torch.Tensor:
    """The KV prompt in the share file at `path` once its tensor, hashed with the config in its metadata
    (files/content_hash.py), gives `digest`; a ValueError says why not (a planted, stale or torn file)."""
    try:
        with safe_open(path, framework="pt") as handle:
            metadata, tensors = handle.metadata() or {}, {name: handle.get_tensor(name) for name in handle.keys()}
    except SafetensorError as err:
        raise ValueError(f"{path} is not a safetensors file ({err})") from err
    if set(tensors) != {TENSOR}:
        raise ValueError(f"{path} holds the tensors {sorted(tensors)}, not the one {TENSOR!r} the front publishes")
    try:
        config = json.loads(metadata[CONFIG_KEY])
    except (KeyError, ValueError) as err:
        raise ValueError(f"{path} holds no config to hash it with: the front did not publish it ({err!r})") from err
    found = content_hash(config if isinstance(config, dict) else {}, {SAVED_KV_KEY: tensors[TENSOR]})
    if found != digest:
        raise ValueError(
            f"{path} hashes to {found}, not to its name: a stale or planted file (loading the adapter into "
            "`softprompt-plus serve` again publishes it as it should be)"
        )
    return tensors[TENSOR]


class PromptCache:
    """The verified KV prompts one process has read (`verified_prompt`), bounded in bytes, least recently used first
    out: a content-addressed file that hashed right never changes, so a kept one is served without reading it again;
    one pushed out is read and hashed again at its next use (on vLLM's scheduler thread: keep the bound above the
    prompts served at once). A refused file is never kept."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"`cache_bytes` must be a whole number of bytes (0 or more), got {max_bytes!r}.")
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # vLLM calls a connector from one thread; the front's tests from several

    def __call__(self, folder: str, digest: str) -> torch.Tensor:
        """`folder/digest.safetensors` as float32 `[layers, 2, Hkv, N, hd]`, checked against `digest` unless kept."""
        if not isinstance(digest, str) or not HASH.fullmatch(digest):
            raise ValueError(f"`{PARAM}` must be a content hash (16 to 64 lowercase hex digits), got {digest!r:.80}.")
        key = (folder, digest)
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        prompt = verified_prompt(os.path.join(folder, f"{digest}.safetensors"), digest)
        size = prompt.numel() * prompt.element_size()
        with self._lock:
            if size <= self.max_bytes and key not in self._kept:
                self._kept[key] = prompt
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, out = self._kept.popitem(last=False)
                    self._bytes -= out.numel() * out.element_size()
        return prompt

    @property
    def bytes(self) -> int:
        return self._bytes


shared_prompt = PromptCache()  # the process's own cache, where a caller brings none


def prompt_misfit(shape: tuple[int, ...], model: ModelShape) -> Optional[str]:
    """Why a KV prompt of `shape` (`[layers, 2, Hkv, N, hd]`) can't serve `model`, or None when it can."""
    if len(shape) != 5 or shape[1] != 2:
        return f"the KV prompt has shape {list(shape)}, not [layers, 2, kv_heads, positions, head_size]"
    wanted = {"layers": model.layers, "KV heads": model.kv_heads, "head size": model.head_size}
    found = {"layers": shape[0], "KV heads": shape[2], "head size": shape[4]}
    wrong = [f"{found[k]} {k} (the model: {wanted[k]})" for k in wanted if found[k] != wanted[k]]
    return f"the KV prompt has {', '.join(wrong)}: it was trained on another model" if wrong else None


def match(
    folder: str,
    digest: str,
    model: ModelShape,
    prompt_tokens: int,
    computed: int,
    prompts: Callable[[str, str], torch.Tensor] = shared_prompt,
) -> tuple[int, Optional[str]]:
    """How many of a request's next positions the connector writes (`computed` are in the cache already), or 0 and
    the reason it writes none; `prompts` reads the share (a `PromptCache`). The count is never rounded to a block:
    padding would shift the text."""
    try:
        shape = tuple(prompts(folder, digest).shape)
    except Exception as err:  # noqa: BLE001  any file at all may be there: a raise inside vLLM stops the engine
        return 0, f"the KV prompt {digest!r} can't be read from {folder}: {err}"
    misfit = prompt_misfit(shape, model)
    if misfit is not None:
        return 0, misfit
    positions = shape[3]
    # The last prompt token must be computed for its logits: at most L - 1 positions come from the adapter.
    if positions > prompt_tokens - 1:
        return 0, f"the request has {prompt_tokens} tokens: the KV prompt's {positions} positions need text after them"
    return max(0, positions - computed), None


def cache_slots(block_ids: list[int], block_size: int, first: int, count: int) -> list[int]:
    """The cache slot of each position first..first+count-1 of a request whose blocks are `block_ids`."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(first, first + count)]


def blocks_of(slots: list[int], block_size: int) -> set[int]:
    return {slot // block_size for slot in slots}


def layer_index(name: str) -> int:
    """A layer's global index from its vLLM name, as `extract_layer_index` reads it: the one integer in it."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"layer name {name!r} should hold exactly one integer, its layer index")
    return numbers[0]


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The global KV heads tensor-parallel rank `tp_rank` of `tp_size` holds, as vLLM assigns them."""
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise ValueError(
            f"`tensor_parallel_size` {tp_size} must divide the model's {total_kv_heads} KV heads or be a multiple of "
            "them, as vLLM requires."
        )
    per_rank = max(1, total_kv_heads // tp_size)
    replicas = max(1, tp_size // total_kv_heads)
    first = (tp_rank // replicas) * per_rank
    return range(first, first + per_rank)


def _layer_misfit(name: str, index: int, layer: LayerShape, prompt: torch.Tensor, heads: range) -> Optional[str]:
    layers, _, kv_heads, _, head_size = prompt.shape
    if index >= layers:
        return f"layer {name} has index {index}, the KV prompt {layers} layers"
    if heads.stop > kv_heads:
        return f"this rank holds KV heads {heads.start}..{heads.stop - 1}, the KV prompt {kv_heads} heads"
    if layer.num_kv_heads != len(heads) or layer.head_size != head_size:
        return (
            f"layer {name} holds {layer.num_kv_heads} KV heads of size {layer.head_size}, this rank's share of the "
            f"KV prompt {len(heads)} of size {head_size}"
        )
    return None


Writer = Callable[[str, torch.Tensor, torch.Tensor], None]  # (layer name, keys [T, Hr, hd], values [T, Hr, hd])


def load_prompt(
    prompt: torch.Tensor,
    layers: dict[str, LayerShape],
    heads: range,
    model_layers: int,
    first: int,
    count: int,
    write: Writer,
) -> Optional[str]:
    """Writes positions first..first+count-1 of `prompt` (`[layers, 2, Hkv, N, hd]`) into this rank's `layers`
    (name -> shape), its KV heads `heads` only, through `write`; layers indexed past `model_layers` (draft, MTP) are
    skipped. Every layer is checked before any is written: a misfit writes nothing and returns its reason."""
    if first + count > prompt.shape[3]:
        return f"positions {first}..{first + count - 1} asked of a KV prompt with {prompt.shape[3]}"
    chosen = {}
    for name, layer in layers.items():
        try:
            index = layer_index(name)
        except ValueError as err:
            return str(err)
        if index >= model_layers:
            continue
        misfit = _layer_misfit(name, index, layer, prompt, heads)
        if misfit is not None:
            return misfit
        chosen[name] = index
    for name, index in chosen.items():
        part = prompt[index, :, heads.start : heads.stop, first : first + count]  # [2, Hr, T, hd]
        keys, values = part.permute(0, 2, 1, 3)  # 2 x [T, Hr, hd]
        write(name, keys, values)
    return None
