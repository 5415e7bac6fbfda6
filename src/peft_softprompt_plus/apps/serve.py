"""`softprompt-plus serve`: soft prompts by name in front of a running vLLM OpenAI server.

An OpenAI-compatible front (Completions and Chat Completions, streaming included, `GET /v1/models`): a request names
an adapter as its `model`; the front formats and tokenizes the text the way that adapter was trained, builds the exact
`[N+L, D]` embeddings (`serve_front.py`) and forwards them to vLLM's `/v1/completions` as `prompt_embeds`. vLLM stays
the engine (batching, scheduling, prefix caching). The base model by its own name is forwarded as token ids.
`PUT /v1/adapters/{name}` `{"path": DIR}` adds or replaces an adapter without a restart; `DELETE` removes it.
Needs the `serve` extra (FastAPI, uvicorn, httpx).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .serve_front import Adapter, Front, FrontError

UPSTREAM_FLAGS = "--enable-prompt-embeds --dtype float32"


def build_app(front: Front, upstream: str, upstream_model: str, api_key: Optional[str] = None) -> FastAPI:
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(600.0, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="softprompt-plus serve", lifespan=lifespan)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(401, "missing or wrong API key: send `Authorization: Bearer <key>`.", "authentication_error")
        return await call_next(request)

    @app.exception_handler(FrontError)
    async def _refused(request: Request, err: FrontError):
        return _error(err.status, str(err))

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        rows = [{"id": front.base_name, "object": "model", "created": now, "owned_by": "softprompt-plus"}]
        rows += [
            {"id": a.name, "object": "model", "created": now, "owned_by": "softprompt-plus", "parent": front.base_name}
            for a in front.adapters.values()
        ]
        return {"object": "list", "data": rows}

    @app.put("/v1/adapters/{name}")
    async def put_adapter(name: str, request: Request):
        body = await _json(request)
        folder = body.get("path")
        if not isinstance(folder, str):
            raise FrontError(400, f"`path` must be the adapter folder (a string), got {folder!r}.")
        adapter = await asyncio.to_thread(front.add, name, folder)
        return {"id": adapter.name, "path": adapter.folder, "num_virtual_tokens": adapter.num_virtual_tokens}

    @app.delete("/v1/adapters/{name}")
    async def delete_adapter(name: str):
        front.remove(name)
        return {"id": name, "deleted": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        adapter = front.resolve(body.get("model"))
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) else [prompt]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise FrontError(400, f"`prompt` must be a text or a list of texts, got {prompt!r:.80}.")
        if len(prompts) == 1:
            return await _forward(body, adapter, front.token_ids(prompts[0], adapter), chat=False)
        if body.get("stream"):
            raise FrontError(400, f"`stream` takes one prompt per request, got {len(prompts)}: send them one by one.")
        # Several prompts: one upstream request each (vLLM batches them), the choices numbered as OpenAI numbers
        # them (prompt i's choice c is i * n + c).
        answers = await asyncio.gather(
            *(_forward(body, adapter, front.token_ids(p, adapter), chat=False) for p in prompts)
        )
        n = body.get("n") or 1
        choices = [{**c, "index": i * n + c["index"]} for i, a in enumerate(answers) for c in a["choices"]]
        usage = {
            k: sum((a.get("usage") or {}).get(k, 0) for a in answers)
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        }
        return {**answers[0], "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        adapter = front.resolve(body.get("model"))
        text = front.chat_text(adapter, body.get("messages"))
        return await _forward(body, adapter, front.tokenizer(text, add_special_tokens=False)["input_ids"], chat=True)

    async def _forward(body: dict, adapter: Optional[Adapter], ids: list[int], chat: bool):
        name = body["model"]
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or (None if chat else 16)
        front.check_length(adapter, ids, max_tokens or 0)
        upstream_body = {k: v for k, v in body.items() if k in _PASSED}
        upstream_body["model"] = upstream_model
        if max_tokens is not None:
            upstream_body["max_tokens"] = max_tokens
        if adapter is None:
            upstream_body["prompt"] = ids
        else:
            upstream_body["prompt_embeds"] = await asyncio.to_thread(front.embeds_b64, adapter, ids)
        if body.get("stream"):
            return StreamingResponse(_stream(upstream_body, name, chat), media_type="text/event-stream")
        answer = await _post(upstream_body)
        return _as_chat(answer, name) if chat else {**answer, "model": name}

    async def _post(upstream_body: dict) -> dict:
        try:
            response = await client.post("/v1/completions", json=upstream_body)
        except httpx.HTTPError as err:
            raise FrontError(502, _unreachable(upstream, err)) from err
        if response.status_code != 200:
            raise FrontError(*_upstream_error(response.status_code, response.text))
        return response.json()

    async def _stream(upstream_body: dict, name: str, chat: bool):
        first = True
        try:
            async with client.stream("POST", "/v1/completions", json=upstream_body) as response:
                if response.status_code != 200:
                    status, message = _upstream_error(response.status_code, (await response.aread()).decode())
                    yield _sse({"error": {"message": message, "code": status}})
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data.strip() == "[DONE]":
                        yield "data: [DONE]\n\n"
                        return
                    chunk = json.loads(data)
                    yield _sse(_as_chat_chunk(chunk, name, first) if chat else {**chunk, "model": name})
                    first = False
        except httpx.HTTPError as err:
            yield _sse({"error": {"message": _unreachable(upstream, err), "code": 502}})

    return app


# What a client may set that vLLM's Completions endpoint takes as is (the rest is built here or refused).
_PASSED = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "user",
}


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as err:
        raise FrontError(400, f"the request body must be JSON: {err}") from err
    if not isinstance(body, dict):
        raise FrontError(400, "the request body must be a JSON object.")
    if "prompt_embeds" in body:
        raise FrontError(400, "`prompt_embeds` is not accepted from clients: send text; the front builds them.")
    return body


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _unreachable(upstream: str, err: Exception) -> str:
    return (
        f"the vLLM server at {upstream} can't be reached ({type(err).__name__}: {err}). Start it with "
        f"`python -m vllm.entrypoints.openai.api_server --model BASE {UPSTREAM_FLAGS}`, or pass --upstream."
    )


def _upstream_error(status: int, text: str) -> tuple[int, str]:
    if "prompt_embeds" in text or "prompt embeds" in text.lower() or "enable-prompt-embeds" in text:
        return 502, f"the vLLM server refuses prompt embeddings: restart it with {UPSTREAM_FLAGS}. It said: {text}"
    return (status if 400 <= status < 500 else 502), f"the vLLM server answered {status}: {text}"


def _as_chat(answer: dict, name: str) -> dict:
    choices = [
        {
            "index": c["index"],
            "message": {"role": "assistant", "content": c.get("text", "")},
            "finish_reason": c.get("finish_reason"),
            "logprobs": c.get("logprobs"),
        }
        for c in answer.get("choices", [])
    ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": answer.get("created", int(time.time())),
        "model": name,
        "choices": choices,
        "usage": answer.get("usage"),
    }


def _as_chat_chunk(chunk: dict, name: str, first: bool) -> dict:
    choices = []
    for c in chunk.get("choices", []):
        delta = {"content": c.get("text", "")}
        if first:
            delta["role"] = "assistant"
        choices.append({"index": c["index"], "delta": delta, "finish_reason": c.get("finish_reason")})
    return {
        "id": chunk.get("id", "").replace("cmpl-", "chatcmpl-", 1),
        "object": "chat.completion.chunk",
        "created": chunk.get("created", int(time.time())),
        "model": name,
        "choices": choices,
        **({"usage": chunk["usage"]} if chunk.get("usage") else {}),
    }


def main(args) -> int:
    """`softprompt-plus serve` once its arguments are checked (cli.py)."""
    import uvicorn

    front = Front(args.base, dtype=args.dtype)
    for name, folder in args.adapter:
        front.add(name, folder)
    app = build_app(front, args.upstream, args.upstream_model or front.base_path, args.api_key)
    print(
        f"serving {front.base_name} and adapters {sorted(front.adapters)} on http://{args.host}:{args.port}/v1 in "
        f"front of {args.upstream}",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
