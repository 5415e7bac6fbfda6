"""The `cache_salt` of each adapter's requests behind `softprompt-plus serve`: vLLM's prefix cache shares a block only
between requests of the same salt, so each adapter gets its own, derived from a secret only this front process holds
(an HMAC of the adapter's content hash): no client that reaches vLLM some other way can name an adapter's blocks.

A KV adapter's salt is retired, for good, once a request under it ran without its KV prompt (the connector refused
it, the engine lost it or failed it): the blocks that request computed from the placeholders are cached under that
salt, so the adapter moves to a fresh one (docs/architecture.md, "Serving KV prompts: no poisoned blocks")."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import Counter
from typing import Optional

SALT_HEX = 32  # 128 bits: the connector takes 16 to 128 characters


class Salts:
    """Each adapter's current salt, by its content hash (`Adapter.content`)."""

    def __init__(self, secret: Optional[bytes] = None):
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._moves: Counter = Counter()  # content hash -> how many times its salt was retired
        self._lock = threading.Lock()  # taken for a dict operation only: the event loop and worker threads read it

    def current(self, content: str) -> str:
        """The salt requests for the adapter of content hash `content` carry now."""
        with self._lock:
            moves = self._moves[content]
        return self._derive(f"adapter:{content}:{moves}")

    def retire(self, content: str, salt: str) -> bool:
        """`salt`, which a request for `content` ran under without its KV prompt, is never sent again: later
        requests get a fresh one. False where the adapter had moved on already (several refusals under one salt
        move it once)."""
        with self._lock:
            if self._derive(f"adapter:{content}:{self._moves[content]}") != salt:
                return False
            self._moves[content] += 1
            return True

    def probe(self) -> str:
        """A salt no adapter has, for a health probe: a refused probe leaves its placeholders' blocks to no one."""
        return self._derive(f"probe:{secrets.token_hex(16)}")

    def _derive(self, text: str) -> str:
        return hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()[:SALT_HEX]
