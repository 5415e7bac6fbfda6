"""`GET /health` on `softprompt-plus serve`: whether requests can be served now (the engine answers and serves the
model; where KV adapters are loaded, their share files are there and vLLM's KV connector applies them), checked
against the engine as it is at most every `--health-interval` seconds; between checks the last answer stands."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Optional

import httpx

from . import kv_fields
from .front import Front
from .requests import FrontError
from .upstream import Upstream


class Health:
    """The checks of one front and its engine."""

    def __init__(self, front: Front, engine: Upstream, upstream_model: str, interval: float):
        self.front, self.engine, self.upstream_model, self.interval = front, engine, upstream_model, interval
        self._last: Optional[tuple[float, tuple[int, dict]]] = None  # (when, the last check's answer)
        self._lock: Optional[asyncio.Lock] = None  # made on the event loop, at the first check
        self._turn = itertools.count()  # which KV adapter the next check sends

    async def __call__(self) -> tuple[int, dict]:
        """200 when requests can be served (the engine answers, and KV adapters' prompts are applied), else 503;
        each check says what it found. Checked against the engine as it is now at most every `interval`
        seconds; between checks the last answer is returned."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one check at a time: callers meanwhile get its answer
            if self._last is not None and time.monotonic() - self._last[0] < self.interval:
                return self._last[1]
            checks = {"engine": await self._engine_check()}
            checks["kv"] = (
                await self._connector_check() if checks["engine"]["ok"] else {"ok": False, "detail": "not checked"}
            )
            ok = all(c["ok"] for c in checks.values())
            answer = (200 if ok else 503), {"status": "ok" if ok else "unavailable", "checks": checks}
            self._last = (time.monotonic(), answer)
            return answer

    async def _engine_check(self) -> dict:
        try:
            answer = await self.engine.client.get("/v1/models", timeout=5.0)
            ids = [row.get("id") for row in answer.json().get("data", [])] if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as err:
            return {"ok": False, "detail": f"the engine can't be reached ({type(err).__name__})."}
        if ids is None:
            return {"ok": False, "detail": f"the engine's /v1/models answered {answer.status_code}."}
        if self.upstream_model not in ids:
            return {"ok": False, "detail": "the engine does not serve the model this front sends (--upstream-model)."}
        return {"ok": True, "detail": "the engine answers /v1/models and serves the model."}

    async def _connector_check(self) -> dict:
        """Are every KV adapter's files in the share, and does the engine's connector apply them now? One adapter a
        check, in turn, is sent for one token under a salt of its own (a refused probe leaves its placeholders'
        blocks to no one)."""
        kv = [a for a in self.front.adapters.values() if a.kv is not None]
        if not kv:
            off = "KV adapters are off (no --kv-share)." if self.front.kv_share is None else "no KV adapter is loaded."
            return {"ok": True, "detail": off}
        missing = await asyncio.to_thread(self.front.share.missing, {a.kv for a in kv})
        if missing:
            for digest in missing:  # the next check finds them again
                await asyncio.to_thread(self.front.share.restore, digest)
            return {
                "ok": False,
                "detail": f"{len(missing)} KV prompt files were missing from the share (--kv-share); written again.",
            }
        adapter = kv[next(self._turn) % len(kv)]
        if not self.front.share.hold(adapter.kv):  # removed meanwhile: the next check finds the adapters as they are
            return {"ok": True, "detail": f"{adapter.name!r} was removed while it was checked."}
        try:
            probe = {"model": self.upstream_model, "max_tokens": 1, "cache_salt": self.front.salts.probe()}
            probe.update(
                kv_fields.fields(adapter.kv, adapter.positions, self.front.placeholder, [self.front.placeholder])
            )
            kv_fields.check_served(await self.engine.post(json.dumps(probe).encode()), adapter.kv)
        except FrontError as err:
            return {"ok": False, "detail": str(err)}
        finally:
            self.front.share.release(adapter.kv)
        return {
            "ok": True,
            "detail": f"the engine's KV connector applied {adapter.name!r} just now ({len(kv)} KV adapters).",
        }
