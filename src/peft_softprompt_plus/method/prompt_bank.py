"""`SoftPromptBank`: the module that owns every adapter's prompt and keeps it a float32 leaf: an input prompt's
`[N, D]` rows, or a KV prompt's `[layers, 2, Hkv, N, hd]` keys and values (its first positions, the attention sink,
in a frozen tensor of their own). The positions are dimension -2 of both."""

from __future__ import annotations

import os
import warnings
from typing import Optional

import peft
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .._moved import user_stacklevel

_LIBRARIES = tuple(os.path.dirname(m.__file__) for m in (torch, peft))  # frames a deprecation warning looks past


class SoftPromptBank(nn.Module, BaseTunerLayer):
    """One float32 prompt parameter per adapter name, for a reparameterised adapter its float32 encoder, and for a KV
    prompt with frozen leading positions those positions (`sinks`).

    Being a `BaseTunerLayer` lets PEFT's own adapter bookkeeping (`set_adapter`, `disable_adapter`,
    `get_model_status`, `delete_adapter`) treat it like any tuner layer.
    """

    adapter_layer_names = ("softprompt_plus_prompt", "softprompt_plus_encoder")  # the prefix marks adapter weights
    # Per adapter too, but never made trainable by PEFT's `set_adapter` (it sets every `adapter_layer_names` entry).
    other_param_names = ("softprompt_plus_sink", "softprompt_plus_origin")

    def __init__(self) -> None:
        super().__init__()
        self.softprompt_plus_prompt = nn.ParameterDict()
        self.softprompt_plus_encoder = nn.ModuleDict()
        self.softprompt_plus_sink = nn.ParameterDict()
        self.softprompt_plus_origin = nn.ParameterDict()
        self._active_adapter = []
        self._disable_adapters = False
        self.merged_adapters = []

    def add(
        self,
        adapter_name: str,
        values: torch.Tensor,
        trainable: bool,
        encoder: Optional[nn.Module],
        frozen: int = 0,
        origins: Optional[torch.Tensor] = None,
    ) -> None:
        """`values` `[..., N, last]`; its first `frozen` positions are kept apart, frozen (a KV prompt's sink).
        `origins` `[layers, Hkv, N]`: each entry's context position, for a KV prompt chosen per layer and head."""
        # `clone` + float32: the prompt never aliases `wte` (whose steps would then edit the tied lm_head too).
        values = values.detach().to(torch.float32)
        self.prompts[adapter_name] = nn.Parameter(values[..., frozen:, :].clone(), requires_grad=trainable)
        if frozen:
            self.sinks[adapter_name] = nn.Parameter(values[..., :frozen, :].clone(), requires_grad=False)
        if encoder is not None:
            self.encoders[adapter_name] = encoder.requires_grad_(trainable)
        if origins is not None:  # an int table, never trained (a Parameter only so that PEFT saves it per adapter)
            self.origins[adapter_name] = nn.Parameter(origins.long().to(values.device), requires_grad=False)

    def drop(self, adapter_name: str) -> None:
        """Everything held for `adapter_name` (a failed attach's half-added adapter)."""
        for table in (self.prompts, self.encoders, self.sinks, self.origins):
            if adapter_name in table:
                del table[adapter_name]

    def values(self, adapter_name: str) -> torch.Tensor:
        """The float32 prompt the model reads: the leaf (after a KV prompt's frozen positions), or its encoder's
        output while one is attached."""
        prompt = self.prompts[adapter_name]
        encoder = self.encoders[adapter_name] if adapter_name in self.encoders else None
        prompt = prompt if encoder is None else encoder(prompt)
        if adapter_name in self.sinks:
            return torch.cat([self.sinks[adapter_name].to(prompt.device), prompt], dim=-2)  # [..., N, last]
        return prompt

    def trainable(self, adapter_name: str) -> dict[str, torch.Tensor]:
        """Every tensor an optimizer trains for `adapter_name`: the prompt, then its encoder's parameters."""
        out = {adapter_name: self.prompts[adapter_name]}
        if adapter_name in self.encoders:
            out.update({f"{adapter_name}.encoder.{k}": p for k, p in self.encoders[adapter_name].named_parameters()})
        return out

    def _apply(self, fn, recurse: bool = True):
        # `model.half()` / `.to(torch.bfloat16)` move the prompt but must not lower it: GradScaler refuses fp16
        # gradients and small updates vanish in bf16. Take only the device from `fn` and copy back the float32 values
        # we held (lifting fn's fp16 result would round them). `.data` assignment keeps the optimizer's leaf.
        kept = {name: param.data for name, param in self.named_parameters()}
        super()._apply(fn, recurse=recurse)
        for name, param in self.named_parameters():
            if param.dtype != torch.float32:
                param.data = kept[name].to(device=param.device)
        return self

    @property
    def prompts(self) -> nn.ParameterDict:
        """adapter name -> its float32 `[N, D]` prompt."""
        return self.softprompt_plus_prompt

    @property
    def origins(self) -> nn.ParameterDict:
        """adapter name -> each entry's context position `[layers, Hkv, N]` (long), where chosen per layer and head."""
        return self.softprompt_plus_origin

    @property
    def sinks(self) -> nn.ParameterDict:
        """adapter name -> a KV prompt's frozen leading positions `[layers, 2, Hkv, F, hd]` (absent when F is 0)."""
        return self.softprompt_plus_sink

    @property
    def encoders(self) -> nn.ModuleDict:
        """adapter name -> its float32 encoder (reparameterised adapters while they train)."""
        return self.softprompt_plus_encoder

    @property
    def weight(self):
        # BaseTunerLayer.weight looks for a base layer and recurses forever on a module that has none.
        raise AttributeError("SoftPromptBank has no `weight`; the prompts are in `.prompts[adapter_name]`.")

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        # PEFT calls this after a `low_cpu_mem_usage` load; the bank has no base layer, and the prompt is moved to
        # the embedding's device at the point of use, so only the float32 invariant needs restating.
        held = [
            *self.trainable(adapter_name).values(),
            *([self.sinks[adapter_name]] if adapter_name in self.sinks else []),
        ]
        for param in held:
            if param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise ValueError(
            "A soft prompt cannot be merged into the model's weights: it is an input, not a weight delta. Keep the "
            "adapter attached, or call `unload()` to get the untouched base model back."
        )

    def unmerge(self) -> None:  # nothing is ever merged
        return None

    def extra_repr(self) -> str:
        return ", ".join(
            f"{name}: {list(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            + (" (residual encoder)" if name in self.encoders else "")
            + (f" (after {self.sinks[name].shape[-2]} frozen)" if name in self.sinks else "")
            for name, p in self.prompts.items()
        )


class LegacyBankView:
    """What 0.1's `model.base_model.softprompt_plus` was, for code written against it: `.prompt[name]`, the same
    Parameters as `prompts`. A plain object, not a module, so nothing is registered twice or saved under its name."""

    def __init__(self, bank: SoftPromptBank) -> None:
        self._bank = bank

    @property
    def prompt(self) -> nn.ParameterDict:
        return self._bank.prompts


def legacy_view(bank: SoftPromptBank) -> LegacyBankView:
    """`model.base_model.softprompt_plus` (0.1's accessor), with a FutureWarning at the user's line: a
    DeprecationWarning would be silent outside `__main__` (PEP 565); the frame walk looks past PEFT's attribute
    forwarding too."""
    warnings.warn(
        "`model.base_model.softprompt_plus.prompt[name]` is deprecated and will be removed in 0.4.0; use "
        "`model.base_model.prompt(name)`, the same float32 Parameter.",
        FutureWarning,
        stacklevel=user_stacklevel(_LIBRARIES),
    )
    return LegacyBankView(bank)
