"""Which soft prompt each row of a batch reads: PEFT's mixed-batch convention, `adapter_names=[name per row]`, with
`"__base__"` for a row without a prompt. Validated here, once, for `forward` and `generate` alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

BASE = "__base__"


Entry = Union[str, tuple[str, ...]]  # one adapter, or KV adapters composed in this order


@dataclass(frozen=True)
class Route:
    """`adapters`: the prompts a batch reads, in order of first use, each an adapter name or a tuple of KV adapters'
    names read as one (their caches concatenated); `rows[b]` indexes them (-1: no prompt). `rows=None` when every row
    reads `adapters[0]`, the one-prompt fast path. No adapters: the base model alone."""

    adapters: tuple[Entry, ...]
    rows: Optional[torch.Tensor] = None  # [B]


def names_of(entry: Entry) -> tuple[str, ...]:
    """The adapter names an entry reads."""
    return entry if isinstance(entry, tuple) else (entry,)


def composition(names, known: Sequence[str], kv: Sequence[str], where: str) -> Entry:
    """A list of KV adapter names read as one prompt (Cartridges' composition), checked; one name is that adapter."""
    odd = [n for n in names if not isinstance(n, str)]
    if not names or odd:
        raise ValueError(f"{where} composes adapters by a list of their names (str), got {list(names)!r}.")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"{where} names {unknown[0]!r}, which is not an adapter of this model; adapters: {list(known)}."
        )
    if len(names) == 1:
        return names[0]
    inputs = list(dict.fromkeys(n for n in names if n not in kv))
    if inputs:
        what = "is an input adapter" if len(inputs) == 1 else "are input adapters"
        raise ValueError(
            f"{where} composes {list(names)!r}, but {inputs} {what}: only KV adapters (`prompt_level='kv'`) compose, "
            "each cache keeping its own positions. Route input adapters one per row."
        )
    return tuple(names)


def route_rows(
    adapter_names: Optional[Sequence],
    active: Optional[Entry],
    batch: int,
    known: Sequence[str],
    kv: Sequence[str] = (),
) -> Route:
    """The route for `adapter_names` (None: every row reads `active`, which may itself be None); an entry that is a
    list of KV adapters' names reads them composed (`kv`: the KV adapters' names)."""
    if adapter_names is None:
        return Route(() if active is None else (active,))
    if isinstance(adapter_names, str) or not isinstance(adapter_names, (list, tuple)):
        raise ValueError(
            f"`adapter_names` must be a list with one adapter name per row, got {type(adapter_names).__name__} "
            f"{adapter_names!r}. Pass e.g. adapter_names=['task_a', '{BASE}', ...] (`'{BASE}'`: no prompt)."
        )
    odd = [n for n in adapter_names if not isinstance(n, (str, list, tuple))]
    if odd:
        raise ValueError(
            f"`adapter_names` must hold adapter names (str), or lists of KV adapters' names to compose, got "
            f"{odd[0]!r} ({type(odd[0]).__name__}) among {list(adapter_names)!r}."
        )
    if len(adapter_names) != batch:
        raise ValueError(
            f"`adapter_names` has {len(adapter_names)} entries but the batch has {batch} rows. Pass one name per row."
        )
    unknown = sorted({repr(n) for n in adapter_names if isinstance(n, str) and n != BASE and n not in known})
    if unknown:
        raise ValueError(
            f"`adapter_names` names {', '.join(unknown)}, which is not an adapter of this model; adapters: "
            f"{list(known)} (or '{BASE}' for a row without a prompt)."
        )
    adapter_names = [
        n if isinstance(n, str) else composition(n, known, kv, f"`adapter_names` row {i}")
        for i, n in enumerate(adapter_names)
    ]
    adapters = tuple(dict.fromkeys(n for n in adapter_names if n != BASE))
    if len(adapters) == 1 and BASE not in adapter_names:
        return Route(adapters)
    if not adapters:
        return Route(())
    index = {name: i for i, name in enumerate(adapters)}
    return Route(adapters, torch.tensor([index.get(n, -1) for n in adapter_names], dtype=torch.long))


# PEFT's own sentence for an unknown name, per method: code (PEFT's tests among it) matches on it.
_PEFT_WORDING = {"set_adapter": "Adapter {} not found", "delete_adapter": "Adapter {} does not exist"}


def unknown_adapter(adapter_name, known: Sequence[str], method: str) -> ValueError:
    """PEFT's message for an unknown adapter name, then the adapters there are."""
    sentence = _PEFT_WORDING.get(method, "Adapter {} does not exist").format(adapter_name)
    return ValueError(
        f"{sentence}; adapters: {list(known)} (`adapter_name`={adapter_name!r}). Pass one of those names."
    )


def check_adapter_name(adapter_name, known: Sequence[str], method: str) -> None:
    """One existing adapter name, for `set_adapter`, `delete_adapter` and `prompt`."""
    if not isinstance(adapter_name, str):
        raise ValueError(
            f"`{method}` takes one adapter name (str), got {type(adapter_name).__name__} {adapter_name!r}. One soft "
            "prompt is active at a time (KV adapters compose: `set_adapter(['a', 'b'])`); to run several in one batch "
            "pass `adapter_names=[name per row]` to the forward or generate, and to train several at once call "
            "`model.set_requires_grad([...])`."
        )
    if adapter_name not in known:
        raise unknown_adapter(adapter_name, known, method)


def check_routable(route_: Route, concat: bool) -> None:
    """Concatenation runs one prompt for the whole batch: a batch that mixes prompts can't take it."""
    if concat and route_.rows is not None:
        raise ValueError(
            f"`adapter_names` mixes prompts ({list(route_.adapters)} and rows without one) in one batch, which needs "
            "the prompt at the attention; this model runs `forward_path='concat'` (set by the config, or because "
            "its attention can't take the prompt). Split the batch by adapter, or use forward_path='auto'."
        )
