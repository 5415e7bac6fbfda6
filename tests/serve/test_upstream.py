"""The front's connections to vLLM (serve/upstream.py): an idle one is dropped before vLLM's server would close
it, so a request never goes out on a connection vLLM is closing (an httpx ReadError, a 502 for the client)."""

import asyncio
import threading
import time

import uvicorn
from test_app import _free_port

from peft_softprompt_plus.serve import upstream as serve_upstream
from peft_softprompt_plus.serve.upstream import Upstream


async def _client_port(scope, receive, send):
    """Answers every request with the client's port: a new port is a new connection."""
    await receive()
    body = b'{"port": %d}' % scope["client"][1]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _server() -> tuple[uvicorn.Server, str]:
    port = _free_port()  # keeps idle connections far longer than the client: only the client drops them
    server = uvicorn.Server(uvicorn.Config(_client_port, port=port, log_level="error", timeout_keep_alive=60))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    return server, f"http://127.0.0.1:{port}"


def test_idle_connections_expire_before_vllm_closes_them(monkeypatch):
    assert serve_upstream.KEEPALIVE_EXPIRY_S < serve_upstream.ENGINE_KEEP_ALIVE_S
    monkeypatch.setattr(serve_upstream, "KEEPALIVE_EXPIRY_S", 0.3)  # the same rule, faster
    server, url = _server()

    async def ports() -> list[int]:
        upstream = Upstream(url, "m", shards=1)
        try:
            seen = [(await upstream.post(b"{}"))["port"]]
            seen.append((await upstream.post(b"{}"))["port"])  # within the expiry: the same connection
            await asyncio.sleep(0.6)
            seen.append((await upstream.post(b"{}"))["port"])  # past it: a new one
            return seen
        finally:
            await upstream.aclose()

    try:
        first, again, later = asyncio.run(ports())
    finally:
        server.should_exit = True
    assert first == again
    assert later != first
