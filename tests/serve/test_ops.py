"""What an operator reads and bounds on `softprompt-plus serve` (serve/ops.py, serve/share.py), against fake
vLLMs on loopback: `/health`, `/metrics`, the limits on the work in flight (a bounded burst: every request answered,
200 or 429), the KV share's files (re-hashed, group-readable, removed once unused) and the fields a client can't set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from test_app import UPSTREAM_MODEL, _adapter, _free_port, _Server, fake_vllm

from peft_softprompt_plus._names import VLLM_KV_PARAM, VLLM_KV_SERVED, VLLM_KV_TENSOR
from peft_softprompt_plus.apps.tiny import save_tiny
from peft_softprompt_plus.files.inspect_adapter import read_adapter
from peft_softprompt_plus.serve.app import build_app
from peft_softprompt_plus.serve.front import Front
from peft_softprompt_plus.serve.share import FILE_MODE

WAIT_S = 20  # the most any wait here takes before the test fails


def gated_vllm(gate: threading.Event, seen: list) -> FastAPI:
    """A vLLM stand-in that holds every completion until `gate` is set, then answers it, marking a KV request served
    as the connector would."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": UPSTREAM_MODEL, "max_model_len": 100}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        deadline = time.time() + WAIT_S
        while not gate.is_set() and time.time() < deadline:
            await asyncio.sleep(0.01)
        n = body.get("n", 1)
        answer = {
            "id": "cmpl-1",
            "choices": [{"index": c, "text": "hi", "finish_reason": "length"} for c in range(n)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n},
        }
        if "kv_transfer_params" in body:
            answer["kv_transfer_params"] = {VLLM_KV_SERVED: body["kv_transfer_params"][VLLM_KV_PARAM]}
        return answer

    return app


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    """One front (an input adapter, two KV adapters' folders, a share) behind three apps: in front of a vLLM stand-in
    that answers at once, one that runs the KV connector on the share, and one that holds requests (`gate`)."""
    root = tmp_path_factory.mktemp("serve-ops")
    base = save_tiny(str(root / "tiny-base"))
    share = root / "share"
    share.mkdir(mode=0o750)
    folders = {name: _adapter(base, str(root / name), seed, prompt_level=level) for name, seed, level in FOLDERS}
    front = Front(base, kv_share=str(share))
    front.add("plain", folders["plain"])
    gate, seen = threading.Event(), []
    upstreams = {
        "plain": _Server(fake_vllm([])),
        "kv": _Server(fake_vllm([], kv_share=str(share))),
        "gated": _Server(gated_vllm(gate, seen)),
    }
    fronts = {
        k: _Server(build_app(front, u.url, UPSTREAM_MODEL, allow_adapter_updates=True, health_interval=0))
        for k, u in upstreams.items()
    }
    yield {
        "front": front,
        "share": share,
        "folders": folders,
        "gate": gate,
        "seen": seen,
        "url": {k: f.url for k, f in fronts.items()},
        "upstream": {k: u.url for k, u in upstreams.items()},
    }
    gate.set()
    for server in (*fronts.values(), *upstreams.values()):
        server.stop()


FOLDERS = [("plain", 1, "input"), ("kv-a", 2, "kv"), ("kv-b", 3, "kv")]


def _post(url: str, body: dict, route: str = "completions") -> httpx.Response:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    return httpx.post(url + path, json=body, timeout=WAIT_S)


def _samples(url: str) -> dict:
    """`/metrics` as {(sample name, sorted labels): value}."""
    answer = httpx.get(url + "/metrics", timeout=WAIT_S)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _held_request(url: str, seen: list, held: dict, model: str) -> threading.Thread:
    """A request for `model` sent in a thread (its answer into `held["a"]`), returned once the gated vLLM holds it."""
    seen.clear()
    worker = threading.Thread(target=lambda: held.update(a=_post(url, {"model": model, "prompt": "the cat"})))
    worker.start()
    _wait_for(lambda: len(seen) == 1)
    return worker


