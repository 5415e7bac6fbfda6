"""The clients of bench/_vllm_trust.py that reach vLLM directly, past `softprompt-plus serve`: one that sends the
placeholder ids under a KV adapter's share-file name or a guess as `cache_salt`, and malformed `kv_transfer_params`."""

from __future__ import annotations

import json

from _vllm_server import post, prefix_cache
from _vllm_tp import NEW_TOKENS

# Sent to vLLM directly, bypassing the front: each must leave the engine serving (a 200 refused, or a 4xx).
MALFORMED = [
    {"softprompt_plus_kv": 1},
    [1, 2],
    {"softprompt_plus_kv": [1, 2]},
    {"softprompt_plus_kv": {"digest": "ab"}},
    {"softprompt_plus_kv": None},
    {"softprompt_plus_kv": "../../../etc/passwd"},
    {"softprompt_plus_kv": "AB" * 16},
    {"softprompt_plus_kv": "ab" * 8 + "\n"},
    "softprompt_plus_kv",
    7,
]


def direct_client(up: str, model: str, name: str, digest: str, ids: list[int], wanted: dict) -> dict:
    """The placeholder ids and the text sent to vLLM directly, under the adapter's share-file name (public) or a
    guess as `cache_salt`: the base reading the placeholders, with no prefix-cache hit."""
    out = {}
    for label, salt in (("share_name", digest), ("guess", "0" * 32)):
        _, hits_before = prefix_cache(up)
        body = {"model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "cache_salt": salt}
        status, answer = post(f"{up}/v1/completions", body)
        _, hits_after = prefix_cache(up)
        text = answer["choices"][0]["text"] if status == 200 else str(answer)[:200]
        out[label] = {
            "status": status,
            "reply_is_base_on_placeholders": text == wanted["placeholders_as_text"],
            "reply_is_adapter_s": text == wanted[name][0],
            "prefix_cache_hit_tokens": hits_after - hits_before,
        }
    return out


def malformed(url: str, up: str, model: str, folders: dict, wanted: dict, ids: list[int], prompt: str, ask) -> dict:
    """MALFORMED sent to vLLM directly, each with a salt and without; then the engine and every adapter."""
    sent = []
    for params in MALFORMED:
        for salt in ("m" * 32, None):
            body = {"model": model, "prompt": ids, "max_tokens": 2, "kv_transfer_params": params}
            if salt is not None:
                body["cache_salt"] = salt
            try:
                status, answer = post(f"{up}/v1/completions", body)
            except OSError as err:  # the engine gone
                status, answer = -1, {"error": str(err)}
            refused = (answer.get("kv_transfer_params") or {}) if isinstance(answer, dict) else {}
            sent.append({"params": json.dumps(params), "salt": salt is not None, "status": status,
                         "refusal": str(refused.get("softprompt_plus_kv_refused", ""))[:120]})  # fmt: skip
    alive = post(f"{up}/v1/completions", {"model": model, "prompt": ids, "max_tokens": 2})[0]
    got = {name: ask(url, name, prompt) for name in folders}
    first = next(iter(folders))
    return {
        "sent": len(sent),
        "statuses": sorted({s["status"] for s in sent}),
        "examples": sent[:6],
        "engine_answers_after": alive,
        "every_adapter_after": f"{sum(got[n] == wanted[n][1] for n in folders)}/{len(folders)}",
        "stream_after_equal": ask(url, first, prompt, stream=True) == wanted[first][1],
    }
