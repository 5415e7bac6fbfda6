"""A 200 from `softprompt-plus serve` for a KV adapter is the adapter's answer, whatever refused a request before it:
against a vLLM stand-in that keeps vLLM's prefix cache (tests/serve/kv_connector_stub.py `PrefixCache`: blocks hashed
by ids and `cache_salt`, each remembering where its positions came from) and runs the real connector's scheduler
side. Also: `/health` checks the engine as it is now, and the event loop never waits on a share file."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

import httpx
import kv_connector_stub
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_app import UPSTREAM_MODEL, _adapter, _Server, fake_vllm
from test_ops import _samples, _value

from peft_softprompt_plus._names import VLLM_KV_TENSOR
from peft_softprompt_plus.apps.tiny import save_tiny
from peft_softprompt_plus.serve import share as serve_share
from peft_softprompt_plus.serve.app import build_app
from peft_softprompt_plus.serve.front import Front

WAIT_S = 20
MOVED = "softprompt_plus_kv_salts_moved_total"
PROMPTS = ("the cat sat on the mat and then it sat again", "a dog ran far away from the house and back")


@pytest.fixture(scope="module")
def trust(tmp_path_factory):
    """A front serving one KV adapter (N=4) in front of two engines with a prefix cache: blocks of 4 positions (N
    fills block 0) and of 8 (N below a block, the prompts longer than one)."""
    root = tmp_path_factory.mktemp("serve-trust")
    base = save_tiny(str(root / "tiny-base"))
    share = root / "share"
    share.mkdir(mode=0o750)
    front = Front(base, kv_share=str(share))
    adapter = front.add("kv", _adapter(base, str(root / "kv"), 5, prompt_level="kv"))
    engines = {size: _Server(fake_vllm([], kv_share=str(share), block_size=size)) for size in (4, 8)}
    fronts = {size: _Server(build_app(front, e.url, UPSTREAM_MODEL, health_interval=0)) for size, e in engines.items()}
    yield {"front": front, "share": share, "adapter": adapter, "engines": engines, "fronts": fronts, "base": base}
    for server in (*fronts.values(), *engines.values()):
        server.stop()


def _ask(url: str, prompt: str, model: str = "kv") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    return httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)


def _break(path, kind: str) -> None:
    """The share file as a full disk, an interrupted copy, another writer or a bad mount would leave it."""
    right = load_file(str(path))
    if kind == "missing":
        os.remove(path)
    elif kind == "torn":
        path.write_bytes(path.read_bytes()[:100])
    elif kind == "planted":  # the right config, another tensor
        save_file({VLLM_KV_TENSOR: torch.zeros_like(right[VLLM_KV_TENSOR])}, str(path))
    elif kind == "unreadable":  # no file to read there
        os.remove(path)
        os.mkdir(path)


def _fix(path, front, digest: str) -> None:
    """Put right by hand, as an operator would (the front has written it again already where it could)."""
    if path.is_dir():
        shutil.rmtree(path)
    front.share.restore(digest)


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("kind", ["missing", "torn", "planted", "unreadable"])
def test_after_a_refused_kv_request_every_200_is_the_adapter_s_answer(trust, kind, block_size):
    front, adapter = trust["front"], trust["adapter"]
    url, path = trust["fronts"][block_size].url, trust["share"] / f"{adapter.kv}.safetensors"
    assert _ask(url, PROMPTS[0]).json()["choices"][0]["text"] == kv_connector_stub.ADAPTER  # its blocks cached
    salt = front.salts.current(adapter.content)
    before = _samples(url)
    _break(path, kind)
    _forget_verified(trust)
    refused = _ask(url, PROMPTS[1])  # the next prompt shares block 0 (the placeholders) with the first
    assert refused.status_code == 502 and "did not apply the KV prompt" in refused.json()["error"]["message"]
    assert front.salts.current(adapter.content) != salt  # moved: the refused request's blocks are left to no one
    after = _samples(url)
    for name, labels in (("softprompt_plus_refusals_total", {"reason": "kv_refused"}), (MOVED, {})):
        assert _value(after, name, **labels) - _value(before, name, **labels) == 1, name
    retry = _ask(url, PROMPTS[1])  # right after the 502: the front wrote the file again where it could
    if kind != "unreadable":
        assert retry.status_code == 200 and retry.json()["choices"][0]["text"] == kv_connector_stub.ADAPTER
    _fix(path, front, adapter.kv)
    for prompt in PROMPTS:  # the same prompt, and another
        answer = _ask(url, prompt)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == kv_connector_stub.ADAPTER


def _forget_verified(trust) -> None:
    """The engines' connectors forget the prompts they verified, as a vLLM past its cache bound would: the broken
    file is what they read next."""
    for engine in trust["engines"].values():
        connector = engine.server.config.app.state.connector
        connector._prompt_cache = type(connector._prompt_cache)(connector._prompt_cache.max_bytes)


def test_a_client_that_reaches_vllm_directly_can_t_name_an_adapter_s_blocks(trust):
    front, adapter = trust["front"], trust["adapter"]
    engine, url = trust["engines"][4].url, trust["fronts"][4].url
    ids = front.tokenizer(PROMPTS[0])["input_ids"]
    placeholders = [front.placeholder] * adapter.positions + ids
    for salt in (adapter.kv, adapter.content, "0" * 32):  # the share's name (public), or a guess
        direct = httpx.post(
            engine + "/v1/completions",
            json={"model": UPSTREAM_MODEL, "prompt": placeholders, "max_tokens": 2, "cache_salt": salt},
            timeout=WAIT_S,
        )
        assert direct.json()["choices"][0]["text"] == kv_connector_stub.BASE  # the placeholders read as text
    assert front.salts.current(adapter.content) not in (adapter.kv, adapter.content)
    assert _ask(url, PROMPTS[0]).json()["choices"][0]["text"] == kv_connector_stub.ADAPTER


def test_health_checks_the_engine_as_it_is_now_within_its_interval(tmp_path):
    """A vLLM restarted without the connector turns /health non-200 within `--health-interval`."""
    base = save_tiny(str(tmp_path / "tiny-base"))
    share = tmp_path / "share"
    share.mkdir(mode=0o750)
    front = Front(base, kv_share=str(share))
    front.add("kv", _adapter(base, str(tmp_path / "kv"), 5, prompt_level="kv"))
    front.add("kv-2", _adapter(base, str(tmp_path / "kv-2"), 6, prompt_level="kv"))
    with_connector = fake_vllm([], kv_share=str(share))
    without = fake_vllm([])
    engine = _Server(_Restartable(with_connector))
    server = _Server(build_app(front, engine.url, UPSTREAM_MODEL, health_interval=1))
    try:
        first = httpx.get(server.url + "/health", timeout=WAIT_S)
        assert first.status_code == 200 and "applied 'kv' just now (2 KV adapters)" in first.text
        engine.server.config.app.app = without  # restarted without the connector
        assert httpx.get(server.url + "/health", timeout=WAIT_S).text == first.text  # within the interval: kept
        time.sleep(1.1)
        blind = httpx.get(server.url + "/health", timeout=WAIT_S)
        assert blind.status_code == 503 and "did not apply the KV prompt" in blind.json()["checks"]["kv"]["detail"]
        engine.server.config.app.app = with_connector
        probed = set()
        for _ in range(2):  # one adapter a check, in turn: each gets checked
            time.sleep(1.1)
            again = httpx.get(server.url + "/health", timeout=WAIT_S)
            assert again.status_code == 200
            probed.add(re.search(r"applied '([\w-]+)' just now", again.text).group(1))
        assert probed == {"kv", "kv-2"}
    finally:
        server.stop()
        engine.stop()


class _Restartable:
    """An ASGI app standing for one vLLM address whose process is replaced (`app` swapped)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)


