"""`softprompt-plus serve` (serve/app.py, serve/front.py) against a fake vLLM upstream on loopback, driven by
the real `openai` client: what was forwarded (the exact embeddings, never a client tensor), streaming, adapters added
and removed while it runs, and every refusal."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import socket
import threading
import time

import httpx
import kv_connector_stub
import openai
import pytest
import serve_bodies
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig, prompt_embeds, student_text
from peft_softprompt_plus._names import VLLM_KV_PARAM
from peft_softprompt_plus.apps.tiny import save_tiny
from peft_softprompt_plus.files.content_hash import content_hash
from peft_softprompt_plus.serve.app import build_app
from peft_softprompt_plus.serve.front import Front
from peft_softprompt_plus.serve.requests import FrontError as FrontError_

TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|system|>You are a helpful bot.\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
UPSTREAM_MODEL = "the-base-as-vllm-names-it"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """An ASGI app served by uvicorn on loopback, in a thread, for one test module."""

    def __init__(self, app):
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def fake_vllm(
    record: list,
    refuse_embeds: bool = False,
    max_model_len: int = 100,
    kv_share: str | None = None,
    model: tuple[int, int, int] | None = None,
    streams: threading.Event | None = None,
    block_size: int | None = None,
) -> FastAPI:
    """Answers like vLLM's `/v1/completions`: "hello world" per choice (streamed in two pieces when asked). A
    request's `user` asks for vLLM's failures: "fail-400" (its message names server paths), "fail-500",
    "break-stream" (an error event after the first piece) and "bad-line" (a line that is not JSON). With `kv_share`,
    it runs this package's KV connector reading that folder for an engine serving `model` (layers, KV heads, head
    size; the tiny GPT-2 by default), which marks the requests it matched; as vLLM 0.32 does, a stream carries no
    mark. With `streams`, a KV request answered whole waits (2 s at most) for a stream to arrive, then clears it.
    With `block_size`, it keeps vLLM's prefix cache of blocks that size (kv_connector_stub.PrefixCache), and each
    choice's text says what the engine computed: the adapter's answer, the base's, or a wrong one."""
    app = FastAPI()
    connector = None if kv_share is None else kv_connector_stub.scheduler_connector(kv_share, model)
    cache = None if block_size is None or connector is None else kv_connector_stub.PrefixCache(connector, block_size)
    app.state.connector = connector

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": UPSTREAM_MODEL, "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        record.append(body)
        user = body.get("user")
        if refuse_embeds and "prompt_embeds" in body:
            message = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
            return JSONResponse({"error": {"message": message}}, status_code=400)
        if user == "fail-400":
            message = f"model {body['model']} at /srv/models/secret/config.json: top_k must be -1 or at least 1"
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        if user == "fail-500":
            return JSONResponse({"error": {"message": "Traceback in /srv/vllm/engine.py"}}, status_code=500)
        head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": body["model"]}
        n = body.get("n", 1)
        logprobs = None
        if body.get("logprobs") is not None:
            top = [{"hello": -0.1, "hi": -2.5, "hey": -3.0}, {" world": -0.2, " there": -1.9, "!": -4.0}]
            logprobs = {"tokens": ["hello", " world"], "token_logprobs": [-0.1, -0.2], "top_logprobs": top}
        if body.get("stream") and streams is not None:
            streams.set()
        if streams is not None and not body.get("stream") and "kv_transfer_params" in body:
            if not await asyncio.to_thread(streams.wait, 2.0):
                return JSONResponse({"error": {"message": "no stream beside this check"}}, status_code=500)
            streams.clear()
        if body.get("stream"):

            async def pieces():
                for i, text in enumerate(["hello", " world"]):
                    choices = [{"index": c, "text": text, "finish_reason": "length" if i else None} for c in range(n)]
                    yield f"data: {json.dumps({**head, 'choices': choices})}\n\n"
                    if user == "break-stream":
                        died = {"error": {"message": "engine died in /srv/x/y.py", "code": 500}}
                        yield f"data: {json.dumps(died)}\n\n"
                        return
                    if user == "bad-line":
                        yield "data: {not json\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(pieces(), media_type="text/event-stream")
        text, mark = "hello world", None
        if cache is not None:
            text, mark = cache.run(body)
        elif connector is not None:
            mark = kv_connector_stub.served_mark(connector, body)
        if mark is not None:  # vLLM returns the connector's `request_finished` params with the answer
            head["kv_transfer_params"] = mark
        choices = [{"index": c, "text": text, "finish_reason": "length", "logprobs": logprobs} for c in range(n)]
        return {
            **head,
            "choices": choices,
            "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n},
        }

    return app


