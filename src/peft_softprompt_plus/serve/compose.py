"""Compositions by name behind `softprompt-plus serve --compose NAME=a,b`: loaded KV adapters served as one prompt
under a name of their own, their caches concatenated in order and their text starts summed, as our
`set_adapter(["a", "b"])` reads them; published for vLLM's connector like any KV adapter, and rebuilt whenever an
adapter they name is replaced."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .fit import at_n
from .requests import FrontError, check_adapter_name
from .share import Share


def composed(name: str, parts: tuple[str, ...], adapters: dict, model_config) -> tuple[torch.Tensor, Optional[int]]:
    """The composition `name` of the KV adapters `parts` (records of `adapters`, in order): their `[layers, 2, Hkv,
    N1+N2+..., hd]` caches concatenated as stored, and its text start, the sum of theirs (each cache keeps its own
    positions: `SoftPromptPlusModel.text_start`); then folded as one to start the text at N1+N2+...: a part folded
    alone would be off by the others' shifts. Returns the values vLLM reads and the start they were folded from."""
    records = [adapters.get(part) for part in parts]
    if len(parts) < 2:
        raise FrontError(400, f"`--compose` {name}: a composition names two or more KV adapters, got {list(parts)}.")
    wrong = [p for p, r in zip(parts, records, strict=True) if r is None or r.kv_values is None]
    if wrong:
        kv = sorted(k for k, r in adapters.items() if r.kv_values is not None)
        raise FrontError(
            400,
            f"`--compose` {name}={','.join(parts)}: {wrong} is not a loaded KV adapter (prompt_level='kv'; a "
            f"composition doesn't compose). The KV adapters loaded: {kv}.",
        )
    formats = {r.chat_format for r in records}
    if len(formats) > 1:
        raise FrontError(
            400, f"`--compose` {name}: its adapters format chat differently ({sorted(formats)}): compose ones alike."
        )
    values = torch.cat([r.kv_values for r in records], dim=-2)  # [layers, 2, Hkv, sum N, hd]
    start = sum(r.kv_start for r in records)
    return at_n(values, start, model_config)


def composition(name: str, parts: tuple[str, ...], adapters: dict, model_config, publish: Callable):
    """The served record of composition `name` (`composed`), its values published with `publish(config, values)`
    (which returns their content hash): the first part's record with the composition's name, positions and hash."""
    values, folded_from = composed(name, parts, adapters, model_config)
    n = values.shape[-2]
    digest = publish({"prompt_level": "kv", "num_virtual_tokens": n, "kv_text_start": n}, values)
    folders = ", ".join(adapters[p].folder for p in parts)
    fields = dict(num_virtual_tokens=n, positions=n, content=digest, kv=digest, kv_values=None, kv_start=None)
    return dataclasses.replace(
        adapters[parts[0]], name=name, folder=folders, folded_from=folded_from, parts=parts, **fields
    )


def recomposed(adapters: dict, compositions: dict, changed: str, model_config, publish: Callable) -> dict:
    """The compositions that name adapter `changed`, rebuilt from `adapters` (where it was just replaced)."""
    return {
        name: composition(name, parts, adapters, model_config, publish)
        for name, parts in compositions.items()
        if changed in parts
    }


class Compositions:
    """The front's compositions by name, and the served records as adding one, replacing an adapter or removing one
    changes them. It holds no adapters: each method takes the served records and returns the new ones, which the front
    swaps in; every method runs under the front's lock, so `parts` changes with the records it matches. Files go
    through `share`: each method appends the hashes it published to `held`, which `release` lets go."""

    def __init__(self, share: Share, kv_share: Optional[str], model_config, base_name: str):
        self.share, self.kv_share, self.model_config, self.base_name = share, kv_share, model_config, base_name
        self.parts: dict[str, tuple[str, ...]] = {}  # composition name -> its KV adapters, in order

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def added(self, name: str, parts, adapters: dict, held: list) -> dict:
        """`adapters` with the loaded KV adapters `parts` served composed under `name` (`--compose NAME=a,b`)."""
        check_adapter_name(name, self.base_name, "`--compose` name")
        if name in adapters:
            raise FrontError(400, f"`--compose` name {name!r} is taken: use a name no adapter has.")
        adapter = composition(name, tuple(parts), adapters, self.model_config, self._publisher(held))
        self.parts = {**self.parts, name: adapter.parts}
        return {**adapters, name: adapter}

    def replaced(self, name: str, adapter, adapters: dict, held: list) -> dict:
        """`adapters` with `adapter` (its file published) served as `name` and the compositions that name it rebuilt
        from it; a composition of that name is replaced by it. A refusal changes nothing."""
        parts = {k: v for k, v in self.parts.items() if k != name}
        changed = {**adapters, name: adapter}
        rebuilt = recomposed(changed, parts, name, self.model_config, self._publisher(held))
        self.parts = parts
        return {**changed, **rebuilt}

    def removed(self, name: str, adapters: dict) -> dict:
        """`adapters` without `name`, refused (409) while a composition names it."""
        using = sorted(k for k, parts in self.parts.items() if name in parts)
        if using:
            raise FrontError(409, f"adapter {name!r} is composed in {using}: remove those compositions first.")
        self.parts = {k: v for k, v in self.parts.items() if k != name}
        return {k: v for k, v in adapters.items() if k != name}

    def release(self, held: list) -> None:
        """The files `held` published let go (and those of what was replaced removed, unless a request reads them):
        called from a worker thread, so the files go before the `PUT` or `--compose` answers."""
        for digest in held:
            self.share.release(digest, wait=True)

    def _publisher(self, held: list) -> Callable:
        def publish(config: dict, values: torch.Tensor) -> str:
            held.append(self.share.publish(self.kv_share, config, values))  # held until `release`
            return held[-1]

        return publish
