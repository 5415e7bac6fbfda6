"""A KV prompt the connector refuses (it doesn't fit the engine's model, or its share file doesn't hash to its name)
reaches the front as the connector's reason in the finished request's `kv_transfer_params`, and the front turns it
into a 502 for that request; the connector's scheduler side runs for real (kv_connector_stub.py), for an engine
serving another model than the prompt's, or from a share where another file was planted under the prompt's name. A
stream's check (`open_checked`) that finds no right mark closes the stream, or cancels it while it opens."""

import asyncio
import json

import kv_connector_stub
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peft_softprompt_plus._names import VLLM_KV_REFUSED, VLLM_KV_SERVED, VLLM_KV_TENSOR
from peft_softprompt_plus.serve.kv_fields import check_served, fields, open_checked
from peft_softprompt_plus.serve.requests import FrontError
from peft_softprompt_plus.serve.share import publish

POSITIONS = 4


@pytest.fixture
def share(tmp_path):
    layers, kv_heads, head_size = kv_connector_stub.tiny_base()
    config = {"num_virtual_tokens": POSITIONS, "prompt_level": "kv"}
    digest = publish(str(tmp_path), config, torch.randn(layers, 2, kv_heads, POSITIONS, head_size))
    return str(tmp_path), digest


SALT = "a" * 32


def _answer(connector, digest: str) -> dict:
    body = {**fields(digest, POSITIONS, placeholder=7, ids=[11, 12, 13]), "cache_salt": SALT}
    return {"choices": [{"text": "hello"}], "kv_transfer_params": kv_connector_stub.served_mark(connector, body)}


def test_a_prompt_that_fits_the_engine_s_model_is_served(share):
    folder, digest = share
    answer = _answer(kv_connector_stub.scheduler_connector(folder), digest)
    assert answer["kv_transfer_params"] == {VLLM_KV_SERVED: digest}
    assert check_served(answer, digest) == {"choices": [{"text": "hello"}]}


def test_a_prompt_for_another_model_is_a_502_with_the_connector_s_reason(share):
    folder, digest = share
    layers, kv_heads, head_size = kv_connector_stub.tiny_base()
    connector = kv_connector_stub.scheduler_connector(folder, model=(layers + 1, kv_heads, head_size))
    answer = _answer(connector, digest)
    reason = f"the KV prompt has {layers} layers (the model: {layers + 1}): it was trained on another model"
    assert answer["kv_transfer_params"] == {VLLM_KV_REFUSED: reason}
    with pytest.raises(FrontError, match="did not apply the KV prompt: the KV prompt has 2 layers") as caught:
        check_served(answer, digest)
    assert caught.value.status == 502 and reason in str(caught.value)


def test_a_file_planted_under_the_prompt_s_name_is_a_502_and_the_connector_raises_nothing(share):
    folder, digest = share
    path = f"{folder}/{digest}.safetensors"
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    planted = {VLLM_KV_TENSOR: torch.zeros_like(load_file(path)[VLLM_KV_TENSOR])}
    save_file(planted, path, metadata=metadata)  # the right config, another tensor
    answer = _answer(kv_connector_stub.scheduler_connector(folder), digest)
    assert "not to its name: a stale or planted file" in answer["kv_transfer_params"][VLLM_KV_REFUSED]
    with pytest.raises(FrontError, match="did not apply the KV prompt: the KV prompt .* hashes to ") as caught:
        check_served(answer, digest)
    assert caught.value.status == 502


class _Engine:
    """The front's `Upstream` as `open_checked` uses it: a stream of two chunks, and a check's answer; it records the
    order things happen in."""

    def __init__(self, answer: dict):
        self.answer, self.events = answer, []

    async def open_stream(self, payload: bytes):
        self.events.append("opened")
        engine = self

        class Response:
            async def aclose(self):
                engine.events.append("closed")

        return Response()

    async def chunks(self, response):
        try:
            for text in ("hello", " world"):
                self.events.append(f"chunk {text!r}")
                yield {"choices": [{"text": text}]}
        finally:
            await response.aclose()

    async def post(self, payload: bytes) -> dict:
        self.events.append("checked")
        return dict(self.answer)


def test_a_stream_is_checked_after_its_first_chunk_and_closed_as_a_502_when_the_check_fails(share):
    """The check goes once the stream's first chunk came: by then the engine has matched the stream's KV prompt, so
    a stream the connector refused has retired its salt, and the check under that salt is refused too."""
    folder, digest = share
    payload = json.dumps(fields(digest, POSITIONS, placeholder=7, ids=[11, 12, 13])).encode()
    refused = _Engine({"kv_transfer_params": {VLLM_KV_REFUSED: "the reason"}})
    with pytest.raises(FrontError, match="did not apply the KV prompt: the reason") as caught:
        asyncio.run(open_checked(refused, payload, digest, POSITIONS))
    assert caught.value.status == 502 and caught.value.reason == "kv_refused"
    assert refused.events[:3] == ["opened", "chunk 'hello'", "checked"] and set(refused.events[3:]) == {"closed"}

    async def relayed(engine):
        response, chunks = await open_checked(engine, payload, digest, POSITIONS)
        return [c["choices"][0]["text"] async for c in chunks]

    served = _Engine({"kv_transfer_params": {VLLM_KV_SERVED: digest}})
    assert asyncio.run(relayed(served)) == ["hello", " world"]
    assert served.events == ["opened", "chunk 'hello'", "checked", "chunk ' world'", "closed"]


def test_a_refused_salt_refuses_every_later_request_under_it_and_a_fresh_salt_is_served(share):
    """The connector's `SaltBook`: once a request under a salt ran without its KV prompt, no request under that salt
    is served the prompt (its blocks may be the placeholders'), while another salt is."""
    folder, digest = share
    connector = kv_connector_stub.scheduler_connector(folder)
    body = {**fields(digest, POSITIONS, placeholder=7, ids=[11, 12, 13]), "cache_salt": SALT}
    assert kv_connector_stub.served_mark(connector, body) == {VLLM_KV_SERVED: digest}
    torn = {**body, "kv_transfer_params": {"softprompt_plus_kv": "ab" * 16}}  # a file that isn't there
    assert VLLM_KV_REFUSED in kv_connector_stub.served_mark(connector, torn)
    mark = kv_connector_stub.served_mark(connector, body)
    assert "was retired (a request under it was refused)" in mark[VLLM_KV_REFUSED]
    assert kv_connector_stub.served_mark(connector, {**body, "cache_salt": "b" * 32}) == {VLLM_KV_SERVED: digest}
    plain = {"prompt": body["prompt"], "cache_salt": "b" * 32}  # placeholders as text under a KV prompt's salt
    assert kv_connector_stub.served_mark(connector, plain) is None
    mark = kv_connector_stub.served_mark(connector, {**body, "cache_salt": "b" * 32})
    assert "a request that named no KV prompt ran under it" in mark[VLLM_KV_REFUSED]
    unsalted = {k: v for k, v in body.items() if k != "cache_salt"}
    assert "must carry a `cache_salt`" in kv_connector_stub.served_mark(connector, unsalted)[VLLM_KV_REFUSED]