def _adapter(base_dir, folder, seed: int, chat_format=None, prompt_level="input", num_virtual_tokens=4, **fields):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=num_virtual_tokens,
        chat_format=chat_format,
        prompt_level=prompt_level,
        **fields,
    )
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    model.save_pretrained(folder)
    return folder


KEY = "s3cret"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    base_dir = save_tiny(str(root / "tiny-base"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(base_dir)
    folders = {
        "plain": _adapter(base_dir, str(root / "plain"), 1, chat_format="template"),
        "student": _adapter(base_dir, str(root / "student"), 2, chat_format="student"),
        "bos": _adapter(base_dir, str(root / "bos"), 3, prompt_prefix_ids=[tokenizer.bos_token_id]),
    }
    record: list = []
    upstream = _Server(fake_vllm(record))
    front = Front(base_dir)
    for name, folder in folders.items():
        front.add(name, folder)
    server = _Server(build_app(front, upstream.url, UPSTREAM_MODEL, api_key=KEY, allow_adapter_updates=True))
    client = openai.OpenAI(api_key=KEY, base_url=f"{server.url}/v1", max_retries=0)
    yield {
        "root": root,
        "base": base_dir,
        "front": front,
        "record": record,
        "client": client,
        "url": server.url,
        "folders": folders,
        "upstream": upstream.url,
    }
    server.stop()
    upstream.stop()


def _http(stack, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    return httpx.request(method, f"{stack['url']}{path}", headers=headers, timeout=30, **kwargs)


def _sent_embeds(body) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(body["prompt_embeds"])), weights_only=True)


def _saved_hash(folder: str) -> str:
    """The content hash of the adapter files in `folder`, as saved: what the front's cache salt and a KV prompt's
    published file name must both be."""
    from safetensors.torch import load_file

    config = json.loads(open(f"{folder}/adapter_config.json").read())
    return content_hash(config, load_file(f"{folder}/adapter_model.safetensors"))


_FROM_DISK: dict = {}


def _expected(stack, folder: str, ids: list[int]) -> torch.Tensor:
    """The row as this library builds it from the adapter folder read fresh from disk (not the front's copy)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if folder not in _FROM_DISK:
        base = AutoModelForCausalLM.from_pretrained(stack["base"])
        _FROM_DISK[folder] = PeftModel.from_pretrained(base, folder).eval()
    return prompt_embeds(_FROM_DISK[folder], torch.tensor([ids]))[0]


def test_a_completion_by_adapter_name_forwards_that_adapter_s_exact_embeddings(stack):
    front, record, folders = stack["front"], stack["record"], stack["folders"]
    record.clear()
    answer = stack["client"].completions.create(model="plain", prompt="the cat sat", max_tokens=5, temperature=0)
    assert answer.model == "plain" and answer.choices[0].text == "hello world"
    (body,) = record
    assert body["model"] == UPSTREAM_MODEL and "prompt" not in body and body["max_tokens"] == 5
    ids = front.tokenizer("the cat sat")["input_ids"]
    sent = _sent_embeds(body)
    assert sent.shape == (4 + len(ids), front.base.config.hidden_size)
    assert torch.equal(sent, _expected(stack, folders["plain"], ids))
    assert not torch.equal(sent, _expected(stack, folders["student"], ids))  # the other adapter's prompt differs
    plain, student = (front.salts.current(front.adapters[n].content) for n in ("plain", "student"))
    assert body["cache_salt"] == plain != student and len(plain) == 32
    assert front.adapters["plain"].content == _saved_hash(folders["plain"]) != plain  # secret: no client derives it


def test_chat_is_formatted_the_way_each_adapter_was_trained(stack):
    front, record = stack["front"], stack["record"]
    messages = [{"role": "user", "content": "a dog ran"}]
    for name, text in [
        ("plain", front.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)),
        ("student", student_text(front.tokenizer, messages)),  # no default system prompt
    ]:
        record.clear()
        answer = stack["client"].chat.completions.create(model=name, messages=messages, max_tokens=4)
        assert answer.choices[0].message.content == "hello world" and answer.model == name
        ids = front.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert torch.equal(_sent_embeds(record[0]), _expected(stack, stack["folders"][name], ids))
    assert "helpful bot" in front.tokenizer.apply_chat_template(messages, tokenize=False)  # the check can tell
    system = [{"role": "system", "content": "be terse"}, *messages]
    with pytest.raises(openai.BadRequestError, match="`messages` holds a system message, but 'student' was distilled"):
        stack["client"].chat.completions.create(model="student", messages=system, max_tokens=4)


def test_an_adapter_whose_prefix_starts_with_bos_never_reads_a_second_one_on_either_route(stack):
    front, record = stack["front"], stack["record"]
    bos = front.tokenizer.bos_token
    text = bos + "the cat"
    ids = front.tokenizer(text)["input_ids"]
    assert ids[0] == front.tokenizer.bos_token_id
    record.clear()
    stack["client"].completions.create(model="bos", prompt=text, max_tokens=2)
    assert torch.equal(_sent_embeds(record[0]), _expected(stack, stack["folders"]["bos"], ids[1:]))
    # A chat template that starts with BOS (as Llama's does): the Chat route drops it too.
    front.tokenizer.chat_template = "{{ bos_token }}" + TEMPLATE
    try:
        record.clear()
        messages = [{"role": "user", "content": "hi"}]
        stack["client"].chat.completions.create(model="bos", messages=messages, max_tokens=2)
        chat = front.tokenizer(
            front.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        assert chat[0] == front.tokenizer.bos_token_id
        assert torch.equal(_sent_embeds(record[0]), _expected(stack, stack["folders"]["bos"], chat[1:]))
    finally:
        front.tokenizer.chat_template = TEMPLATE


def test_streaming_passes_the_pieces_through_as_chat_deltas(stack):
    stream = stack["client"].chat.completions.create(
        model="student", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream]
    assert "".join(d.content or "" for d in deltas) == "hello world" and deltas[0].role == "assistant"
    pieces = stack["client"].completions.create(model="plain", prompt="hi", max_tokens=4, stream=True)
    assert [c.choices[0].text for c in pieces] == ["hello", " world"]
    skipped = stack["client"].completions.create(
        model="plain", prompt="hi", max_tokens=4, stream=True, user="bad-line"
    )
    assert [c.choices[0].text for c in skipped] == ["hello", " world"]  # the line that is not JSON is skipped


def test_streaming_errors_are_a_status_before_the_first_piece_and_an_error_event_after_it(stack):
    client = stack["client"]
    with pytest.raises(openai.BadRequestError, match="top_k must be -1") as caught:
        client.completions.create(model="plain", prompt="hi", max_tokens=2, stream=True, user="fail-400")
    assert "/srv" not in str(caught.value)
    stream = client.completions.create(model="plain", prompt="hi", max_tokens=2, stream=True, user="break-stream")
    with pytest.raises(openai.APIError, match="the front's log has the details") as caught:
        for _ in stream:
            pass
    assert "/srv" not in str(caught.value)


def test_chat_logprobs_come_back_in_chat_s_shape(stack):
    answer = stack["client"].chat.completions.create(
        model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert [t.token for t in content] == ["hello", " world"] and content[0].logprob == -0.1
    assert [a.token for a in content[1].top_logprobs] == [" world", " there"]
    assert stack["record"][-1]["logprobs"] == 2


def test_the_base_by_its_own_name_is_forwarded_as_token_ids(stack):
    record = stack["record"]
    record.clear()
    stack["client"].completions.create(model="tiny-base", prompt="the cat", max_tokens=3)
    body = record[0]
    assert body["prompt"] == stack["front"].tokenizer("the cat")["input_ids"] and "prompt_embeds" not in body
    assert "cache_salt" not in body
    record.clear()
    stack["client"].completions.create(model="plain", prompt=[5, 6, 7], max_tokens=3)  # token ids to an adapter
    assert torch.equal(_sent_embeds(record[0]), _expected(stack, stack["folders"]["plain"], [5, 6, 7]))


def test_models_lists_the_adapters_and_they_change_without_a_restart(stack):
    client, front = stack["client"], stack["front"]
    assert sorted(m.id for m in client.models.list()) == ["bos", "plain", "student", "tiny-base"]
    third = _adapter(stack["base"], str(stack["root"] / "third"), 3)
    put = _http(stack, "PUT", "/v1/adapters/third", json={"path": third})
    assert put.status_code == 200 and put.json()["num_virtual_tokens"] == 4
    assert "third" in [m.id for m in client.models.list()]
    salt = front.salts.current(front.adapters["third"].content)
    replaced = _adapter(stack["base"], str(stack["root"] / "third-v2"), 4)
    assert _http(stack, "PUT", "/v1/adapters/third", json={"path": replaced}).status_code == 200
    assert front.salts.current(front.adapters["third"].content) != salt  # a replace changes the cache salt
    stack["record"].clear()
    client.completions.create(model="third", prompt="a", max_tokens=2)
    ids = front.tokenizer("a")["input_ids"]
    assert torch.equal(_sent_embeds(stack["record"][0]), _expected(stack, replaced, ids))
    # A replace that fails leaves the served adapter as it was.
    broken = stack["root"] / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    assert _http(stack, "PUT", "/v1/adapters/third", json={"path": str(broken)}).status_code == 400
    stack["record"].clear()
    client.completions.create(model="third", prompt="a", max_tokens=2)
    assert torch.equal(_sent_embeds(stack["record"][0]), _expected(stack, replaced, ids))
    assert _http(stack, "DELETE", "/v1/adapters/third").status_code == 200
    with pytest.raises(openai.NotFoundError, match=r"'third' is not served here: GET /v1/models") as caught:
        client.completions.create(model="third", prompt="a", max_tokens=2)
    assert "plain" not in str(caught.value)  # a 404 lists no adapters


def test_removing_an_adapter_never_waits_for_one_being_built(stack):
    front = stack["front"]
    front.add("spare", stack["folders"]["plain"])
    with front._build_lock:  # a PUT building meanwhile
        worker = threading.Thread(target=front.remove, args=("spare",))
        worker.start()
        worker.join(5)
        assert not worker.is_alive() and "spare" not in front.adapters


def test_adapter_changes_are_off_unless_allowed_and_take_local_folders_only(stack):
    locked = _Server(build_app(stack["front"], stack["upstream"], UPSTREAM_MODEL))
    try:
        for method in ("PUT", "DELETE"):
            answer = httpx.request(method, f"{locked.url}/v1/adapters/plain", json={"path": stack["folders"]["plain"]})
            assert answer.status_code == 403 and "--allow-adapter-updates" in answer.json()["error"]["message"]
    finally:
        locked.stop()
    hub_like = _http(stack, "PUT", "/v1/adapters/x", json={"path": "some-org/some-adapter"})
    assert hub_like.status_code == 400 and "local folders only" in hub_like.json()["error"]["message"]


def test_refusals_name_what_is_wrong(stack):
    client = stack["client"]
    # The engine's own max_model_len (100 here) is the limit, not the base config's 128.
    with pytest.raises(openai.BadRequestError, match=r"needs 10\d positions .* the model has 100"):
        client.completions.create(model="plain", prompt="the cat sat", max_tokens=95)
    with pytest.raises(openai.BadRequestError, match="`max_tokens` must be an integer from 1 to 4096"):
        client.completions.create(model="plain", prompt="a", max_tokens=5000)
    sent = _http(stack, "POST", "/v1/completions", json={"model": "plain", "prompt_embeds": "AAAA", "prompt": "x"})
    assert sent.status_code == 400 and "not accepted from clients" in sent.json()["error"]["message"]
    # An adapter saved from a base of another width: refused when it is loaded, the served ones untouched.
    other = save_tiny(str(stack["root"] / "tiny-base-wide"), n_embd=32)
    wide = _adapter(other, str(stack["root"] / "tiny-base-wide-adapter"), 6)
    refused = _http(stack, "PUT", "/v1/adapters/wide", json={"path": wide})
    assert refused.status_code == 400 and "trained on" in refused.json()["error"]["message"]
    # A KV prompt: vLLM takes embeddings, from which it computes every layer's keys itself.
    kv = _adapter(stack["base"], str(stack["root"] / "kv-adapter"), 7, prompt_level="kv")
    refused = _http(stack, "PUT", "/v1/adapters/kv", json={"path": kv})
    assert refused.status_code == 400 and "is a KV prompt (prompt_level='kv')" in refused.json()["error"]["message"]
    assert sorted(stack["front"].adapters) == ["bos", "plain", "student"]


def test_bodies_past_the_limit_are_refused_before_they_are_read(stack):
    front = stack["front"]
    front.limits = dataclasses.replace(front.limits, max_body_bytes=4096)
    try:
        big = {"model": "plain", "prompt": "x " * 5000}
        declared = _http(stack, "POST", "/v1/completions", json=big)
        assert declared.status_code == 413 and "--max-body-bytes" in declared.json()["error"]["message"]
        chunks = (piece for piece in [json.dumps(big).encode()[i : i + 1000] for i in range(0, 10100, 1000)])
        streamed = _http(stack, "POST", "/v1/completions", content=chunks)  # no Content-Length
        assert streamed.status_code == 413
    finally:
        front.limits = dataclasses.replace(front.limits, max_body_bytes=2 << 20)


def test_upstream_failures_name_no_address_or_path(stack):
    front, client = stack["front"], stack["client"]
    with pytest.raises(openai.BadRequestError, match="top_k must be -1") as caught:
        client.completions.create(model="plain", prompt="hi", max_tokens=2, user="fail-400")
    assert "/srv" not in str(caught.value) and UPSTREAM_MODEL not in str(caught.value)
    with pytest.raises(openai.APIStatusError, match=r"the engine failed \(500\)") as caught:
        client.completions.create(model="plain", prompt="hi", max_tokens=2, user="fail-500")
    assert caught.value.status_code == 502 and "/srv" not in str(caught.value)
    port = _free_port()
    down = _Server(build_app(front, f"http://127.0.0.1:{port}", UPSTREAM_MODEL))
    refusing = _Server(fake_vllm([], refuse_embeds=True))
    behind = _Server(build_app(front, refusing.url, UPSTREAM_MODEL))
    try:
        for server, words in [(down, "can't be reached"), (behind, "--enable-prompt-embeds")]:
            c = openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError, match=words) as caught:
                    c.completions.create(model="plain", prompt="hi", max_tokens=2, stream=stream)
                assert caught.value.status_code == 502 and str(port) not in str(caught.value)
    finally:
        for server in (down, behind, refusing):
            server.stop()


def test_the_key_is_required_and_the_host_must_be_this_machine_s(stack):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{stack['url']}/v1", max_retries=0).models.list()
    assert "plain" in [m.id for m in stack["client"].models.list()]
    rebound = _http(stack, "GET", "/v1/models", headers={"Host": "attacker.example:8100"})
    assert rebound.status_code == 400 and "'attacker.example'" in rebound.json()["error"]["message"]
    assert _http(stack, "GET", "/v1/models", headers={"Host": "localhost:1"}).status_code == 200


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--base", "nowhere"], "`--base`='nowhere' is not a folder"),
        (["--host", "0.0.0.0"], "pass --api-key"),
        (["--allow-adapter-updates"], "`--allow-adapter-updates` lets a client load any folder"),
        (["--max-n", "0"], "`--max-n` takes a positive integer, got '0'"),
        (["--compose", "ab=a"], "`--compose` takes NAME=A,B[,...] (two or more loaded KV adapters' names)"),
    ],
)
def test_the_cli_refuses_before_loading_anything(stack, argv, words, capsys, monkeypatch):
    from peft_softprompt_plus.apps.cli import main

    monkeypatch.delenv("SOFTPROMPT_PLUS_API_KEY", raising=False)
    args = ["serve", "--base", stack["base"], *argv] if argv[0] != "--base" else ["serve", *argv]
    try:
        code = main(args)
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    assert code == 2 and words in capsys.readouterr().err


def test_several_prompts_are_one_upstream_request_each_numbered_like_openai(stack):
    record = stack["record"]
    record.clear()
    answer = stack["client"].completions.create(model="plain", prompt=["the cat", "a dog ran"], max_tokens=3, n=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3] and answer.usage.completion_tokens == 8
    sent = sorted((_sent_embeds(body) for body in record), key=len)
    tokenizer = stack["front"].tokenizer
    for text, tensor in zip(["the cat", "a dog ran"], sent, strict=True):
        assert torch.equal(tensor, _expected(stack, stack["folders"]["plain"], tokenizer(text)["input_ids"]))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_get_a_json_4xx_or_a_200_and_the_front_keeps_serving(stack, data):
    models = ["plain", "student", "tiny-base"]
    vocab = stack["front"].embedding.num_embeddings
    if data.draw(st.booleans()):
        route, body, name = data.draw(serve_bodies.malformed(models, vocab))
        path = "/v1/" + ("chat/completions" if route == "chat" else "completions")
        answer = _http(stack, "POST", path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and f"`{name}" in answer.json()["error"]["message"], (body, answer.text)
    else:
        route = data.draw(st.sampled_from(["completions", "chat"]))
        short = serve_bodies.SHORT  # what fits the tiny model's 128 positions
        valid = serve_bodies.completion(models, vocab, short) if route == "completions" else None
        body = data.draw(valid or serve_bodies.chat(models, short))
        answer = _http(stack, "POST", "/v1/" + ("chat/completions" if route == "chat" else "completions"), json=body)
        assert answer.status_code == 200, (body, answer.text)
    ok = stack["client"].completions.create(model="plain", prompt="a", max_tokens=1)
    assert ok.choices[0].text == "hello world"


def test_kv_adapters_go_to_vllm_s_connector_as_placeholders_and_their_published_keys_values(stack):
    from safetensors.torch import load_file

    from peft_softprompt_plus.files.inspect_adapter import read_adapter
    from peft_softprompt_plus.serve.kv_fields import check_served

    front = stack["front"]
    share = stack["root"] / "kv-share"
    share.mkdir(mode=0o750, exist_ok=True)
    kv = _adapter(stack["base"], str(stack["root"] / "kv-served"), 8, prompt_level="kv")
    front.kv_share = str(share)
    record: list = []
    elsewhere = stack["root"] / "kv-share-elsewhere"
    elsewhere.mkdir(mode=0o750, exist_ok=True)
    upstreams = [
        _Server(fake_vllm(record, kv_share=str(share))),
        _Server(fake_vllm([])),
        _Server(fake_vllm([], kv_share=str(elsewhere))),
        _Server(fake_vllm([], kv_share=str(share), streams=threading.Event())),  # a check waits for its stream
    ]
    servers = [_Server(build_app(front, u.url, UPSTREAM_MODEL, api_key=KEY)) for u in upstreams]
    try:
        adapter = front.add("kv", kv)
        (published,) = share.glob("*.safetensors")
        assert published.stem == adapter.kv and adapter.positions == 4 and adapter.block is None
        assert adapter.kv == adapter.content == _saved_hash(kv)  # the input adapters' content is the same function's
        assert torch.equal(load_file(str(published))["kv_prompt"], read_adapter(kv)[1])  # as read from disk
        client = openai.OpenAI(api_key=KEY, base_url=f"{servers[0].url}/v1", max_retries=0)
        answer = client.completions.create(model="kv", prompt="the cat", max_tokens=3)
        assert answer.choices[0].text == "hello world" and "kv_transfer_params" not in answer.model_dump()
        (body,) = record
        ids = front.tokenizer("the cat")["input_ids"]
        assert body["prompt"] == [front.placeholder] * 4 + ids and "prompt_embeds" not in body
        assert body["kv_transfer_params"] == {VLLM_KV_PARAM: adapter.kv}
        assert body["cache_salt"] == front.salts.current(adapter.content) != adapter.kv  # the share names no salt
        for _ in range(2):  # every stream is checked after its first chunk: a request of one computed position
            pieces = client.completions.create(model="kv", prompt="the cat", max_tokens=3, stream=True, n=2)
            assert [[x.text for x in c.choices] for c in pieces] == [["hello"] * 2, [" world"] * 2]
        streamed = [b for b in record[1:] if b.get("stream")]
        checks = [b for b in record[1:] if not b.get("stream")]
        assert [b["prompt"] for b in streamed] == [body["prompt"]] * 2
        assert checks == [{**{k: body[k] for k in ("model", "cache_salt", "kv_transfer_params")}, "max_tokens": 1,
                           "prompt": [front.placeholder] * 4 + ids[:1]}] * 2  # fmt: skip
        beside = openai.OpenAI(api_key=KEY, base_url=f"{servers[3].url}/v1", max_retries=0)
        pieces = beside.completions.create(model="kv", prompt="the cat", max_tokens=3, stream=True)
        assert [c.choices[0].text for c in pieces] == ["hello", " world"]  # its check was sent once it streamed
        # A vLLM started without the connector, or with one reading another folder, would read the placeholders as
        # text: refused, streamed or not, though the same KV prompt was seen applied by another engine.
        for server in servers[1:3]:
            blind = openai.OpenAI(api_key=KEY, base_url=f"{server.url}/v1", max_retries=0)
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError, match="did not apply the KV prompt") as caught:
                    blind.completions.create(model="kv", prompt="the cat", max_tokens=3, stream=stream)
                assert caught.value.status_code == 502
        with pytest.raises(FrontError_, match="did not apply"):
            check_served({"choices": []}, adapter.kv)
        late = _adapter(stack["base"], str(stack["root"] / "kv-late"), 9, prompt_level="kv", kv_text_start=6)
        with pytest.raises(FrontError_, match="kv_text_start=6, not N=4.*learned absolute position embeddings"):
            front.add("late", late)
    finally:
        front.kv_share = None
        front.adapters = {k: v for k, v in front.adapters.items() if k != "kv"}
        for server in (*servers, *upstreams):
            server.stop()


def test_the_cli_s_host_names_add_to_loopback_and_limit_a_public_front(stack, monkeypatch):
    from peft_softprompt_plus.apps.cli import main
    from peft_softprompt_plus.serve import app as serve

    seen = []
    monkeypatch.setattr(serve, "main", lambda args: seen.append(args) or 0)
    monkeypatch.delenv("SOFTPROMPT_PLUS_API_KEY", raising=False)
    base = ["serve", "--base", stack["base"], "--upstream", "http://127.0.0.1:9"]
    assert main(base) == 0 and seen[-1].allowed_hosts == ("localhost", "127.0.0.1", "::1")
    assert main([*base, "--compose", "ab=a,b", "--compose", "abc=a,b,c"]) == 0
    assert seen[-1].compose == [("ab", ["a", "b"]), ("abc", ["a", "b", "c"])]
    assert main([*base, "--allowed-host", "Proxy.Local"]) == 0
    assert seen[-1].allowed_hosts == ("localhost", "127.0.0.1", "::1", "proxy.local")
    public = [*base, "--host", "0.0.0.0", "--api-key", "k"]
    assert main(public) == 0 and seen[-1].allowed_hosts is None
    assert main([*public, "--allowed-host", "api.example"]) == 0 and seen[-1].allowed_hosts == ("api.example",)
    assert seen[-1].limits.max_n == 8 and seen[-1].engine_version is None  # nothing answers at :9
