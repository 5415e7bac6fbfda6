"""What an operator reads and bounds on `softprompt-plus serve`: `GET /health` (the engine reachable, the KV connector
applying KV prompts), `GET /metrics` (Prometheus text, by `prometheus_client`) and the limits on the work in flight,
past which a request is a 429 with `Retry-After`. Everything here runs on the event loop: its counts take no lock.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from . import serve_kv
from .serve_front import COMPLETION_DEFAULT_MAX_TOKENS, Adapter, Front
from .serve_requests import Call, FrontError
from .serve_upstream import Upstream

RETRY_AFTER_S = 1  # what a 429 asks the client to wait: a request in flight takes about that long to free its place
UNKNOWN = "unknown"  # the adapter label of a request that names nothing served: clients can't add label sets
SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # a reply takes ms to minutes


@dataclass
class Ticket:
    """One Completions or Chat request, from its first byte to its answer's last."""

    route: str
    started: float = field(default_factory=time.perf_counter)
    model: Optional[str] = None
    tokens: int = 0  # prompts x n x max_tokens, counted in flight once admitted
    admitted: bool = False
    digest: Optional[str] = None  # the KV share file it reads
    usage: Optional[dict] = None
    done: bool = False


class Ops:
    """The limits, the metrics and the health checks of one front and its engine."""

    def __init__(self, front: Front, engine: Upstream, upstream_model: str):
        self.front, self.engine, self.upstream_model = front, engine, upstream_model
        self.requests_in_flight = 0
        self.tokens_in_flight = 0
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("softprompt_plus_requests", "Requests answered.", ["adapter", "route"], registry=r)
        self.errors = Counter(
            "softprompt_plus_request_errors",
            "Requests answered with an error.",
            ["adapter", "route", "code"],
            registry=r,
        )
        self.seconds = Histogram(
            "softprompt_plus_request_seconds",
            "From a request's first byte to its answer's last.",
            ["adapter", "route"],
            buckets=SECONDS,
            registry=r,
        )
        self.tokens = Counter(
            "softprompt_plus_tokens", "Tokens in the engine's `usage`.", ["adapter", "kind"], registry=r
        )
        Gauge("softprompt_plus_requests_in_flight", "Requests admitted, not yet answered.", registry=r).set_function(
            lambda: self.requests_in_flight
        )
        Gauge(
            "softprompt_plus_tokens_in_flight", "prompts x n x max_tokens of the requests in flight.", registry=r
        ).set_function(lambda: self.tokens_in_flight)
        ProcessCollector(registry=r)  # the front's own CPU seconds and memory
        self._series: dict[str, set] = {}  # adapter label -> (metric, label values) recorded: DELETE forgets them

    # ------------------------------------------------------------------ limits

    def admit(self, ticket: Ticket, call: Call) -> None:
        """Count `call` in flight, or refuse it: a 429 past either limit, a 400 when it alone is past the tokens'."""
        limits = self.front.limits
        ticket.model = call.model
        default = limits.default_max_tokens if call.route == "chat" else COMPLETION_DEFAULT_MAX_TOKENS
        tokens = len(call.prompts) * call.n * (call.max_tokens or default)
        if tokens > limits.max_tokens_in_flight:
            raise FrontError(
                400,
                f"the request asks for {tokens} tokens (prompts x n x max_tokens), more than this front takes in "
                f"flight at all ({limits.max_tokens_in_flight}, --max-tokens-in-flight): lower n or max_tokens, or "
                "split it.",
            )
        if self.requests_in_flight >= limits.max_in_flight:
            raise FrontError(
                429,
                f"{self.requests_in_flight} requests are in flight, this front's limit "
                "(--max-in-flight): retry after the Retry-After header's seconds.",
            )
        if self.tokens_in_flight + tokens > limits.max_tokens_in_flight:
            raise FrontError(
                429,
                f"the requests in flight ask for {self.tokens_in_flight} tokens; with this one's {tokens} that is "
                f"past this front's {limits.max_tokens_in_flight} (--max-tokens-in-flight): retry after Retry-After.",
            )
        ticket.tokens, ticket.admitted = tokens, True
        self.requests_in_flight += 1
        self.tokens_in_flight += tokens

    def hold(self, ticket: Ticket, adapter: Optional[Adapter]) -> None:
        """Keep the KV share file `adapter` reads until the request is answered."""
        if adapter is None or adapter.kv is None:
            return
        if not self.front.share.hold(adapter.kv):
            raise FrontError(404, f"adapter {adapter.name!r} was removed while this request was read.")
        ticket.digest = adapter.kv

    def finish(self, ticket: Ticket, status: int) -> None:
        """The request answered with `status`: its place, tokens and share file freed, and it is counted."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.admitted:
            self.requests_in_flight -= 1
            self.tokens_in_flight -= ticket.tokens
        if ticket.digest is not None:
            self.front.share.release(ticket.digest)
        adapter = self.label(ticket.model)
        self._count(self.requests, adapter, ticket.route).inc()
        self._count(self.seconds, adapter, ticket.route).observe(time.perf_counter() - ticket.started)
        if status != 200:
            self._count(self.errors, adapter, ticket.route, str(status)).inc()
        for kind in ("prompt", "completion"):
            value = (ticket.usage or {}).get(f"{kind}_tokens")
            if isinstance(value, int) and value > 0:
                self._count(self.tokens, adapter, kind).inc(value)

    # ------------------------------------------------------------------ metrics

    def label(self, model) -> str:
        """`model` as a metric label: a served adapter's name, the base's, or `unknown`."""
        if model in (self.front.base_name, self.front.base_path):
            return self.front.base_name
        return model if isinstance(model, str) and model in self.front.adapters else UNKNOWN

    def _count(self, metric, *labels: str):
        self._series.setdefault(labels[0], set()).add((metric, labels))
        return metric.labels(*labels)

    def forget(self, name: str) -> None:
        """A removed adapter's label sets, dropped (a later request naming it counts as `unknown`)."""
        for metric, labels in self._series.pop(name, ()):
            metric.remove(*labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ health

    async def health(self) -> tuple[int, dict]:
        """200 when requests can be served (the engine answers, and KV adapters' prompts are applied), else 503;
        each check says what it found."""
        checks = {"engine": await self._engine_check()}
        checks["kv"] = (
            await self._connector_check() if checks["engine"]["ok"] else {"ok": False, "detail": "not checked"}
        )
        ok = all(c["ok"] for c in checks.values())
        return (200 if ok else 503), {"status": "ok" if ok else "unavailable", "checks": checks}

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
        """Are the KV adapters' files in the share, and does the engine's connector apply them? A prompt seen applied
        (by a request or an earlier check) is trusted; else one is sent for one token."""
        kv = [a for a in self.front.adapters.values() if a.kv is not None]
        if not kv:
            off = "KV adapters are off (no --kv-share)." if self.front.kv_share is None else "no KV adapter is loaded."
            return {"ok": True, "detail": off}
        missing = self.front.share.missing({a.kv for a in kv})
        if missing:
            return {"ok": False, "detail": f"{len(missing)} KV prompt files are missing from the share (--kv-share)."}
        if not any(a.kv in self.front.verified for a in kv):
            adapter = kv[0]
            ticket = Ticket("health")
            try:
                self.hold(ticket, adapter)
                probe = {"model": self.upstream_model, "max_tokens": 1, "cache_salt": adapter.kv}
                probe.update(
                    serve_kv.fields(adapter.kv, adapter.positions, self.front.placeholder, [self.front.placeholder])
                )
                serve_kv.check_served(await self.engine.post(json.dumps(probe).encode()), adapter.kv)
            except FrontError as err:
                return {"ok": False, "detail": str(err)}
            finally:
                if ticket.digest is not None:
                    self.front.share.release(ticket.digest)
            self.front.verified.add(adapter.kv)
        return {"ok": True, "detail": f"the engine's KV connector applies KV prompts ({len(kv)} KV adapters)."}
