"""KV prompts at the forward: the attention layers a prompt's keys/values go to (`KVLayout`, read off the model once
at attach), a `PromptKV` straight from a KV prompt's stored keys/values with no prompt pass, and the passes of a batch
that mixes KV and input prompts."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from . import paths
from .prompt_kv import PromptKV


@dataclass(frozen=True)
class KVLayout:
    """The attention layers of a model, in the order a forward calls them, and the shape of the keys/values each one
    reads: `heads` key/value heads of `head_dim`. `uniform` is False when the layers differ (then no KV prompt)."""

    modules: tuple[nn.Module, ...]
    heads: int
    head_dim: int
    uniform: bool

    @classmethod
    def recorded(cls, layers: dict) -> Optional["KVLayout"]:
        """From a prompt pass's record (`PromptKV.layers`: module -> `([1, Hkv, n, hd], [1, Hkv, n, hd_v])`)."""
        if not layers:
            return None
        shapes = {(k.shape[1], k.shape[3], v.shape[1], v.shape[3]) for k, v in layers.values()}
        heads, head_dim, value_heads, value_dim = next(iter(shapes))
        uniform = len(shapes) == 1 and (heads, head_dim) == (value_heads, value_dim)
        return cls(tuple(layers), heads, head_dim, uniform)

    def shape(self, positions: int) -> tuple[int, int, int, int, int]:
        """A KV prompt's stored shape: `[layers, 2 (key, value), Hkv, N, hd]`."""
        return (len(self.modules), 2, self.heads, positions, self.head_dim)

    def why_not(self) -> Optional[str]:
        """Why a KV prompt can't be stored for these layers, or None."""
        if self.uniform:
            return None
        return (
            "its attention layers read keys and values of different shapes (key/value heads or head sizes differ "
            "between layers, or between keys and values), and a KV prompt is stored as one [layers, 2, Hkv, N, hd] "
            "tensor"
        )


def record_of(layers: dict, layout: KVLayout) -> torch.Tensor:
    """A prompt pass's record as a KV prompt's values: `[layers, 2, Hkv, n, hd]` float32, row 0 of each layer's."""
    missing = [m for m in layout.modules if m not in layers]
    if missing:
        raise RuntimeError(f"The prompt pass recorded no keys/values for {len(missing)} attention layer(s).")
    return torch.stack([torch.stack([layers[m][0][0], layers[m][1][0]]) for m in layout.modules]).float()


def prompt_kv(values: torch.Tensor, layout: KVLayout, start: int) -> PromptKV:
    """A one-prompt `PromptKV` reading `values` `[layers, 2, Hkv, N, hd]` (in the dtype the attention computes in),
    its text at `start`: each layer's keys/values are views of it, so their gradient reaches the stored float32 leaf
    through one cast."""
    layers = {
        module: (values[i, 0].unsqueeze(0), values[i, 1].unsqueeze(0))  # [1, Hkv, N, hd] each
        for i, module in enumerate(layout.modules)
    }
    device = values.device
    return PromptKV(
        torch.tensor([values.shape[-2]], device=device), layers=layers, starts=torch.tensor([start], device=device)
    )


def prompt_passes(
    model: nn.Module,
    row_prompts: paths.RowPrompts,
    prompt_positions_in_text: int,
    layout,
    stored_input_passes: Optional[tuple] = None,
) -> tuple[PromptKV, Optional[torch.Tensor]]:
    """The `PromptKV` of a batch's prompts in their order, and each prompt's last output `[A, D]` (zeros for a KV
    prompt, which has none; None when no prompt is an input prompt): the input prompts through one prompt pass (or
    `stored_input_passes`, their stored `(PromptKV, [A_in, D])`), the KV prompts as they are stored.
    `prompt_positions_in_text`: each input prompt's last positions that run in the text pass instead (0 or 1)."""
    if not any(row_prompts.kv_flags):
        if stored_input_passes is not None:
            return stored_input_passes
        return paths.prompt_pass(model, row_prompts, prompt_positions_in_text)
    inputs = row_prompts.inputs()
    # Input prompts whose every position rides with the text (N=1, its position in the text) leave no pass to run.
    input_pass_needed = any(p.shape[-2] > prompt_positions_in_text for p in inputs.prompts)
    input_passes = stored_input_passes
    if input_passes is None and input_pass_needed:
        input_passes = paths.prompt_pass(model, inputs, prompt_positions_in_text)
    input_kvs = iter(input_passes[0].split() if input_passes else [])  # one PromptKV per input prompt, in order
    input_lasts = iter(input_passes[1] if input_passes else [])  # [D] each
    # Any KV prompt gives the dtype and device of what no input pass produced: an empty prompt, zero last outputs.
    first_kv_prompt = next(p for p, kv in zip(row_prompts.prompts, row_prompts.kv_flags, strict=True) if kv)
    width = model.get_input_embeddings().embedding_dim
    prompt_kvs, last_outputs = [], []
    for prompt, is_kv, start in zip(
        row_prompts.prompts, row_prompts.kv_flags, row_prompts.starts("cpu").tolist(), strict=True
    ):
        if is_kv or not input_passes:  # a KV prompt as stored; an input prompt with no position left: no keys at all
            keys_values = prompt if is_kv else first_kv_prompt[..., :0, :]  # [layers, 2, Hkv, N, hd]
            prompt_kvs.append(prompt_kv(keys_values, layout, start))
            last_outputs.append(first_kv_prompt.new_zeros(width))
        else:
            prompt_kvs.append(next(input_kvs))
            last_outputs.append(next(input_lasts))
    # Without an input prompt no row predicts text token 0 from a prompt: no last outputs.
    return PromptKV.stack(prompt_kvs, row_prompts.rows), torch.stack(last_outputs) if input_passes else None  # [A, D]


def _quantized(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "bitsandbytes"


@contextlib.contextmanager
def _modes(model: nn.Module, training: Callable[[nn.Module], bool]):
    """Each module's `training` flag set by `training(module)` while the block runs, restored after."""
    modes = [(m, m.training) for m in model.modules()]
    for module in model.modules():
        module.training = training(module)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def dropout_off(model: nn.Module):
    """Every module in eval mode (no dropout) but bitsandbytes' layers: an eval-mode forward without autograd makes
    them repack 4-bit CPU weights into an inference-only form, and they have no dropout."""
    return _modes(model, _quantized)


def probe_layout(model: nn.Module) -> Optional[KVLayout]:
    """`model`'s attention layers and their keys' shapes when they take the prompt through the registry (GPT-2,
    Llama...), else None (Bloom, Falcon)."""
    embedding = model.get_input_embeddings()
    probe = embedding.weight.new_zeros(1, embedding.embedding_dim)  # [1, D]
    try:
        # Training mode: an eval-mode forward makes bitsandbytes repack 4-bit CPU weights into an inference-only form.
        with torch.no_grad(), _modes(model, lambda module: True):
            record, _ = paths.prompt_pass(model, paths.RowPrompts([probe]), in_text=0)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None
    return KVLayout.recorded(record.layers)
