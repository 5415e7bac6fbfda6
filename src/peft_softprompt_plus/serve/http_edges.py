"""The HTTP edges of `softprompt-plus serve`: the Host and key gate (plain ASGI), a request body read under
`--max-body-bytes` and `--body-timeout` and parsed off the loop, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from .requests import FrontError, Limits


async def read_body(request: Request, limits: Limits) -> dict:
    """The request's JSON object, refused past `--max-body-bytes` (413) before it is all read or past
    `--body-timeout` seconds (408), parsed off the loop."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise FrontError(
            413,
            f"the request body is {declared} bytes; this front takes at most {limit} (--max-body-bytes).",
            "max_body_bytes",
        )
    data = bytearray()

    async def read() -> None:
        async for piece in request.stream():
            data.extend(piece)
            if len(data) > limit:
                raise FrontError(
                    413,
                    f"the request body is over {limit} bytes, this front's limit (--max-body-bytes).",
                    "max_body_bytes",
                )

    try:
        await within(limits.body_timeout, read())
    except asyncio.TimeoutError:
        raise FrontError(
            408,
            f"the request body took over {limits.body_timeout} s to arrive (--body-timeout): send it whole.",
            "body_timeout",
        ) from None
    try:
        body = await asyncio.to_thread(json.loads, bytes(data))
    except ValueError as err:
        raise FrontError(400, f"the request body must be JSON: {err}") from err
    if not isinstance(body, dict):
        raise FrontError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
    return body


class Gate:
    """The Host and key checks, as plain ASGI (starlette's `BaseHTTPMiddleware` costs a task and a stream each
    request)."""

    def __init__(self, app, wanted: Optional[bytes], hosts: Optional[tuple[str, ...]]):
        self.app, self.wanted, self.hosts = app, wanted, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # lower-case byte names, as ASGI gives them
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if self.hosts is not None and host not in self.hosts:
            refusal = error(400, f"the Host header {host!r} is not one this front answers to (--allowed-host).")
        elif self.wanted is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.wanted):
            message = "missing or wrong API key: send `Authorization: Bearer <key>`."
            refusal = error(401, message, "authentication_error")
        else:
            return await self.app(scope, receive, send)
        await refusal(scope, receive, send)


def host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8100
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def within(seconds: float, awaitable):
    """`awaitable`'s result, or `asyncio.TimeoutError` past `seconds`: `asyncio.timeout` where it exists (Python
    3.11+), which cancels in place; `wait_for` costs a task a call (a profile of the front under load saw them)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def timed_out(seconds: int) -> FrontError:
    return FrontError(
        504, f"the request took over {seconds} s (--request-timeout): lower max_tokens or retry.", "request_timeout"
    )


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
