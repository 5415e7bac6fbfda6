"""`SoftPromptBank`: the module that owns every adapter's `[N, D]` prompt and keeps it a float32 leaf."""

from __future__ import annotations

from typing import Optional

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn


class SoftPromptBank(nn.Module, BaseTunerLayer):
    """One float32 `[N, D]` parameter per adapter name, and for a reparameterised adapter its float32 encoder.

    Being a `BaseTunerLayer` lets PEFT's own adapter bookkeeping (`set_adapter`, `disable_adapter`,
    `get_model_status`, `delete_adapter`) treat it like any tuner layer.
    """

    adapter_layer_names = ("softprompt_plus_prompt", "softprompt_plus_encoder")  # the prefix marks adapter weights

    def __init__(self) -> None:
        super().__init__()
        self.softprompt_plus_prompt = nn.ParameterDict()
        self.softprompt_plus_encoder = nn.ModuleDict()
        self._active_adapter = []
        self._disable_adapters = False
        self.merged_adapters = []

    def add(self, adapter_name: str, values: torch.Tensor, trainable: bool, encoder: Optional[nn.Module]) -> None:
        # `clone` + float32: the prompt never aliases `wte` (whose steps would then edit the tied lm_head too).
        self.prompts[adapter_name] = nn.Parameter(values.detach().to(torch.float32).clone(), requires_grad=trainable)
        if encoder is not None:
            self.encoders[adapter_name] = encoder.requires_grad_(trainable)

    def values(self, adapter_name: str) -> torch.Tensor:
        """The `[N, D]` float32 prompt the model reads: the leaf, or its encoder's output while one is attached."""
        prompt = self.prompts[adapter_name]
        encoder = self.encoders[adapter_name] if adapter_name in self.encoders else None
        return prompt if encoder is None else encoder(prompt)

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
        for param in self.trainable(adapter_name).values():
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