def test_a_request_in_flight_finishes_while_a_large_kv_adapter_is_being_put(tmp_path, monkeypatch):
    """Publishing a share file (write, hash) runs off the loop and under its own lock: a request in flight is
    answered, and its share file released, while the file of an adapter being PUT is still being written."""
    from test_ops import gated_vllm

    base = save_tiny(str(tmp_path / "tiny-base"))
    share = tmp_path / "share"
    share.mkdir(mode=0o750)
    front = Front(base, kv_share=str(share))
    front.add("kv", _adapter(base, str(tmp_path / "kv"), 5, prompt_level="kv"))
    large = _adapter(base, str(tmp_path / "large"), 6, prompt_level="kv", num_virtual_tokens=64)
    gate, seen = threading.Event(), []
    engine = _Server(gated_vllm(gate, seen))
    server = _Server(build_app(front, engine.url, UPSTREAM_MODEL, allow_adapter_updates=True))
    writing = threading.Event()
    slow_s = 3.0
    real_save = serve_share.save_file

    def slow_save(*args, **kwargs):  # a large adapter on a slow disk
        writing.set()
        time.sleep(slow_s)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(serve_share, "save_file", slow_save)
    answers, put = {}, {}
    try:
        asking = threading.Thread(target=lambda: answers.update(a=_ask(server.url, PROMPTS[0])))
        asking.start()
        deadline = time.time() + WAIT_S
        while not seen and time.time() < deadline:
            time.sleep(0.01)
        putting = threading.Thread(
            target=lambda: put.update(
                a=httpx.put(server.url + "/v1/adapters/large", json={"path": large}, timeout=WAIT_S)
            )
        )
        putting.start()
        assert writing.wait(WAIT_S)
        released = time.perf_counter()
        gate.set()
        asking.join(WAIT_S)
        took = time.perf_counter() - released
        assert answers["a"].status_code == 200 and took < 1.0, took  # not after the 3 s write
        assert httpx.get(server.url + "/v1/models", timeout=WAIT_S).status_code == 200
        putting.join(WAIT_S)
        assert put["a"].status_code == 200 and front.adapters["large"].positions == 64
    finally:
        gate.set()
        server.stop()
        engine.stop()