def _wait_for(condition) -> None:
    deadline = time.time() + WAIT_S
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    assert condition()


def test_health_says_what_it_checked_and_is_503_when_requests_can_t_be_served(ops):
    front, url = ops["front"], ops["url"]
    answer = httpx.get(url["plain"] + "/health", timeout=WAIT_S)
    assert answer.status_code == 200 and answer.json()["status"] == "ok"
    checks = answer.json()["checks"]
    assert checks["engine"]["ok"] and checks["kv"] == {"ok": True, "detail": "no KV adapter is loaded."}
    down = _Server(build_app(front, f"http://127.0.0.1:{_free_port()}", UPSTREAM_MODEL))
    other = _Server(build_app(front, ops["upstream"]["plain"], "another-model"))
    try:
        answer = httpx.get(down.url + "/health", timeout=WAIT_S)
        assert answer.status_code == 503 and answer.json()["status"] == "unavailable"
        assert "can't be reached" in answer.json()["checks"]["engine"]["detail"]
        assert answer.json()["checks"]["kv"]["ok"] is False
        answer = httpx.get(other.url + "/health", timeout=WAIT_S)
        assert answer.status_code == 503 and "does not serve the model" in answer.json()["checks"]["engine"]["detail"]
    finally:
        down.stop()
        other.stop()
    adapter = front.add("kv-a", ops["folders"]["kv-a"])
    try:
        blind = httpx.get(url["plain"] + "/health", timeout=WAIT_S)  # a vLLM without the connector
        assert blind.status_code == 503 and "did not apply the KV prompt" in blind.json()["checks"]["kv"]["detail"]
        applied = httpx.get(url["kv"] + "/health", timeout=WAIT_S)  # one KV prompt sent for one token, and applied
        assert applied.status_code == 200 and "applied 'kv-a' just now (1 KV adapters)" in applied.text
        os.remove(ops["share"] / f"{adapter.kv}.safetensors")
        gone = httpx.get(url["kv"] + "/health", timeout=WAIT_S)
        detail = gone.json()["checks"]["kv"]["detail"]
        assert gone.status_code == 503 and "1 KV prompt files were missing from the share" in detail
        assert (ops["share"] / f"{adapter.kv}.safetensors").exists()  # written again from memory
        assert httpx.get(url["kv"] + "/health", timeout=WAIT_S).status_code == 200
    finally:
        front.remove("kv-a")


def test_metrics_count_requests_errors_latency_and_tokens_by_served_adapter_only(ops):
    url, front = ops["url"]["plain"], ops["front"]
    front.add("spare", ops["folders"]["plain"])
    for _ in range(3):
        assert _post(url, {"model": "plain", "prompt": "a b", "max_tokens": 2, "n": 2}).status_code == 200
    assert _post(url, {"model": "plain", "prompt": "a", "max_tokens": "x"}).status_code == 400
    assert _post(url, {"model": "tiny-base", "prompt": "a", "max_tokens": 2}).status_code == 200
    assert _post(url, {"model": "spare", "prompt": "a", "max_tokens": 2}).status_code == 200
    for name in ("no-such-adapter-1", "no-such-adapter-2"):
        assert _post(url, {"model": name, "prompt": "a"}).status_code == 404
    streamed = httpx.post(url + "/v1/completions", json={"model": "plain", "prompt": "a", "stream": True}, timeout=9)
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    got = _samples(url)
    assert _value(got, "softprompt_plus_requests_total", adapter="plain", route="completions") == 5
    assert _value(got, "softprompt_plus_request_errors_total", adapter="plain", route="completions", code="400") == 1
    assert _value(got, "softprompt_plus_request_seconds_count", adapter="plain", route="completions") == 5
    assert _value(got, "softprompt_plus_tokens_total", adapter="plain", kind="completion") == 3 * 2 * 2
    assert _value(got, "softprompt_plus_tokens_total", adapter="plain", kind="prompt") == 3 * 3
    assert _value(got, "softprompt_plus_requests_total", adapter="tiny-base", route="completions") == 1
    assert _value(got, "softprompt_plus_request_errors_total", adapter="unknown", route="completions", code="404") == 2
    assert _value(got, "softprompt_plus_requests_in_flight") == 0
    assert _value(got, "softprompt_plus_tokens_in_flight") == 0
    assert _value(got, "process_cpu_seconds_total") > 0
    labels = {dict(labels).get("adapter") for _, labels in got} - {None}
    assert labels == {"plain", "spare", "tiny-base", "unknown"}  # no label set for a name nothing serves
    assert httpx.delete(url + "/v1/adapters/spare", timeout=WAIT_S).status_code == 200
    assert _post(url, {"model": "spare", "prompt": "a"}).status_code == 404
    got = _samples(url)
    assert "spare" not in {dict(labels).get("adapter") for _, labels in got}  # its series went with it
    assert _value(got, "softprompt_plus_request_errors_total", adapter="unknown", route="completions", code="404") == 3


