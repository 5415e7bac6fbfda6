"""The evidence gradient checks read: the prompts, the base's parameters, the loss, the gradients that arrived, and
the optimizer; gathered from a model without running it (`gradient_flow` runs it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from .._names import BANK
from ..method.prompt_bank import SoftPromptBank

_NOT_RUN = object()  # evidence slot for "this caller never ran a loss" (the Trainer callback)


@dataclass
class Evidence:
    model: nn.Module
    prompts: dict[str, torch.Tensor]
    base: list[tuple[str, torch.Tensor]]  # every parameter that is not a soft prompt
    allowed: set[int]  # ids of base parameters meant to train (PEFT `modules_to_save` copies)
    whole: set[str] = field(default_factory=set)  # a residual encoder's weights: judged whole, not row by row
    grad_mode: Optional[str] = None  # the context that disabled gradients; None when they are enabled
    loss: Any = _NOT_RUN
    outputs_graph: Optional[bool] = None
    grads: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # a name absent: not measured
    moved: dict[str, bool] = field(default_factory=dict)  # did an optimizer step change it (callback only)
    optimizer: Any = None


# ---------------------------------------------------------------------------------------------- gathering evidence


def _banks(model: nn.Module) -> list[SoftPromptBank]:
    return [m for m in model.modules() if isinstance(m, SoftPromptBank)]


_NAMING = (  # how a user's `prompt=` argument becomes named tensors
    (Mapping, lambda prompt: {str(k): v for k, v in prompt.items()}),
    ((list, tuple), lambda prompt: {f"prompt[{i}]": v for i, v in enumerate(prompt)}),
    (object, lambda prompt: {"prompt": prompt}),
)


def prompts_of(model: nn.Module, prompt=None) -> dict[str, torch.Tensor]:
    """The tensors whose gradient is checked: `prompt` as given, else each active softprompt-plus adapter's."""
    if prompt is not None:
        named = next(name for kinds, name in _NAMING if isinstance(prompt, kinds))(prompt)
        bad = {k: type(v).__name__ for k, v in named.items() if not isinstance(v, torch.Tensor)}
        if bad or not named:
            raise TypeError(
                f"`prompt` must be a tensor, a list of tensors or a dict of them, got {type(prompt).__name__} "
                f"(non-tensors: {bad}). Pass the tensor(s) your model learns."
            )
        return named
    found = {
        name: tensor
        for bank in _banks(model)
        for n in bank.active_adapters
        if n in bank.prompts
        for name, tensor in bank.trainable(n).items()
    }
    if not found:
        raise ValueError(
            f"`model` ({type(model).__name__}) has no active softprompt-plus prompt. Attach one with "
            "`get_peft_model(model, SoftPromptPlusConfig(...))`, or for a custom module pass `prompt=` the tensor(s) "
            "it learns."
        )
    return found


def static_evidence(model: nn.Module, prompts: dict[str, torch.Tensor], optimizer) -> Evidence:
    own = {id(p) for p in prompts.values()} | {id(p) for bank in _banks(model) for p in bank.parameters()}
    allowed = {
        id(p)
        for m in model.modules()
        if isinstance(m, AuxiliaryTrainingWrapper)
        for attr in m.adapter_layer_names
        for p in getattr(m, attr).parameters()
    }
    base = [(n, p) for n, p in model.named_parameters() if id(p) not in own]
    encoders = {id(p) for bank in _banks(model) for p in bank.encoders.parameters()}
    whole = {name for name, p in prompts.items() if id(p) in encoders}  # a dead ReLU unit has a zero row
    return Evidence(model=model, prompts=prompts, base=base, allowed=allowed, whole=whole, optimizer=optimizer)


def has_graph(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def tuners_of(model: nn.Module) -> list[nn.Module]:
    """The softprompt-plus tuners inside `model` (they own a SoftPromptBank)."""
    return [m for m in model.modules() if isinstance(getattr(m, BANK, None), SoftPromptBank)]
