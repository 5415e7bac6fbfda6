"""Tied weights: find parameters shared between modules (GPT-2's `wte`/`lm_head`) and refuse to train them."""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names that refer to one and the same `Parameter` object, e.g. `[transformer.wte.weight, lm_head.weight]`."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _module_matches(module_name: str, wanted: str) -> bool:
    return module_name == wanted or module_name.endswith("." + wanted)


def refuse_tied_training(model: nn.Module, modules_to_save: Optional[Iterable[str]]) -> None:
    """Raise if `modules_to_save` names a module that holds a tied weight."""
    if not modules_to_save:
        return
    groups = tied_parameter_groups(model)
    for wanted in modules_to_save:
        for group in groups:
            hits = [p for p in group if _module_matches(p.rpartition(".")[0], wanted)]
            if hits:
                raise ValueError(
                    f"`modules_to_save` contains {wanted!r}, whose weight {hits[0]} is tied to "
                    f"{[p for p in group if p != hits[0]]}: they are one Parameter, so training one trains the "
                    "other, every step edits the output layer, and the adapter would have to save the whole "
                    "vocabulary matrix. Remove it from `modules_to_save`; to give the model more capacity, raise "
                    "`num_virtual_tokens` instead, or untie the weights in a copy of the model you own."
                )
