"""`softprompt-plus serve` (apps/serve.py, apps/serve_front.py) against a fake vLLM upstream on loopback, driven by
the real `openai` client: what was forwarded (the exact embeddings, never a client tensor), streaming, adapters added
and removed while it runs, and every refusal."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from peft import get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig, prompt_embeds, student_text
from peft_softprompt_plus.apps.serve import build_app
from peft_softprompt_plus.apps.serve_front import Front
from peft_softprompt_plus.apps.tiny import save_tiny

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


def fake_vllm(record: list, refuse_embeds: bool = False) -> FastAPI:
    """Answers like vLLM's `/v1/completions`: "hello world" (streamed in two pieces when asked)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        record.append(body)
        if refuse_embeds and "prompt_embeds" in body:
            message = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
            return JSONResponse({"error": {"message": message}}, status_code=400)
        head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": body["model"]}
        if body.get("stream"):

            async def pieces():
                for i, text in enumerate(["hello", " world"]):
                    choice = {"index": 0, "text": text, "finish_reason": "length" if i else None}
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(pieces(), media_type="text/event-stream")
        choice = {"index": 0, "text": "hello world", "finish_reason": "length", "logprobs": None}
        return {**head, "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

    return app


def _adapter(base_dir, folder, seed: int, chat_format=None, prompt_level="input", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4, chat_format=chat_format, prompt_level=prompt_level
    )
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, **overrides), config)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    base_dir = save_tiny(str(root / "tiny-base"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(base_dir)
    plain = _adapter(base_dir, str(root / "plain"), 1, chat_format="template")
    student = _adapter(base_dir, str(root / "student"), 2, chat_format="student")
    record: list = []
    upstream = _Server(fake_vllm(record))
    front = Front(base_dir)
    front.add("plain", plain)
    front.add("student", student)
    server = _Server(build_app(front, upstream.url, UPSTREAM_MODEL))
    client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
    yield {"root": root, "base": base_dir, "front": front, "record": record, "client": client, "url": server.url}
    server.stop()
    upstream.stop()


def _sent_embeds(body) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(body["prompt_embeds"])), weights_only=True)


def _expected(front: Front, name: str, ids: list[int]) -> torch.Tensor:
    return prompt_embeds(front.model, torch.tensor([ids]), adapter_name=name)[0]


def test_a_completion_by_adapter_name_forwards_that_adapter_s_exact_embeddings(stack):
    front, record = stack["front"], stack["record"]
    record.clear()
    answer = stack["client"].completions.create(model="plain", prompt="the cat sat", max_tokens=5, temperature=0)
    assert answer.model == "plain" and answer.choices[0].text == "hello world"
    (body,) = record
    assert body["model"] == UPSTREAM_MODEL and "prompt" not in body and body["max_tokens"] == 5
    ids = front.tokenizer("the cat sat")["input_ids"]
    sent = _sent_embeds(body)
    assert sent.shape == (4 + len(ids), front.base.config.hidden_size)
    assert torch.equal(sent, _expected(front, "plain", ids))
    assert not torch.equal(sent, _expected(front, "student", ids))  # the other adapter's prompt differs


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
        assert torch.equal(_sent_embeds(record[0]), _expected(front, name, ids))
    assert "helpful bot" in front.tokenizer.apply_chat_template(messages, tokenize=False)  # the check can tell


def test_streaming_passes_the_pieces_through_as_chat_deltas(stack):
    stream = stack["client"].chat.completions.create(
        model="student", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream]
    assert "".join(d.content or "" for d in deltas) == "hello world" and deltas[0].role == "assistant"
    pieces = stack["client"].completions.create(model="plain", prompt="hi", max_tokens=4, stream=True)
    assert [c.choices[0].text for c in pieces] == ["hello", " world"]


def test_the_base_by_its_own_name_is_forwarded_as_token_ids(stack):
    record = stack["record"]
    record.clear()
    stack["client"].completions.create(model="tiny-base", prompt="the cat", max_tokens=3)
    assert record[0]["prompt"] == stack["front"].tokenizer("the cat")["input_ids"] and "prompt_embeds" not in record[0]


def test_models_lists_the_adapters_and_they_change_without_a_restart(stack):
    client = stack["client"]
    assert sorted(m.id for m in client.models.list()) == ["plain", "student", "tiny-base"]
    third = _adapter(stack["base"], str(stack["root"] / "third"), 3)
    put = httpx.put(f"{stack['url']}/v1/adapters/third", json={"path": third})
    assert put.status_code == 200 and put.json()["num_virtual_tokens"] == 4
    assert "third" in [m.id for m in client.models.list()]
    client.completions.create(model="third", prompt="a", max_tokens=2)
    replaced = _adapter(stack["base"], str(stack["root"] / "third-v2"), 4)
    assert httpx.put(f"{stack['url']}/v1/adapters/third", json={"path": replaced}).status_code == 200
    stack["record"].clear()
    client.completions.create(model="third", prompt="a", max_tokens=2)
    ids = stack["front"].tokenizer("a")["input_ids"]
    assert torch.equal(_sent_embeds(stack["record"][0]), _expected(stack["front"], "third", ids))
    assert httpx.delete(f"{stack['url']}/v1/adapters/third").status_code == 200
    with pytest.raises(openai.NotFoundError, match=r"'third' is not served here.*'plain', 'student'"):
        client.completions.create(model="third", prompt="a", max_tokens=2)


