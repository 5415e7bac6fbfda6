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
from peft_softprompt_plus.apps.serve_kv import check_served, fields, open_checked
from peft_softprompt_plus.apps.serve_requests import FrontError
from peft_softprompt_plus.apps.serve_share import publish

POSITIONS = 4


@pytest.fixture
def share(tmp_path):
    layers, kv_heads, head_size = kv_connector_stub.tiny_base()
    config = {"num_virtual_tokens": POSITIONS, "prompt_level": "kv"}
    digest = publish(str(tmp_path), config, torch.randn(layers, 2, kv_heads, POSITIONS, head_size))
    return str(tmp_path), digest


def _answer(connector, digest: str) -> dict:
    body = fields(digest, POSITIONS, placeholder=7, ids=[11, 12, 13])
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
    """The front's `Upstream` as `open_checked` uses it: a stream that opens after `open_s`, and a check's answer."""

    def __init__(self, answer: dict, open_s: float):
        self.answer, self.open_s, self.closed, self.opened = answer, open_s, [], []

    async def open_stream(self, payload: bytes):
        await asyncio.sleep(self.open_s)
        self.opened.append(json.loads(payload))
        engine = self

        class Response:
            async def aclose(self):
                engine.closed.append(True)

        return Response()

    async def post(self, payload: bytes) -> dict:
        await asyncio.sleep(0.05)
        return dict(self.answer)


@pytest.mark.parametrize("open_s", [0.0, 0.5])  # the stream opened before the check answers, or still opening
def test_a_stream_whose_check_fails_is_closed_or_never_opened_and_is_a_502(share, open_s):
    folder, digest = share
    payload = json.dumps(fields(digest, POSITIONS, placeholder=7, ids=[11, 12, 13])).encode()
    refused = _Engine({"kv_transfer_params": {VLLM_KV_REFUSED: "the reason"}}, open_s)
    with pytest.raises(FrontError, match="did not apply the KV prompt: the reason") as caught:
        asyncio.run(open_checked(refused, payload, digest, POSITIONS))
    assert caught.value.status == 502
    assert (refused.opened, refused.closed) == (([json.loads(payload)], [True]) if open_s == 0 else ([], []))
    served = _Engine({"kv_transfer_params": {VLLM_KV_SERVED: digest}}, open_s)
    assert asyncio.run(open_checked(served, payload, digest, POSITIONS)) is not None and served.closed == []
