"""What an operator reads and bounds on `softprompt-plus serve`: `GET /metrics` (Prometheus text, by
`prometheus_client`), the limits on the work in flight, past which a request is a 429 with `Retry-After`, and what
follows a KV request the engine did not serve with its prompt (its salt moved, its file written again); `GET /health`
is health.py's. Everything here runs on the event loop (its counts take no lock) except the prompt bytes, which
worker threads reserve.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from .front import Adapter, Front, Outgoing
from .health import Health
from .requests import HEALTH_INTERVAL_S, Call, FrontError
from .upstream import Upstream, log

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
    prompt_bytes: int = 0  # reserved by `Ops.reserve` while its bodies are built, freed when it is answered
    outgoing: Optional[Outgoing] = None  # what was sent to the engine


def prompt_bytes(adapter: Optional[Adapter], tokens: int, width: int) -> int:
    """What one prompt's upstream body takes in the front's memory at its peak: an input adapter's `[P+N+S+L, D]`
    float32 rows, their `torch.save` bytes in base64 and the JSON body holding those; else its ids as JSON."""
    if adapter is None or adapter.block is None:
        return 64 + 8 * ((adapter.positions if adapter is not None else 0) + tokens)
    raw = (adapter.positions + tokens) * width * 4
    return raw + 2 * (4 * (raw + 1024) // 3)  # + the base64 text, + the JSON body holding it


class Ops:
    """The limits, the metrics and the health checks of one front and its engine."""

    def __init__(
        self, front: Front, engine: Upstream, upstream_model: str, health_interval: float = HEALTH_INTERVAL_S
    ):
        self.front, self.engine, self.upstream_model = front, engine, upstream_model
        self.requests_in_flight = 0
        self.tokens_in_flight = 0
        self.prompt_bytes_in_flight = 0  # reserved from worker threads: under `_bytes_lock`
        self._bytes_lock = threading.Lock()
        self.health = Health(front, engine, upstream_model, health_interval)  # GET /health
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
        Gauge(
            "softprompt_plus_prompt_bytes_in_flight", "Bytes the prompts of the requests in flight take.", registry=r
        ).set_function(lambda: self.prompt_bytes_in_flight)
        self.refusals = Counter(
            "softprompt_plus_refusals",
            "Requests refused or cut off, by why: a limit's flag, or why the engine did not apply a KV prompt.",
            ["reason"],
            registry=r,
        )
        self.salts_moved = Counter(
            "softprompt_plus_kv_salts_moved", "KV adapters moved to a fresh cache salt after a refusal.", registry=r
        )
        ProcessCollector(registry=r)  # the front's own CPU seconds and memory
        self._series: dict[str, set] = {}  # adapter label -> (metric, label values) recorded: DELETE forgets them

    # ------------------------------------------------------------------ limits

    def admit(self, ticket: Ticket, call: Call) -> None:
        """Count `call` in flight, or refuse it: a 429 past either limit, a 400 when it alone is past the tokens'."""
        limits = self.front.limits
        ticket.model = call.model
        tokens = len(call.prompts) * call.n * (call.max_tokens or limits.default_max_tokens_for(call.route))
        if tokens > limits.max_tokens_in_flight:
            raise FrontError(
                400,
                f"the request asks for {tokens} tokens (prompts x n x max_tokens), more than this front takes in "
                f"flight at all ({limits.max_tokens_in_flight}, --max-tokens-in-flight): lower n or max_tokens, or "
                "split it.",
                "max_tokens_in_flight",
            )
        if self.requests_in_flight >= limits.max_in_flight:
            raise FrontError(
                429,
                f"{self.requests_in_flight} requests are in flight, this front's limit "
                "(--max-in-flight): retry after the Retry-After header's seconds.",
                "max_in_flight",
            )
        if self.tokens_in_flight + tokens > limits.max_tokens_in_flight:
            raise FrontError(
                429,
                f"the requests in flight ask for {self.tokens_in_flight} tokens; with this one's {tokens} that is "
                f"past this front's {limits.max_tokens_in_flight} (--max-tokens-in-flight): retry after Retry-After.",
                "max_tokens_in_flight",
            )
        ticket.tokens, ticket.admitted = tokens, True
        self.requests_in_flight += 1
        self.tokens_in_flight += tokens

    def reserver(self, ticket: Ticket):
        """What `Front.bodies` calls, from its worker thread, with a request's adapter and text lengths before it
        builds anything: the bytes its bodies will take (`prompt_bytes`) counted in flight, or refused (a 400 alone
        past the limit, else a 429)."""

        def reserve(adapter: Optional[Adapter], lengths: list[int]) -> None:
            size = sum(prompt_bytes(adapter, length, self.front.embedding.embedding_dim) for length in lengths)
            limit = self.front.limits.max_prompt_bytes_in_flight
            if size > limit:
                raise FrontError(
                    400,
                    f"the request's prompts take {size} bytes in the front (an input adapter's rows as base64), more "
                    f"than it takes in flight at all ({limit}, --max-prompt-bytes-in-flight): send fewer or shorter "
                    "prompts per request.",
                    "max_prompt_bytes_in_flight",
                )
            with self._bytes_lock:
                if self.prompt_bytes_in_flight + size > limit:
                    raise FrontError(
                        429,
                        f"the requests in flight take {self.prompt_bytes_in_flight} bytes for their prompts; with "
                        f"this one's {size} that is past this front's {limit} (--max-prompt-bytes-in-flight): retry "
                        "after Retry-After.",
                        "max_prompt_bytes_in_flight",
                    )
                self.prompt_bytes_in_flight += size
                ticket.prompt_bytes = size

        return reserve

    def hold(self, ticket: Ticket, adapter: Optional[Adapter]) -> None:
        """Keep the KV share file `adapter` reads until the request is answered."""
        if adapter is None or adapter.kv is None:
            return
        if not self.front.share.hold(adapter.kv):
            raise FrontError(404, f"adapter {adapter.name!r} was removed while this request was read.")
        ticket.digest = adapter.kv

    def finish(self, ticket: Ticket, status: int, reason: Optional[str] = None) -> None:
        """The request answered with `status` (refused for `reason`): its place, tokens, bytes and share file freed,
        and it is counted."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.admitted:
            self.requests_in_flight -= 1
            self.tokens_in_flight -= ticket.tokens
        if ticket.prompt_bytes:
            with self._bytes_lock:
                self.prompt_bytes_in_flight -= ticket.prompt_bytes
        if reason is not None:
            self.refusals.labels(reason).inc()
        if ticket.digest is not None:
            self.front.share.release(ticket.digest)  # a file no longer used is removed off the loop
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

    # ------------------------------------------------------------------ KV requests not served

    async def not_served(self, outgoing: Outgoing, err: FrontError) -> None:
        """A KV request that came back without the connector's mark, failed in the engine or was cut off: it may
        have run on the placeholders, whose blocks vLLM caches under its salt. The adapter moves to a fresh salt (the
        connector retired the old one where it refused it), and its share file is written again from memory (a torn
        or removed one is why it was refused), before the client hears of it: a retry is served."""
        adapter = outgoing.adapter
        if adapter is None or adapter.kv is None or outgoing.salt is None or 400 <= err.status < 500:
            return  # not a KV request, or the engine refused it before it ran
        if self.front.salts.retire(adapter.content, outgoing.salt):
            self.salts_moved.inc()
            try:
                await asyncio.to_thread(self.front.share.restore, adapter.kv)
            except OSError as failure:
                log.error("could not write the KV prompt %s to the share again: %s", adapter.kv, failure)
