"""The processes bench/vllm_check.py runs (vLLM's OpenAI server, `softprompt-plus serve` in front of it) and the
HTTP calls it times: plain urllib, so that the client adds nothing of its own."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

SERVER_FLAGS = ["--enable-prompt-embeds", "--dtype", "float32", "--max-model-len", "2048"]
KEY = "bench-key"


@contextlib.contextmanager
def vllm_server(path: str, port: int, out: str, *flags: str, env: dict = None, seconds: int = 600):
    """vLLM's OpenAI server on `port`, its log in `out`, `env` added to this process's; stopped on exit (its
    workers with it: they are in its process group)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port)]
    log = open(os.path.join(out, f"vllm_server_{port}.log"), "w")
    process = subprocess.Popen(
        [*command, *SERVER_FLAGS, *flags],
        stdout=log,  # its engine's settings and request lines
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        wait(f"http://127.0.0.1:{port}/v1/models", process, seconds)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(process)


def _stop(process) -> None:
    """SIGTERM to the server's process group (its engine and workers), then SIGKILL to what is left after 60 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def front(path: str, port: int, upstream: str, folders: dict[str, str], out: str, *flags: str):
    """`softprompt-plus serve` on `port` with `folders` by name (adapter changes on, behind KEY)."""
    command = [sys.executable, "-m", "peft_softprompt_plus", "serve", "--base", path, "--port", str(port)]
    command += [a for n, f in folders.items() for a in ("--adapter", f"{n}={f}")]
    command += ["--upstream", upstream, "--api-key", KEY, "--allow-adapter-updates", *flags]
    log = open(os.path.join(out, f"front_{port}.log"), "w")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait(f"http://127.0.0.1:{port}/v1/models", process, 300, KEY)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(60)


def wait(url: str, process, seconds: int = 600, key: str = None) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            urllib.request.urlopen(_request(url, None, key), timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError(url)


def _request(url: str, body, key=None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    return urllib.request.Request(url, data=data, headers=headers)


def post(url: str, body, key=None) -> tuple[int, dict]:
    """(status, JSON answer); a 4xx/5xx is returned, not raised."""
    try:
        with urllib.request.urlopen(_request(url, body, key), timeout=900) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        text = err.read()
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, {"not_json": text[:200].decode(errors="replace")}


def ttft(url: str, body: dict, key=None) -> float:
    """Seconds to the first streamed chunk."""
    start = time.perf_counter()
    with urllib.request.urlopen(_request(url, {**body, "stream": True}, key), timeout=900) as answer:
        for line in answer:
            if line.startswith(b"data: "):
                return time.perf_counter() - start
    return float("nan")


def b64(tensor) -> str:
    import torch

    buffer = io.BytesIO()
    torch.save(tensor.cpu().contiguous(), buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def prefix_cache(upstream: str) -> tuple[float, float]:
    """vLLM's prefix-cache counters (queries, hits), in tokens, from its Prometheus metrics."""
    with urllib.request.urlopen(f"{upstream}/metrics", timeout=10) as answer:
        text = answer.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")