def test_a_burst_past_max_in_flight_is_answered_200_or_429_with_retry_after_and_none_is_lost(ops):
    front, gate, url = ops["front"], ops["gate"], ops["url"]["gated"]
    before = _samples(url)
    front.limits = dataclasses.replace(front.limits, max_in_flight=4)
    gate.clear()
    try:

        async def burst(count: int) -> list:
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
                body = {"model": "plain", "prompt": "a", "max_tokens": 2}
                tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(count)]
                deadline = time.time() + WAIT_S
                while sum(t.done() for t in tasks) < count - 4 and time.time() < deadline:
                    await asyncio.sleep(0.01)
                early = [t.result() for t in tasks if t.done()]  # refused while 4 are held upstream
                gate.set()
                return early, await asyncio.gather(*tasks)

        early, answers = asyncio.run(burst(16))
    finally:
        front.limits = dataclasses.replace(front.limits, max_in_flight=256)
        gate.set()
    assert len(early) == 12 and {a.status_code for a in early} == {429}
    assert all(a.headers["retry-after"] == "1" and "--max-in-flight" in a.text for a in early)
    assert sorted(a.status_code for a in answers) == [200] * 4 + [429] * 12  # every request answered
    assert _post(url, {"model": "plain", "prompt": "a", "max_tokens": 2}).status_code == 200  # and still serving
    after = _samples(url)
    counted = ("softprompt_plus_requests_total", "softprompt_plus_request_errors_total")
    total, refused = (
        _value(after, n, adapter="plain", route="completions", **c)
        - _value(before, n, adapter="plain", route="completions", **c)
        for n, c in zip(counted, ({}, {"code": "429"}), strict=True)
    )
    assert (total, refused) == (17, 12) and _value(after, "softprompt_plus_requests_in_flight") == 0
    limited = _value(after, "softprompt_plus_refusals_total", reason="max_in_flight")
    assert limited - _value(before, "softprompt_plus_refusals_total", reason="max_in_flight") == 12


