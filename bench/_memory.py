"""Deterministic byte counts for the benchmarks: resident weights, the peak of tensors alive during a step, and the
bytes autograd saves for backward. Method: bench/README.md."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_UPCAST = (torch.float32, torch.float64)


class LiveBytes(TorchDispatchMode):
    """Running and peak bytes of storages returned by ops under this mode; freed storages leave via weakrefs.
    `weight_shapes` marks float tensors shaped like a weight (upcast or dequantized copies) for a separate count."""

    def __init__(self, resident: set[int], weight_shapes: frozenset = frozenset()):
        super().__init__()
        self._resident = resident  # storage pointers of weights: views of them (`w.t()`) allocate nothing
        self._weight_shapes = weight_shapes
        self.live = self.peak = self.float_weight_live = self.float_weight_peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)  # storages keep one Python object while alive, so `id` is stable until the weakref fires
        if key in self._refs or storage.nbytes() == 0 or storage.data_ptr() in self._resident:
            return
        size = storage.nbytes()
        weight_like = tensor.dtype in _UPCAST and tuple(tensor.shape) in self._weight_shapes

        def freed(_ref, key=key, size=size, weight_like=weight_like):
            self._refs.pop(key, None)
            self.live -= size
            self.float_weight_live -= size if weight_like else 0

        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)
        if weight_like:
            self.float_weight_live += size
            self.float_weight_peak = max(self.float_weight_peak, self.float_weight_live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.device.type != "meta":
                self._track(item)
        return out


def resident_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and bitsandbytes' int8 row scales (`SCB`), which are neither: they hang off the weight,
    then off the layer's `state` after a forward."""
    tensors = list(model.parameters()) + list(model.buffers())
    owners = list(model.parameters()) + [getattr(module, "state", None) for module in model.modules()]
    tensors += [scales for scales in (getattr(o, "SCB", None) for o in owners) if isinstance(scales, torch.Tensor)]
    return tensors


def pointers(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique storages behind `tensors` (tied or viewed weights count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}.values())


def weight_shapes(model: nn.Module) -> frozenset:
    """Every 2-D weight's shape and its transpose: the shapes of an upcast or dequantized copy."""
    return frozenset(s for p in model.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape[::-1])))


def float32_size(model: nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def largest_layer_fp32(model: nn.Module) -> int:
    """Float32 bytes of the biggest non-embedding weight: the most a per-layer dequantization may hold at once."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return max(p.numel() * 4 for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)


@contextlib.contextmanager
def saved_for_backward(resident: set[int]) -> Iterator[dict[int, int]]:
    """Storage pointer -> bytes of every tensor autograd packs for backward inside the block, weights excluded."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in resident:
            saved.setdefault(ptr, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def step_peak(step: Callable[[], object], model: nn.Module) -> int:
    """Peak bytes of tensors alive during one step; weights and buffers are not counted."""
    resident = pointers(list(model.parameters()) + list(model.buffers()))
    gc.collect()
    mode = LiveBytes(resident)
    with mode:
        step()
    return mode.peak
