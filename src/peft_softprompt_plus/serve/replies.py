"""vLLM's Completions answers as `softprompt-plus serve` returns them: several prompts' answers merged and numbered
as OpenAI numbers them, and Completions turned into Chat Completions (whole or streamed), logprobs included."""

from __future__ import annotations

import time
import uuid
from typing import Optional

_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def merged(answers: list[dict], n: int) -> dict:
    """One answer per prompt as one: prompt i's choice c is choice i * n + c; the usage summed."""
    if len(answers) == 1:
        return answers[0]
    choices = [{**c, "index": i * n + c.get("index", 0)} for i, a in enumerate(answers) for c in a.get("choices", [])]
    usage = {k: sum((a.get("usage") or {}).get(k, 0) for a in answers) for k in _USAGE}
    return {**answers[0], "choices": choices, "usage": usage}


def as_chat(answer: dict, name: str, top: Optional[int]) -> dict:
    choices = [
        {
            "index": c.get("index", 0),
            "message": {"role": "assistant", "content": c.get("text", "")},
            "finish_reason": c.get("finish_reason"),
            "logprobs": _chat_logprobs(c.get("logprobs"), top),
        }
        for c in answer.get("choices", [])
    ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": answer.get("created", int(time.time())),
        "model": name,
        "choices": choices,
        "usage": answer.get("usage"),
    }


def as_chat_chunk(chunk: dict, name: str, first: bool, top: Optional[int]) -> dict:
    choices = []
    for c in chunk.get("choices", []):
        delta = {"content": c.get("text", "")}
        if first:
            delta["role"] = "assistant"
        choice = {"index": c.get("index", 0), "delta": delta, "finish_reason": c.get("finish_reason")}
        if top is not None:
            choice["logprobs"] = _chat_logprobs(c.get("logprobs"), top)
        choices.append(choice)
    return {
        "id": str(chunk.get("id", "")).replace("cmpl-", "chatcmpl-", 1),
        "object": "chat.completion.chunk",
        "created": chunk.get("created", int(time.time())),
        "model": name,
        "choices": choices,
        **({"usage": chunk["usage"]} if chunk.get("usage") else {}),
    }


def _chat_logprobs(logprobs: Optional[dict], top: Optional[int]) -> Optional[dict]:
    """Completions logprobs (parallel lists) as Chat's: one entry per token with its `top` alternatives."""
    if top is None or not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or [None] * len(tokens)
    alternatives = logprobs.get("top_logprobs") or [None] * len(tokens)
    content = []
    for token, value, others in zip(tokens, values, alternatives, strict=False):
        ranked = sorted((others or {}).items(), key=lambda kv: -kv[1])[:top]
        content.append(
            {
                "token": token,
                "logprob": value,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in ranked],
            }
        )
    return {"content": content}