def test_tokens_in_flight_are_bounded_by_prompts_x_n_x_max_tokens(ops):
    front, gate, seen, url = ops["front"], ops["gate"], ops["seen"], ops["url"]["gated"]
    front.limits = dataclasses.replace(front.limits, max_tokens_in_flight=100)
    gate.clear()
    seen.clear()
    held = {}
    try:
        worker = threading.Thread(
            target=lambda: held.update(a=_post(url, {"model": "plain", "prompt": "a", "n": 2, "max_tokens": 40}))
        )
        worker.start()  # 2 x 40 = 80 tokens in flight
        _wait_for(lambda: len(seen) == 1)
        past = _post(url, {"model": "plain", "prompt": "a", "max_tokens": 30})  # 80 + 30 > 100
        assert past.status_code == 429 and past.headers["retry-after"] == "1"
        assert "ask for 80 tokens; with this one's 30" in past.json()["error"]["message"]
        never = _post(url, {"model": "plain", "prompt": ["a", "b"], "n": 2, "max_tokens": 30})  # 120 alone
        assert never.status_code == 400 and "--max-tokens-in-flight" in never.json()["error"]["message"]
        chat = _post(url, {"model": "plain", "messages": [{"role": "user", "content": "a"}]}, "chat")  # 512 by default
        assert chat.status_code == 400 and "asks for 512 tokens" in chat.json()["error"]["message"]
        gate.set()
        worker.join(WAIT_S)
        assert held["a"].status_code == 200
        assert _post(url, {"model": "plain", "prompt": "a", "max_tokens": 30}).status_code == 200
    finally:
        front.limits = dataclasses.replace(front.limits, max_tokens_in_flight=1 << 20)
        gate.set()


def test_share_files_are_rehashed_group_readable_and_removed_once_nothing_reads_them(ops):
    from test_app import _saved_hash

    front, share, folders, gate, seen = ops["front"], ops["share"], ops["folders"], ops["gate"], ops["seen"]
    # A planted file under kv-a's name, and a torn one under kv-b's: both replaced by what the adapters hold.
    digests = {name: _saved_hash(folders[name]) for name in ("kv-a", "kv-b")}
    right = {name: read_adapter(folders[name])[1] for name in digests}
    save_file({VLLM_KV_TENSOR: torch.zeros_like(right["kv-a"])}, str(share / f"{digests['kv-a']}.safetensors"))
    (share / f"{digests['kv-b']}.safetensors").write_bytes(b"not a safetensors file")
    for name, digest in digests.items():
        assert front.add(name, folders[name]).kv == digest
        path = share / f"{digest}.safetensors"
        assert torch.equal(load_file(str(path))[VLLM_KV_TENSOR], right[name])
        assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE == 0o640  # vLLM as another user of the group reads it
    assert sorted(p.name for p in share.iterdir()) == sorted(f"{d}.safetensors" for d in digests.values())
    # Replaced: kv-b now serves kv-a's prompt, and kv-b's old file goes.
    url = ops["url"]["gated"]
    assert httpx.put(url + "/v1/adapters/kv-b", json={"path": folders["kv-a"]}, timeout=WAIT_S).status_code == 200
    assert not (share / f"{digests['kv-b']}.safetensors").exists()
    assert httpx.delete(url + "/v1/adapters/kv-b", timeout=WAIT_S).status_code == 200
    # Removed while a request reads it: the file stays until that request is answered.
    gate.clear()
    held = {}
    try:
        worker = _held_request(url, seen, held, "kv-a")
        assert httpx.delete(url + "/v1/adapters/kv-a", timeout=WAIT_S).status_code == 200
        assert (share / f"{digests['kv-a']}.safetensors").exists()
        gate.set()
        worker.join(WAIT_S)
    finally:
        gate.set()
    assert held["a"].status_code == 200 and seen[0]["kv_transfer_params"] == {VLLM_KV_PARAM: digests["kv-a"]}
    _wait_for(lambda: list(share.iterdir()) == [])  # removed off the loop once the request is answered
    assert front.share.hold(digests["kv-a"]) is False  # a request that resolved it just before: refused, not sent


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("name, value", [("kv_transfer_params", {VLLM_KV_PARAM: "0" * 32}), ("cache_salt", "x")])
def test_a_client_s_kv_transfer_params_or_cache_salt_is_refused_by_name(ops, route, name, value):
    body = {"model": "plain", "prompt": "a"} if route == "completions" else {"model": "plain", "messages": []}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "a"}]
    answer = _post(ops["url"]["plain"], {**body, name: value}, route)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(f"`{name}` is not accepted from clients: ")


def test_prompt_bytes_in_flight_are_bounded_and_counted(ops):
    """An input adapter's request builds `[N+L, D]` float32 rows, base64 and JSON: counted before they are built."""
    from peft_softprompt_plus.serve.ops import prompt_bytes

    front, gate, seen, url = ops["front"], ops["gate"], ops["seen"], ops["url"]["gated"]
    ids = len(front.tokenizer("a b c")["input_ids"])
    one = prompt_bytes(front.adapters["plain"], ids, front.base.config.hidden_size)
    assert one > (4 + ids) * front.base.config.hidden_size * 4 * 2  # the rows, and their base64 twice over
    before = _samples(url)
    front.limits = dataclasses.replace(front.limits, max_prompt_bytes_in_flight=one + one // 2)
    gate.clear()
    seen.clear()
    held = {}
    try:
        worker = threading.Thread(target=lambda: held.update(a=_post(url, {"model": "plain", "prompt": "a b c"})))
        worker.start()
        _wait_for(lambda: len(seen) == 1)
        assert _value(_samples(url), "softprompt_plus_prompt_bytes_in_flight") == one
        second = _post(url, {"model": "plain", "prompt": "a b c"})
        assert second.status_code == 429 and "--max-prompt-bytes-in-flight" in second.text
        assert second.headers["retry-after"] == "1"
        alone = _post(url, {"model": "plain", "prompt": ["a b c", "a b c"]})  # two rows: past the limit alone
        assert alone.status_code == 400 and f"more than it takes in flight at all ({one + one // 2}" in alone.text
        gate.set()
        worker.join(WAIT_S)
    finally:
        front.limits = dataclasses.replace(front.limits, max_prompt_bytes_in_flight=1 << 30)
        gate.set()
    assert held["a"].status_code == 200
    after = _samples(url)
    assert _value(after, "softprompt_plus_prompt_bytes_in_flight") == 0
    reason = {"reason": "max_prompt_bytes_in_flight"}
    assert (
        _value(after, "softprompt_plus_refusals_total", **reason)
        - _value(before, "softprompt_plus_refusals_total", **reason)
        == 2
    )


def test_a_slow_body_is_a_408_and_a_slow_request_a_504_each_counted(ops):
    import socket

    front, gate, url = ops["front"], ops["gate"], ops["url"]["gated"]
    before = _samples(url)
    front.limits = dataclasses.replace(front.limits, body_timeout=1, request_timeout=3)
    gate.clear()
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            raw.sendall((head + "Content-Length: 100\r\n\r\n" + '{"model": "plain",').encode())  # and no more
            started = time.perf_counter()
            reply = b""
            while b"}}" not in reply:  # the head, then the JSON error
                piece = raw.recv(4096)
                assert piece, reply
                reply += piece
            assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout" in reply
            assert 0.9 < time.perf_counter() - started < 2.5
        front.limits = dataclasses.replace(front.limits, request_timeout=1)
        started = time.perf_counter()
        slow = _post(url, {"model": "plain", "prompt": "a", "max_tokens": 2})  # held upstream past the limit
        assert slow.status_code == 504 and "--request-timeout" in slow.text and time.perf_counter() - started < 5
        with httpx.stream(
            "POST", url + "/v1/completions", json={"model": "plain", "prompt": "a", "stream": True}, timeout=WAIT_S
        ) as stream:
            assert stream.status_code == 504  # held before its first byte: still an HTTP status
    finally:
        front.limits = dataclasses.replace(front.limits, body_timeout=30, request_timeout=600)
        gate.set()
    after = _samples(url)
    for reason, count in (("body_timeout", 1), ("request_timeout", 2)):
        counted = _value(after, "softprompt_plus_refusals_total", reason=reason)
        assert counted - _value(before, "softprompt_plus_refusals_total", reason=reason) == count
    assert _value(after, "softprompt_plus_requests_in_flight") == 0
    assert _post(url, {"model": "plain", "prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(("mode", "owner", "why"), [
    (0o755, None, "has mode 755: others may list it"),
    (0o770, None, "has mode 770"),
    (0o777, None, "has mode 777"),
    (0o750, 4321, "belongs to user id 4321, not to this front's"),
])  # fmt: skip
def test_the_share_folder_must_be_the_front_s_own_and_closed_to_others(tmp_path, mode, owner, why):
    from peft_softprompt_plus.serve.share import check_folder

    share = tmp_path / "share"
    share.mkdir()
    os.chmod(share, mode)
    if owner is not None:
        os.chown(share, owner, -1)
    with pytest.raises(ValueError, match=f"`--kv-share`=.* {why}"):
        check_folder(str(share))
    os.chmod(share, 0o751)  # others may pass through to a file they know the name of, not list it
    if owner is None:
        check_folder(str(share))


def test_the_cli_makes_a_missing_share_folder_closed_and_refuses_an_open_one(tmp_path, monkeypatch, capsys):
    from peft_softprompt_plus.apps.cli import main
    from peft_softprompt_plus.serve import app as serve

    monkeypatch.setattr(serve, "main", lambda args: 0)
    base = save_tiny(str(tmp_path / "tiny-base"))
    share = tmp_path / "made" / "share"
    common = ["serve", "--base", base, "--upstream", "http://127.0.0.1:9"]
    assert main([*common, "--kv-share", str(share)]) == 0
    assert stat.S_IMODE(share.stat().st_mode) == 0o750
    os.chmod(share, 0o777)
    assert main([*common, "--kv-share", str(share)]) == 2
    assert f"error: `--kv-share`={str(share)!r} has mode 777" in capsys.readouterr().err


def test_serving_without_prometheus_client_names_the_serve_extra(tmp_path, monkeypatch, capsys):
    import sys

    from peft_softprompt_plus.apps.cli import main

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed
    base = save_tiny(str(tmp_path / "tiny-base"))
    assert main(["serve", "--base", base, "--upstream", "http://127.0.0.1:9"]) == 2
    assert "serving needs the `serve` extra: pip install 'peft-softprompt-plus[serve]'" in capsys.readouterr().err


def test_a_removal_never_holds_up_the_answer_of_the_request_that_frees_its_file(ops, monkeypatch):
    """A `DELETE`d adapter's file goes once its last request is answered, in a worker thread: a slow disk's removal
    (2 s here) delays neither that answer nor another request."""
    front, share, folders, gate, seen = ops["front"], ops["share"], ops["folders"], ops["gate"], ops["seen"]
    url = ops["url"]["gated"]
    digest = front.add("kv-a", folders["kv-a"]).kv
    path = share / f"{digest}.safetensors"
    real_remove, removing = os.remove, threading.Event()

    def slow_remove(target, *args, **kwargs):
        if str(target) == str(path):
            removing.set()
            time.sleep(2.0)
        return real_remove(target, *args, **kwargs)

    monkeypatch.setattr(os, "remove", slow_remove)
    gate.clear()
    held = {}
    try:
        worker = _held_request(url, seen, held, "kv-a")
        assert httpx.delete(url + "/v1/adapters/kv-a", timeout=WAIT_S).status_code == 200
        assert path.exists()  # its request still reads it
        released = time.perf_counter()
        gate.set()
        worker.join(WAIT_S)
        took = time.perf_counter() - released
        assert held["a"].status_code == 200 and took < 1.0, took
        assert removing.wait(WAIT_S)  # the removal runs, slowly, while the front goes on serving
        started = time.perf_counter()
        assert httpx.get(url + "/v1/models", timeout=WAIT_S).status_code == 200
        assert time.perf_counter() - started < 1.0
    finally:
        gate.set()
    _wait_for(lambda: not path.exists())
