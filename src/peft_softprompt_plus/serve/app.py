"""`softprompt-plus serve`: soft prompts by name in front of a running vLLM OpenAI server.

An OpenAI-compatible front (Completions and Chat Completions, streaming included, `GET /v1/models`): a request names
an adapter as its `model`; the front checks every field (`requests.py`), formats and tokenizes the text the way
that adapter was trained, builds the exact `[N+L, D]` embeddings (`front.py`) and forwards them to vLLM's
`/v1/completions` as `prompt_embeds` (`upstream.py`). vLLM stays the engine (batching, scheduling, prefix
caching). The base model by its own name is forwarded as token ids. With `--allow-adapter-updates`,
`PUT /v1/adapters/{name}` `{"path": DIR}` adds or replaces an adapter without a restart, and `DELETE` removes it.
Needs the `serve` extra (FastAPI, uvicorn, httpx).

The event loop moves bytes and counts: parsing, tokenizing, templating, building embeddings, adapter changes and every
share-file operation (publishing, hashing, restoring, removing) run in worker threads, and the loop never waits on
their locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .front import Front, Outgoing
from .http_edges import Gate, error, read_body, sse, timed_out, within
from .kv_fields import check_served, open_checked
from .ops import HEALTH_INTERVAL_S, RETRY_AFTER_S, Ops, Ticket
from .replies import as_chat, as_chat_chunk, merged
from .requests import LOOPBACK_HOSTS, FrontError, parse
from .upstream import Upstream, log


def build_app(
    front: Front,
    upstream: str,
    upstream_model: str,
    api_key: Optional[str] = None,
    allow_adapter_updates: bool = False,
    allowed_hosts: Optional[tuple[str, ...]] = LOOPBACK_HOSTS,
    health_interval: float = HEALTH_INTERVAL_S,
) -> FastAPI:
    """The ASGI app. `allowed_hosts`: the names a request's Host header may carry (None: any), so a web page can't
    reach a loopback front through DNS rebinding; `health_interval`: seconds one check of the engine is trusted."""
    engine = Upstream(upstream, upstream_model)
    ops = Ops(front, engine, upstream_model, health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.max_model_len()  # at start, not in the first burst: its read also loads the HTTP client's backend
        yield
        await engine.aclose()

    app = FastAPI(title="softprompt-plus serve", lifespan=lifespan)
    wanted = f"Bearer {api_key}".encode() if api_key is not None else None
    app.add_middleware(Gate, wanted=wanted, hosts=allowed_hosts)

    @app.exception_handler(FrontError)
    async def _refused(request: Request, err: FrontError):
        response = error(err.status, str(err))
        if err.status == 429:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(Exception)
    async def _failed(request: Request, err: Exception):
        ticket = uuid.uuid4().hex[:12]
        log.error("request %s failed", ticket, exc_info=err)
        return error(500, f"internal error {ticket}: the front's log has the details.", "server_error")

    @app.get("/health")
    async def health():
        status, report = await ops.health()  # health.py
        return JSONResponse(report, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(ops.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        rows = [{"id": front.base_name, "object": "model", "created": now, "owned_by": "softprompt-plus"}]
        rows += [
            {"id": a.name, "object": "model", "created": now, "owned_by": "softprompt-plus", "parent": front.base_name}
            for a in front.adapters.values()
        ]
        return {"object": "list", "data": rows}

    def _updates_allowed() -> None:
        if not allow_adapter_updates:
            raise FrontError(403, "adapter changes are off: start the front with --allow-adapter-updates.")

    @app.put("/v1/adapters/{name}")
    async def put_adapter(name: str, request: Request):
        _updates_allowed()
        body = await read_body(request, front.limits)
        folder = body.get("path")
        if not isinstance(folder, str):
            raise FrontError(400, f"`path` must be the adapter's local folder (a string), got {folder!r:.80}.")
        adapter = await asyncio.to_thread(front.add, name, folder)
        return {"id": adapter.name, "num_virtual_tokens": adapter.num_virtual_tokens, "positions": adapter.positions}

    @app.delete("/v1/adapters/{name}")
    async def delete_adapter(name: str):
        _updates_allowed()
        await asyncio.to_thread(front.remove, name)
        ops.forget(name)
        return {"id": name, "deleted": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer("chat", request)

    async def _answer(route: str, request: Request):
        ticket = Ticket(route)  # counted, and its place in flight freed, however it ends (ops.py)
        try:
            return await within(front.limits.request_timeout, _served(ticket, request))
        except asyncio.TimeoutError:
            err = timed_out(front.limits.request_timeout)
            if ticket.outgoing is not None:  # cut off, it may have run on the placeholders
                await ops.not_served(ticket.outgoing, err)
            ops.finish(ticket, err.status, err.reason)
            raise err from None
        except FrontError as err:
            ops.finish(ticket, err.status, err.reason)
            raise
        except BaseException:
            ops.finish(ticket, 500)
            raise

    async def _served(ticket: Ticket, request: Request):
        body = await read_body(request, front.limits)
        ticket.model = body.get("model")
        call = await asyncio.to_thread(parse, ticket.route, body, front.limits)
        ops.admit(ticket, call)
        room = await engine.max_model_len()
        outgoing = await asyncio.to_thread(front.bodies, call, upstream_model, room, ops.reserver(ticket))
        adapter, payloads = outgoing.adapter, outgoing.payloads
        ticket.outgoing = outgoing
        ops.hold(ticket, adapter)
        kv = adapter.kv if adapter is not None else None
        chat = ticket.route == "chat"
        try:
            if call.stream:  # an error before the stream is returned is still an HTTP status
                if kv is None:
                    response = await engine.open_stream(payloads[0])
                    chunks = engine.chunks(response)
                else:  # a stream can't be taken back, and vLLM streams no connector mark: each one is checked
                    response, chunks = await open_checked(engine, payloads[0], kv, adapter.positions)
                relay = _relay(chunks, call.model, chat, call.top_logprobs, ticket, outgoing)
                return _Stream(relay, response, ops, ticket)
            sent = [await engine.post(payloads[0])] if len(payloads) == 1 else await _all(engine, payloads)
            answers = [check_served(a, kv) for a in sent]
        except FrontError as err:
            await ops.not_served(outgoing, err)
            raise
        answer = merged(answers, call.n)
        ticket.usage = answer.get("usage")
        ops.finish(ticket, 200)
        return as_chat(answer, call.model, call.top_logprobs) if chat else {**answer, "model": call.model}

    async def _relay(chunks, name: str, chat: bool, top: Optional[int], ticket: Ticket, outgoing: Outgoing):
        first = True
        deadline = ticket.started + front.limits.request_timeout
        try:
            while True:
                try:
                    chunk = await within(max(0.0, deadline - time.perf_counter()), anext(chunks, None))
                except asyncio.TimeoutError:
                    await chunks.aclose()
                    raise timed_out(front.limits.request_timeout) from None
                if chunk is None:
                    break
                ticket.usage = chunk.get("usage") or ticket.usage  # sent when the client asks (`include_usage`)
                yield sse(as_chat_chunk(chunk, name, first, top) if chat else {**chunk, "model": name})
                first = False
            yield "data: [DONE]\n\n"
        except FrontError as err:  # mid-stream: the status line is sent, so an OpenAI-style error event
            await ops.not_served(outgoing, err)
            ops.finish(ticket, err.status, err.reason)
            yield sse({"error": {"message": str(err), "type": "server_error", "code": err.status}})

    return app


async def _all(engine: Upstream, payloads: list[bytes]) -> list[dict]:
    return await asyncio.gather(*(engine.post(p) for p in payloads))  # a task each: only for several prompts


class _Stream(StreamingResponse):
    """A relayed stream whose request is finished (`Ops.finish`) and upstream response closed once it ends, also where
    its body never started (the client gone first). Its wall-clock limit is `_relay`'s."""

    def __init__(self, content, upstream, ops: Ops, ticket: Ticket):
        super().__init__(content, media_type="text/event-stream")
        self.upstream, self.ops, self.ticket = upstream, ops, ticket

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ops.finish(self.ticket, 200)  # nothing, where an error event finished it
            await self.upstream.aclose()


def main(args) -> int:
    """`softprompt-plus serve` once its arguments are checked (apps/serve_args.py)."""
    import uvicorn

    from .kv_fields import vllm_config
    from .upstream import engine_scales

    scales = engine_scales(args.engine_version)
    front = Front(args.base, dtype=args.dtype, limits=args.limits, engine_scales=scales, kv_share=args.kv_share)
    if args.kv_share is not None:
        print(f"KV prompts: start vLLM with --kv-transfer-config '{vllm_config(args.kv_share)}'", flush=True)
    for name, folder in args.adapter:
        front.add(name, folder)
    for name, parts in args.compose:  # once the adapters they name are loaded
        front.compose(name, parts)
    app = build_app(
        front,
        args.upstream,
        args.upstream_model or front.base_path,
        args.api_key,
        args.allow_adapter_updates,
        args.allowed_hosts,
        args.health_interval,
    )
    print(
        f"serving {front.base_name} and adapters {sorted(front.adapters)} on http://{args.host}:{args.port}/v1 in "
        f"front of {args.upstream}",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
