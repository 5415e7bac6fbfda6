"""What a request asks of the KV connector (`vllm_kv.py`) and whether it may be served: its `kv_transfer_params` and
`cache_salt` read whatever JSON a client put in them (a raise inside vLLM stops the engine for every request), and the
salts a KV prompt may no longer be served under, because a block computed from the placeholders may be cached under
them (docs/architecture.md, "Serving KV prompts: no poisoned blocks")."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from .._names import VLLM_KV_PARAM as PARAM
from .kv_connector_core import HASH

SALT = re.compile(r"[A-Za-z0-9_-]{16,128}")  # whole strings only (fullmatch)
SALTS_KEPT = 1 << 16  # per table of `SaltBook`: the front moves an adapter to a new salt only after a refusal


@dataclass(frozen=True)
class Named:
    """The KV prompt a request names and the cache salt its blocks are hashed with."""

    digest: str
    salt: str


def named_prompt(kv_transfer_params: Any, cache_salt: Any) -> tuple[Optional[Named], Optional[str]]:
    """What a request's fields ask of the connector, whatever JSON a client put in them: `(Named, None)` for a KV
    prompt to serve, `(None, reason)` for fields that name one wrongly, `(None, None)` for a request that isn't the
    connector's (no `kv_transfer_params`, or none of its key). Never raises: a raise inside vLLM stops the engine."""
    if kv_transfer_params is None:
        return None, None
    if not isinstance(kv_transfer_params, dict):
        return None, f"`kv_transfer_params` must be an object, got {_show(kv_transfer_params)}"
    if PARAM not in kv_transfer_params:
        return None, None
    digest = kv_transfer_params[PARAM]
    if not isinstance(digest, str) or not HASH.fullmatch(digest):
        return None, f"`kv_transfer_params.{PARAM}` must be a content hash (16 to 64 lowercase hex digits), got " + (
            _show(digest)
        )
    if not isinstance(cache_salt, str) or not SALT.fullmatch(cache_salt):
        return None, (
            f"a KV request must carry a `cache_salt` of 16 to 128 letters, digits, '-' or '_' (its blocks would be "
            f"shared with requests that never read the prompt), got {_show(cache_salt)}"
        )
    return Named(digest, cache_salt), None


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


class SaltBook:
    """Which cache salts the connector may serve a KV prompt under. vLLM's prefix cache hashes a block by its token
    ids and its request's `cache_salt`, and every KV prompt's placeholders are the same ids: a block computed from
    the placeholders (a request refused, a load failed on a worker, a request that named no KV prompt) looks to a
    later request of the same salt like positions already in the cache. So a salt is retired, for good, once a
    request under it ran without its KV prompt, and a salt first used without one is never served one. Each table
    is bounded (oldest out): the front never reuses a retired salt, and a salt forgotten is one nobody sends."""

    def __init__(self, limit: int = SALTS_KEPT):
        self._limit = limit
        self._retired: OrderedDict[str, str] = OrderedDict()  # salt -> why
        self._with: OrderedDict[str, None] = OrderedDict()  # salts KV prompts were served under
        self._without: OrderedDict[str, None] = OrderedDict()  # salts of requests that named no KV prompt

    def why_not(self, salt: str) -> Optional[str]:
        """Why a KV prompt can't be served under `salt` (None: it can)."""
        if salt in self._retired:
            return (
                f"cache_salt {salt[:12]}... was retired ({self._retired[salt]}): its blocks may hold positions "
                "computed without the KV prompt. `softprompt-plus serve` moves the adapter to a fresh salt: retry"
            )
        if salt in self._without:
            return f"cache_salt {salt[:12]}... was used by a request that named no KV prompt: its blocks are not one"
        return None

    def served(self, salt: str) -> None:
        _remember(self._with, salt, None, self._limit)

    def retire(self, salt: Any, why: str) -> None:
        if isinstance(salt, str):
            self._with.pop(salt, None)
            _remember(self._retired, salt, why, self._limit)

    def without_prompt(self, salt: Any) -> None:
        """A request that named no KV prompt ran under `salt` (if it is one)."""
        if not isinstance(salt, str) or not salt:
            return
        if salt in self._with:
            self.retire(salt, "a request that named no KV prompt ran under it")
        _remember(self._without, salt, None, self._limit)


def _remember(table: OrderedDict, key: str, value, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
