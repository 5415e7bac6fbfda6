"""What `softprompt-plus serve` accepts from a client: every field of a Completions or Chat Completions body is
checked against one table per route, so a malformed field is a 400 that names it, and the front's limits.

Nothing here touches the model: `parse` turns a JSON body into a `Call` or raises `FrontError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's Completions default
NAME_MAX = 128  # the longest adapter name: it is a metric label and a log field
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # the Host names a loopback front answers to (DNS rebinding)
HEALTH_INTERVAL_S = 10  # `--health-interval`: how long one check of the engine and its connector is trusted


class FrontError(Exception):
    """A request or an adapter the front refuses: `status` is the HTTP status the client gets; `reason`, where set,
    labels it in `/metrics` (`softprompt_plus_refusals_total`): a limit's flag name, or why a KV prompt wasn't applied.
    """

    def __init__(self, status: int, message: str, reason: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the front (each is a `softprompt-plus serve` flag of the same name)."""

    max_body_bytes: int = field(default=2 << 20, metadata={"help": "Largest request body, in bytes (413 above)."})
    max_prompts: int = field(default=32, metadata={"help": "Most prompts in one Completions request."})
    max_n: int = field(default=8, metadata={"help": "Largest `n` (choices per prompt)."})
    max_tokens: int = field(default=4096, metadata={"help": "Largest `max_tokens` a client may ask for."})
    default_max_tokens: int = field(
        default=512, metadata={"help": "`max_tokens` of a Chat request that sets none (Completions: 16, as OpenAI)."}
    )
    max_in_flight: int = field(default=256, metadata={"help": "Most requests in flight at once (429 above)."})
    max_tokens_in_flight: int = field(
        default=1 << 20,  # the largest one request may ask under the defaults above: 32 prompts x n=8 x 4096 tokens
        metadata={"help": "Most tokens asked in flight: prompts x n x max_tokens summed over requests (429 above)."},
    )
    max_prompt_bytes_in_flight: int = field(
        default=1 << 30,
        metadata={
            "help": "Most bytes the requests in flight may take in the front's memory for their prompts (an input "
            "adapter's float32 rows, base64 and JSON; 429 above, 400 for one request alone past it)."
        },
    )
    body_timeout: int = field(
        default=30, metadata={"help": "Seconds a client may take to send its request body (408 past it)."}
    )
    request_timeout: int = field(
        default=600,
        metadata={"help": "Seconds a request may take from its first byte to its answer's last (504 past it)."},
    )

    def default_max_tokens_for(self, route: str) -> int:
        """`max_tokens` of a request that sets none: `default_max_tokens` for Chat, OpenAI's 16 for Completions."""
        return self.default_max_tokens if route == "chat" else COMPLETION_DEFAULT_MAX_TOKENS

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{f.name}` must be a positive integer, got {value!r}.")


@dataclass
class Call:
    """One checked request: `prompts` are texts or token-id lists (Completions) or one message list (Chat)."""

    route: str  # "completions" or "chat"
    model: str
    prompts: list
    max_tokens: Optional[int]  # None: the route's default, fitted to the room left
    n: int
    stream: bool
    options: dict  # passed to vLLM's /v1/completions as they are
    top_logprobs: Optional[int] = None  # Chat only: how many alternatives each token's logprobs list


def check_adapter_name(name: Any, base_name: str, what: str = "adapter name") -> None:
    """Refuse a name a served adapter or composition can't have: not a non-empty string, the base's own, holding a
    `/` (a path, or a Hub id), or longer than NAME_MAX."""
    ok = isinstance(name, str) and 0 < len(name) <= NAME_MAX and name != base_name and "/" not in name
    if not ok:
        raise FrontError(
            400,
            f"{what} {name!r:.80} is invalid: use a string of 1 to {NAME_MAX} characters without '/', other than the "
            f"base's name {base_name!r}.",
        )


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _bad(name: str, wanted: str, value: Any) -> FrontError:
    return FrontError(400, f"`{name}` must be {wanted}, got {_show(value)}.")


def _integer(low: int, high: Optional[int] = None, cap: Optional[str] = None) -> Callable:
    def check(name: str, value: Any, limits: Limits) -> int:
        top = getattr(limits, cap) if cap else high
        span = f"an integer from {low}" + (f" to {top}" if top is not None else " up")
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (top is not None and value > top):
            hint = f" (this front's limit; the operator sets --{cap.replace('_', '-')})" if cap else ""
            raise _bad(name, span + hint, value)
        return value

    return check


def _number(low: float, high: float) -> Callable:
    def check(name: str, value: Any, limits: Limits) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not low <= value <= high:
            raise _bad(name, f"a number from {low} to {high}", value)
        return value

    return check


def _boolean(name: str, value: Any, limits: Limits) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _text(name: str, value: Any, limits: Limits) -> str:
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def _stop(name: str, value: Any, limits: Limits):
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > 16 or not all(isinstance(s, str) and s for s in items):
        raise _bad(name, "a non-empty string or a list of at most 16 of them", value)
    return value


def _stream_options(name: str, value: Any, limits: Limits) -> dict:
    known = ("include_usage", "continuous_usage_stats")
    if not isinstance(value, dict) or any(k not in known or not isinstance(v, bool) for k, v in value.items()):
        raise _bad(name, f"an object of booleans among {list(known)}", value)
    return value


def _prompts(name: str, value: Any, limits: Limits) -> list:
    """A text, a list of texts, a token-id list, or a list of token-id lists: always a list of prompts."""
    if isinstance(value, str) or _is_ids(value):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(p, str) or _is_ids(p) for p in value):
        raise _bad(name, "a text, a list of texts, or token ids (a list of integers, or a list of such lists)", value)
    if len(value) > limits.max_prompts:
        raise FrontError(
            400,
            f"`{name}` holds {len(value)} prompts; this front takes at most {limits.max_prompts} per request "
            "(--max-prompts). Send them in several requests.",
        )
    return value


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(i) is int for i in value)


ROLES = ("system", "user", "assistant")


def _messages(name: str, value: Any, limits: Limits) -> list:
    if not isinstance(value, list) or not value:
        raise _bad(name, "a non-empty list of {role, content} objects", value)
    checked = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "a {role, content} object", message)
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise FrontError(400, f"`{where}` has fields {extra} this front doesn't take: send role and content.")
        if message.get("role") not in ROLES:
            raise _bad(f"{where}.role", f"one of {list(ROLES)}", message.get("role"))
        if "name" in message and not isinstance(message["name"], str):
            raise _bad(f"{where}.name", "a string", message["name"])
        checked.append({"role": message["role"], "content": _content(f"{where}.content", message.get("content"))})
    return checked


def _content(name: str, value: Any) -> str:
    """A message's text: a string, or a list of text parts (joined), as OpenAI clients send either."""
    if isinstance(value, str):
        return value
    parts = value if isinstance(value, list) else None
    if parts is None or not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        raise _bad(name, 'a string or a list of {"type": "text", "text": ...} parts (text only)', value)
    texts = [p.get("text") for p in parts]
    if not all(isinstance(t, str) for t in texts) or any(set(p) - {"type", "text"} for p in parts):
        raise _bad(name, 'text parts of the form {"type": "text", "text": "..."}', value)
    return "".join(texts)


_COMMON: dict[str, Callable] = {
    "max_tokens": _integer(1, cap="max_tokens"),
    "n": _integer(1, cap="max_n"),
    "temperature": _number(0.0, 2.0),
    "top_p": _number(1e-9, 1.0),
    "top_k": _integer(-1, 1 << 20),
    "min_p": _number(0.0, 1.0),
    "stop": _stop,
    "seed": _integer(-(1 << 63), (1 << 63) - 1),
    "stream": _boolean,
    "stream_options": _stream_options,
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _number(1e-6, 10.0),
    "min_tokens": _integer(0, cap="max_tokens"),
    "ignore_eos": _boolean,
    "user": _text,
}
FIELDS: dict[str, dict[str, Callable]] = {  # route -> field -> its check
    "completions": {**_COMMON, "prompt": _prompts, "logprobs": _integer(0, 20)},
    "chat": {
        **_COMMON,
        "messages": _messages,
        "max_completion_tokens": _integer(1, cap="max_tokens"),
        "logprobs": _boolean,
        "top_logprobs": _integer(0, 20),
    },
}
REQUIRED = {"completions": ("model", "prompt"), "chat": ("model", "messages")}
# Fields OpenAI defines that this front takes only at their neutral value (clients often send those).
NEUTRAL = {
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "parallel_tool_calls": (True, False),
}
# vLLM fields the front sets itself: a client's would reach past its checks (another tenant's KV prompt or cache).
FRONT_SETS = {
    "prompt_embeds": "send text; the front builds them.",
    "kv_transfer_params": "the front names a KV adapter's keys/values itself: send the adapter's name as `model`.",
    "cache_salt": "the front gives each adapter's requests a secret salt of their own (tenants never share blocks).",
}
_BUILT_HERE = ("model", "prompt", "messages", "max_completion_tokens", "logprobs", "top_logprobs", "max_tokens")


def parse(route: str, body: Any, limits: Limits) -> Call:
    """`body` checked field by field for `route` ("completions" or "chat"); a `FrontError(400)` naming the first
    field that is wrong."""
    if not isinstance(body, dict):
        raise _bad("body", "a JSON object", body)
    table = FIELDS[route]
    for name in REQUIRED[route]:
        if body.get(name) is None:
            raise FrontError(400, f"`{name}` is required.")
    if not isinstance(body["model"], str):
        raise _bad("model", "the name of the base or of an adapter (a string)", body["model"])
    checked = {}
    for name, value in body.items():
        if name == "model" or value is None:  # clients send null for "not set"
            continue
        if name in table:
            checked[name] = table[name](name, value, limits)
        elif name in NEUTRAL and value in NEUTRAL[name]:
            continue
        elif name in FRONT_SETS:
            raise FrontError(400, f"`{name}` is not accepted from clients: {FRONT_SETS[name]}")
        else:
            raise FrontError(
                400, f"`{name}` is not a field this front takes on /v1/{_path(route)}; it takes {sorted(table)}."
            )
    if checked.get("stream_options") and not checked.get("stream"):
        raise FrontError(400, "`stream_options` needs `stream`: true.")
    max_tokens = checked.get("max_completion_tokens", checked.get("max_tokens"))
    if checked.get("min_tokens", 0) > (max_tokens or limits.max_tokens):
        raise FrontError(400, f"`min_tokens` ({checked['min_tokens']}) is more than `max_tokens` ({max_tokens}).")
    options = {k: v for k, v in checked.items() if k not in _BUILT_HERE}
    top = None
    if route == "chat":
        prompts = [checked["messages"]]
        if "top_logprobs" in checked and not checked.get("logprobs"):
            raise FrontError(400, "`top_logprobs` needs `logprobs`: true.")
        if checked.get("logprobs"):
            top = checked.get("top_logprobs", 0)
            options["logprobs"] = top
    else:
        prompts = checked["prompt"]
        if "logprobs" in checked:
            options["logprobs"] = checked["logprobs"]
        if checked.get("stream") and len(prompts) > 1:
            raise FrontError(400, f"`stream` takes one prompt per request, got {len(prompts)}: send them one by one.")
    n = checked.get("n", 1)
    return Call(route, body["model"], prompts, max_tokens, n, checked.get("stream", False), options, top)


def _path(route: str) -> str:
    return "chat/completions" if route == "chat" else "completions"