def test_refusals_name_what_is_wrong(stack):
    client, url = stack["client"], stack["url"]
    with pytest.raises(openai.BadRequestError, match=r"needs 1\d\d positions .* the model has 128"):
        client.completions.create(model="plain", prompt="the cat sat", max_tokens=125)
    sent = httpx.post(f"{url}/v1/completions", json={"model": "plain", "prompt_embeds": "AAAA", "prompt": "x"})
    assert sent.status_code == 400 and "not accepted from clients" in sent.json()["error"]["message"]
    # An adapter saved from a base of another width: refused when it is loaded, the served ones untouched.
    other = save_tiny(str(stack["root"] / "tiny-base-wide"), n_embd=32)
    wide = _adapter(other, str(stack["root"] / "tiny-base-wide-adapter"), 6)
    refused = httpx.put(f"{url}/v1/adapters/wide", json={"path": wide})
    assert refused.status_code == 400 and "trained on" in refused.json()["error"]["message"]
    # A KV prompt: vLLM takes embeddings, from which it computes every layer's keys itself.
    kv = _adapter(stack["base"], str(stack["root"] / "kv-adapter"), 7, prompt_level="kv")
    refused = httpx.put(f"{url}/v1/adapters/kv", json={"path": kv})
    assert refused.status_code == 400 and "is a KV prompt (prompt_level='kv')" in refused.json()["error"]["message"]
    assert sorted(stack["front"].adapters) == ["plain", "student"]


def test_an_upstream_that_is_down_or_refuses_embeddings_is_a_502_with_the_fix(stack):
    front = stack["front"]
    down = _Server(build_app(front, f"http://127.0.0.1:{_free_port()}", UPSTREAM_MODEL))
    refusing = _Server(fake_vllm([], refuse_embeds=True))
    behind = _Server(build_app(front, refusing.url, UPSTREAM_MODEL))
    try:
        for server, words in [(down, "can't be reached"), (behind, "--enable-prompt-embeds")]:
            client = openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)
            with pytest.raises(openai.APIStatusError, match=words) as caught:
                client.completions.create(model="plain", prompt="hi", max_tokens=2)
            assert caught.value.status_code == 502
    finally:
        for server in (down, behind, refusing):
            server.stop()


def test_an_api_key_is_required_when_set(stack):
    keyed = _Server(build_app(stack["front"], "http://127.0.0.1:9", UPSTREAM_MODEL, api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(api_key="wrong", base_url=f"{keyed.url}/v1", max_retries=0).models.list()
        ok = openai.OpenAI(api_key="s3cret", base_url=f"{keyed.url}/v1", max_retries=0).models.list()
        assert "plain" in [m.id for m in ok]
    finally:
        keyed.stop()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--base", "nowhere"], "`--base`='nowhere' is not a folder"),
        (["--host", "0.0.0.0"], "pass --api-key"),
    ],
)
def test_the_cli_refuses_before_loading_anything(stack, argv, words, capsys, monkeypatch):
    from peft_softprompt_plus.apps.cli import main

    monkeypatch.delenv("SOFTPROMPT_PLUS_API_KEY", raising=False)
    args = ["serve", "--base", stack["base"], *argv] if argv[0] != "--base" else ["serve", *argv]
    assert main(args) == 2
    assert words in capsys.readouterr().err


def test_several_prompts_are_one_upstream_request_each_numbered_like_openai(stack):
    front, record = stack["front"], stack["record"]
    record.clear()
    answer = stack["client"].completions.create(model="plain", prompt=["the cat", "a dog ran"], max_tokens=3)
    assert [c.index for c in answer.choices] == [0, 1] and answer.usage.completion_tokens == 4
    sent = sorted((_sent_embeds(body) for body in record), key=len)
    for text, tensor in zip(["the cat", "a dog ran"], sent, strict=True):
        assert torch.equal(tensor, _expected(front, "plain", front.tokenizer(text)["input_ids"]))
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        stack["client"].completions.create(model="plain", prompt=["a", "b"], max_tokens=2, stream=True)


def test_a_completion_prompt_never_brings_a_second_bos_to_an_adapter_that_starts_with_one(stack):
    from peft_softprompt_plus.apps.serve_front import Adapter

    front = stack["front"]
    bos = front.tokenizer.bos_token_id
    text = front.tokenizer.bos_token + "the cat"
    with_bos = Adapter("b", "unused", 4, "template", 5, first_hard=bos)
    without = Adapter("p", "unused", 4, "template", 4)
    assert front.token_ids(text)[0] == bos and front.token_ids(text, without) == front.token_ids(text)
    assert front.token_ids(text, with_bos) == front.token_ids(text)[1:]
