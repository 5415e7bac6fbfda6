"""The vLLM server behind `softprompt-plus serve`: its `/v1/completions` (whole or streamed), its errors turned into
answers that name no server address or path (the details go to the front's log), and what the front reads off it:
its context length and whether it scales the embeddings it is given.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from typing import AsyncIterator, Optional

import httpx

from .requests import FrontError

log = logging.getLogger("peft_softprompt_plus.serve")
UPSTREAM_FLAGS = "--enable-prompt-embeds --dtype float32"
# Does vLLM multiply `prompt_embeds` by the model's embedding scale (Gemma's sqrt(D)) itself? Measured by
# `bench/vllm_check.py gemma` with vLLM for CPU 0.32.0: no, it scales only what it embeds from token ids, so the
# front sends the sequence transformers reads (already scaled). A version not measured is treated as the newest
# measured one, with a warning.
ENGINE_SCALES_EMBEDDINGS = {"0.32": False}
# vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, uvicorn's timeout_keep_alive), and
# httpx keeps one for 5 s: a request sent on a connection as vLLM closes it fails with a ReadError, never having
# reached vLLM (1 of 108 replies, a 502, in `bench/vllm_check.py --parts tp` at PP=2). Idle connections are dropped
# well before vLLM drops them.
ENGINE_KEEP_ALIVE_S = 5.0
KEEPALIVE_EXPIRY_S = 2.0


def engine_scales(version: Optional[str]) -> bool:
    release = ".".join((version or "").split(".")[:2])
    if release not in ENGINE_SCALES_EMBEDDINGS:
        newest = max(ENGINE_SCALES_EMBEDDINGS, key=lambda v: tuple(int(p) for p in v.split(".")))
        log.warning(
            "vLLM %s: how it scales Gemma-family embeddings was not measured; acting as %s does.", version, newest
        )
        release = newest
    return ENGINE_SCALES_EMBEDDINGS[release]


class Upstream:
    """An async client of one vLLM OpenAI server, serving `model`."""

    def __init__(self, url: str, model: str, shards: int = 16):
        self.url, self.model = url.rstrip("/"), model
        # httpcore's pool scans every connection it holds for each request it places (O(n) a request, O(n^2) a burst):
        # at 64 concurrent requests that was a third of the front's CPU. Small pools, taken in turn, keep it flat.
        self._clients = [
            httpx.AsyncClient(
                base_url=self.url,
                timeout=httpx.Timeout(600.0, connect=5.0),
                limits=httpx.Limits(
                    max_connections=64, max_keepalive_connections=4, keepalive_expiry=KEEPALIVE_EXPIRY_S
                ),
            )
            for _ in range(shards)
        ]
        self._turn = itertools.count()
        self._max_model_len: Optional[int] = None
        self._reading: Optional[asyncio.Future] = None  # the one `/v1/models` read in flight
        self._completions = httpx.URL(f"{self.url}/v1/completions")  # parsed once: httpx parses a str each request

    @property
    def client(self) -> httpx.AsyncClient:
        return self._clients[next(self._turn) % len(self._clients)]

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    async def max_model_len(self) -> Optional[int]:
        """vLLM's own `max_model_len` for the served model (read once; None while it can't be reached). Requests that
        ask while it is being read wait for that one read: a burst on a fresh front sends one `/v1/models`, not one
        per request."""
        if self._max_model_len is None:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read_max_model_len())
            await asyncio.shield(self._reading)
        return self._max_model_len

    async def _read_max_model_len(self) -> None:
        try:
            rows = (await self.client.get("/v1/models", timeout=5.0)).json().get("data", [])
            row = next((r for r in rows if r.get("id") == self.model), rows[0] if rows else {})
            value = row.get("max_model_len")
            self._max_model_len = value if isinstance(value, int) and value > 0 else None
        except (httpx.HTTPError, ValueError, AttributeError) as err:
            log.warning("could not read max_model_len from %s: %s", self.url, err)

    async def post(self, payload: bytes) -> dict:
        try:
            response = await self.client.post(self._completions, content=payload, headers=_JSON)
        except httpx.HTTPError as err:
            raise self._unreachable(err) from err
        if response.status_code != 200:
            raise self.error(response.status_code, response.text)
        try:
            return response.json()
        except ValueError as err:
            log.error("vLLM answered 200 with a body that is not JSON: %.200s", response.text)
            raise FrontError(502, "the engine gave an answer that is not JSON; the front's log has it.") from err

    async def open_stream(self, payload: bytes) -> httpx.Response:
        """The streamed response, opened: an error before the first byte is a `FrontError` (an HTTP status for the
        client), not an event inside a 200."""
        client = self.client
        request = client.build_request("POST", self._completions, content=payload, headers=_JSON)
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as err:
            raise self._unreachable(err) from err
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            await response.aclose()
            raise self.error(response.status_code, text)
        return response

    async def chunks(self, response: httpx.Response) -> AsyncIterator[dict]:
        """The stream's JSON chunks until `[DONE]`. A line that is not JSON is logged and skipped; an error event,
        or the connection lost, raises `FrontError` (the caller sends it as an error event)."""
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    log.warning("skipped a streamed line that is not JSON: %.200s", data)
                    continue
                if isinstance(chunk, dict) and "error" in chunk:
                    raise self.error(_status_of(chunk["error"]), json.dumps(chunk))
                yield chunk
        except httpx.HTTPError as err:
            raise self._unreachable(err) from err
        finally:
            await response.aclose()

    def _unreachable(self, err: Exception) -> FrontError:
        log.error("vLLM at %s can't be reached: %s: %s", self.url, type(err).__name__, err)
        return FrontError(502, "the engine can't be reached or broke off; the front's log has the details.")

    def error(self, status: int, text: str) -> FrontError:
        """vLLM's error as the client sees it: its message for a 4xx, with the served model's path and any other
        path taken out; a generic 502 for the rest (logged in full)."""
        log.warning("vLLM answered %s: %.2000s", status, text)
        message = _message(text)
        if "enable-prompt-embeds" in text or "enable_prompt_embeds" in text:
            return FrontError(502, f"the engine refuses prompt embeddings: it must run with {UPSTREAM_FLAGS}.")
        if not 400 <= status < 500 or message is None:
            return FrontError(502, f"the engine failed ({status}); the front's log has the details.")
        return FrontError(status, "the engine refused the request: " + self._scrub(message))

    def _scrub(self, message: str) -> str:
        message = message.replace(self.model, "<base>").replace(self.url, "<engine>")
        return _PATH.sub("<path>", message)[:500]


_JSON = {"Content-Type": "application/json"}
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.\-+@~]+){2,}[/\\]?")


def _message(text: str) -> Optional[str]:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    error = body.get("error", body) if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def _status_of(error) -> int:
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else 502
