"""KV adapters (`prompt_level="kv"`) behind `softprompt-plus serve`: each one's keys/values published to a shared
folder under their content hash, and the request fields that have vLLM's KV connector (`integrations/vllm_kv.py`,
running in vLLM's processes) put them into the cache slots of N placeholder ids in front of the text.

vLLM places a prompt's tokens at positions 0..L-1, so the text can only start right after the N placeholders:
adapters whose `kv_text_start` is past N are folded first (`fit.py`). The connector marks each request it
served; the front checks the mark, so a vLLM started without the connector is a 502, never an answer computed from
the placeholders; where the connector refused the KV prompt (it doesn't fit the engine's model, or its file doesn't
hash to its name), the 502 gives the connector's reason. vLLM 0.32 streams no connector mark (its stream chunks have
no `kv_transfer_params`), so each stream is checked, once its first chunk came, by a request of one computed position
under the same salt.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, AsyncIterator, Optional

if TYPE_CHECKING:
    import httpx

    from .upstream import Upstream

from .._names import VLLM_KV_PARAM, VLLM_KV_REFUSED, VLLM_KV_SERVED
from .requests import FrontError

CONNECTOR = "SoftPromptKVConnector"
CONNECTOR_MODULE = "peft_softprompt_plus.integrations.vllm_kv"


def vllm_config(share: str) -> str:
    """vLLM's `--kv-transfer-config` for a front started with `--kv-share share`."""
    config = {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_connector_extra_config": {"folder": os.path.abspath(share)},
    }
    return json.dumps(config)


def refusal(name: str, folder: str) -> str:
    return (
        f"adapter {name!r} ({folder}) is a KV prompt (prompt_level='kv'): vLLM serves it through this package's KV "
        "connector. Start the front with --kv-share DIR and vLLM with the --kv-transfer-config the front prints for "
        "that folder (docs/serving.md, 'KV prompts')."
    )


def fields(digest: str, positions: int, placeholder: int, ids: list[int]) -> dict:
    """The upstream body's prompt and connector fields for a KV adapter's request (its `cache_salt`, the same hash, is
    set with every adapter's)."""
    if not ids:
        raise FrontError(400, "the prompt is empty: a KV adapter needs some text after its positions.")
    return {
        "prompt": [placeholder] * positions + ids,
        "kv_transfer_params": {VLLM_KV_PARAM: digest},
    }


def check_served(answer: dict, digest: Optional[str]) -> dict:
    """`answer` without the connector's mark, once the mark says the connector served `digest`."""
    marks = answer.pop("kv_transfer_params", None) or {}
    if digest is not None and VLLM_KV_REFUSED in marks:  # the request ran without it: its answer is not the adapter's
        raise FrontError(502, f"the engine did not apply the KV prompt: {marks[VLLM_KV_REFUSED]}.", "kv_refused")
    if digest is not None and marks.get(VLLM_KV_SERVED) != digest:
        raise FrontError(
            502,
            "the engine did not apply the KV prompt: start vLLM with the --kv-transfer-config that "
            "`softprompt-plus serve --kv-share` prints, with the same folder.",
            "kv_unmarked",
        )
    return answer


def check_body(payload: bytes, positions: int) -> bytes:
    """The request that checks the connector applied a streamed KV request's prompt (`payload`): its model, salt and
    connector fields, its `positions` placeholders and first text id, one token out. The stream's own blocks are in
    the cache under the same salt by then, so the engine computes a position or two, not the stream's prompt again."""
    body = json.loads(payload)
    kept = {key: body[key] for key in ("model", "cache_salt", "kv_transfer_params") if key in body}
    return json.dumps({**kept, "prompt": body["prompt"][: positions + 1], "max_tokens": 1}).encode()


async def open_checked(
    engine: "Upstream", payload: bytes, digest: str, positions: int
) -> tuple["httpx.Response", AsyncIterator[dict]]:
    """The stream of `payload` (a KV request for `digest`) and its chunks, returned once its first chunk came (so the
    engine has decided whether the connector serves it) and `check_body`'s request, sent after that under the same
    salt, carries the connector's mark. A stream the connector refused retired its salt (the connector's
    `SaltBook`), so the check is refused too; a wrong or missing mark closes the stream (vLLM aborts the request) and
    raises the check's `FrontError`."""
    response = await engine.open_stream(payload)
    chunks = engine.chunks(response)
    try:
        first = await anext(chunks, None)  # None: the stream ended at once
        check_served(await engine.post(check_body(payload, positions)), digest)
    except BaseException:
        await chunks.aclose()
        await response.aclose()
        raise
    return response, _chained(first, chunks)


async def _chained(first: Optional[dict], rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk
