"""serve/requests.py: every field of a request body checked against its route's table, without HTTP."""

from __future__ import annotations

import json
import pathlib

import pytest
import serve_bodies
from hypothesis import HealthCheck, given, settings

from peft_softprompt_plus.serve.requests import FIELDS, FRONT_SETS, NEUTRAL, FrontError, Limits, parse

MODELS = ["base", "plain"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(serve_bodies.malformed(MODELS, 300))
def test_every_malformed_field_is_a_400_that_names_it(case):
    route, body, name = case
    with pytest.raises(FrontError) as caught:
        parse(route, body, Limits())
    assert caught.value.status == 400 and f"`{name}" in str(caught.value), (body, str(caught.value))


@settings(max_examples=200, deadline=None)
@given(serve_bodies.completion(MODELS, 300))
def test_every_valid_completion_body_is_taken_and_passes_only_what_vllm_takes(body):
    call = parse("completions", body, Limits())
    assert call.model == body["model"] and call.n == body.get("n", 1)
    assert len(call.prompts) == (
        len(body["prompt"]) if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str) else 1
    )
    assert not {"model", "prompt", "max_tokens", "echo"} & set(call.options)


@settings(max_examples=100, deadline=None)
@given(serve_bodies.chat(MODELS))
def test_every_valid_chat_body_is_taken_with_its_text_parts_joined(body):
    call = parse("chat", body, Limits())
    (messages,) = call.prompts
    assert [m["role"] for m in messages] == [m["role"] for m in body["messages"]]
    assert all(isinstance(m["content"], str) for m in messages)
    if body.get("logprobs"):
        assert call.options["logprobs"] == call.top_logprobs == body.get("top_logprobs", 0)
    else:
        assert "logprobs" not in call.options and call.top_logprobs is None


@pytest.mark.parametrize(
    "route, body, words",
    [
        ("completions", [], "`body` must be a JSON object"),
        ("completions", {"prompt": "x"}, "`model` is required"),
        ("chat", {"model": "m"}, "`messages` is required"),
        ("completions", {"model": "m", "prompt": ["a"] * 33}, "at most 32 per request (--max-prompts)"),
        (
            "completions",
            {"model": "m", "prompt": "a", "n": 9},
            "from 1 to 8 (this front's limit; the operator sets --max-n)",
        ),
        ("completions", {"model": "m", "prompt": ["a", "b"], "stream": True}, "one prompt per request"),
        ("completions", {"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, "needs `stream`"),
        ("completions", {"model": "m", "prompt": "a", "max_tokens": 2, "min_tokens": 3}, "`min_tokens` (3) is more"),
        ("completions", {"model": "m", "prompt": "a", "prompt_embeds": "AAAA"}, "not accepted from clients"),
        (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
            "needs `logprobs`",
        ),
        ("chat", {"model": "m", "messages": [{"role": "tool", "content": "a"}]}, "`messages[0].role` must be one of"),
    ],
)
def test_refusals_name_the_field_and_the_fix(route, body, words):
    with pytest.raises(FrontError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse(route, body, Limits())


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(
    "name, value",
    [
        ("kv_transfer_params", {"softprompt_plus_kv": "0" * 32}),
        ("cache_salt", "another-tenant"),
        ("prompt_embeds", "A"),
    ],
)
def test_fields_the_front_sets_itself_are_refused_from_clients_by_name(route, name, value):
    with pytest.raises(FrontError, match=f"`{name}` is not accepted from clients: ") as caught:
        parse(route, {**REQUIRED[route], name: value}, Limits())
    assert caught.value.status == 400
    assert name in FRONT_SETS and FRONT_SETS[name] in str(caught.value)


def test_null_fields_and_neutral_openai_fields_are_taken_as_not_set():
    call = parse(
        "completions", {"model": "m", "prompt": "a", "temperature": None, "echo": False, "best_of": 1}, Limits()
    )
    assert call.options == {} and call.max_tokens is None


def test_limits_are_checked_and_come_from_the_operator():
    with pytest.raises(ValueError, match="`max_n` must be a positive integer, got 0"):
        Limits(max_n=0)
    call = parse("completions", {"model": "m", "prompt": "a", "max_tokens": 50}, Limits(max_tokens=50))
    assert call.max_tokens == 50
    with pytest.raises(FrontError, match="from 1 to 49"):
        parse("completions", {"model": "m", "prompt": "a", "max_tokens": 50}, Limits(max_tokens=49))


# The fields of vLLM's CompletionRequest and ChatCompletionRequest, recorded by _record_vllm_fields.py (which says how
# to rerun it). vLLM ignores any other field with a log line only, so the front must never pass one on.
VLLM = json.loads((pathlib.Path(__file__).parent / "vllm_request_fields.json").read_text())
MESSAGES = [{"role": "user", "content": "a"}]
REQUIRED = {"completions": {"model": "m", "prompt": "a"}, "chat": {"model": "m", "messages": MESSAGES}}
# A value each field the front takes is valid at, with the fields it needs beside it, and where the Call holds it when
# the front builds it itself rather than passing it on as it came.
VALID = {
    "max_tokens": 5, "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "stop": ["\n"], "seed": 3,
    "stream": True, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 1,
    "ignore_eos": True, "user": "u", "prompt": ["a", "b"], "messages": MESSAGES, "max_completion_tokens": 6,
    "top_logprobs": 2, "stream_options": {"include_usage": True},
}  # fmt: skip
BESIDE = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}}
BUILT = {
    ("completions", "model"): lambda call: call.model == "m",
    ("completions", "prompt"): lambda call: call.prompts == ["a", "b"],
    ("completions", "max_tokens"): lambda call: call.max_tokens == 5 and "max_tokens" not in call.options,
    ("completions", "logprobs"): lambda call: call.options["logprobs"] == 3,
    ("chat", "model"): lambda call: call.model == "m",
    ("chat", "messages"): lambda call: call.prompts == [MESSAGES],
    ("chat", "max_tokens"): lambda call: call.max_tokens == 5 and "max_tokens" not in call.options,
    ("chat", "max_completion_tokens"): lambda call: (
        call.max_tokens == 6 and "max_completion_tokens" not in call.options
    ),
    ("chat", "logprobs"): lambda call: call.options["logprobs"] == 0 and call.top_logprobs == 0,
    ("chat", "top_logprobs"): lambda call: call.options["logprobs"] == 2 == call.top_logprobs,
}
LOGPROBS = {"completions": 3, "chat": True}  # Completions counts alternatives, Chat switches them on


def _vllm_fields(route: str) -> list[str]:
    return VLLM["routes"][route]["fields"]


def _cases(which) -> list:
    return [(route, name) for route in ("completions", "chat") for name in which(route)]


@pytest.mark.parametrize(
    "route, name", _cases(lambda r: [f for f in _vllm_fields(r) if f in FIELDS[r] or f == "model"])
)
def test_every_vllm_field_the_front_takes_reaches_vllm_s_completions_or_the_call(route, name):
    value = LOGPROBS[route] if name == "logprobs" else VALID.get(name)
    call = parse(route, {**REQUIRED[route], **BESIDE.get(name, {}), name: value if name != "model" else "m"}, Limits())
    if (route, name) in BUILT:
        assert BUILT[route, name](call), call
    else:
        assert call.options[name] == value
    # Both routes go to vLLM's /v1/completions (Chat as the text its template makes): every option is a field there.
    assert set(call.options) <= set(_vllm_fields("completions")), call.options


@pytest.mark.parametrize(
    "route, name", _cases(lambda r: [f for f in _vllm_fields(r) if f not in FIELDS[r] and f != "model"])
)
def test_every_vllm_field_the_front_does_not_take_is_refused_by_name(route, name):
    with pytest.raises(FrontError) as caught:
        parse(route, {**REQUIRED[route], name: "not-a-neutral-value"}, Limits())
    assert caught.value.status == 400 and f"`{name}` is not" in str(caught.value)
    if name in NEUTRAL:  # at the value that means "not set" (clients send those), taken and not passed on
        assert name not in parse(route, {**REQUIRED[route], name: NEUTRAL[name][0]}, Limits()).options


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_front_takes_no_field_vllm_does_not_define_but_at_a_neutral_value(route):
    assert VLLM["routes"][route]["extra"] == "allow"  # what vLLM doesn't define, it drops with a log line only
    assert set(FIELDS[route]) <= set(_vllm_fields(route)), set(FIELDS[route]) - set(_vllm_fields(route))
    assert all((route, name) in BUILT or name in VALID for name in FIELDS[route])  # a case above for each
    # OpenAI's fields vLLM doesn't define on this route (0.32: `best_of`; on Completions `tools` too): neutral only.
    for name in sorted(set(NEUTRAL) - set(_vllm_fields(route))):
        for value in ("not-a-neutral-value", 2, True, ["x"]):
            if value not in NEUTRAL[name]:
                with pytest.raises(FrontError, match=f"`{name}` is not a field this front takes"):
                    parse(route, {**REQUIRED[route], name: value}, Limits())
        assert name not in parse(route, {**REQUIRED[route], name: NEUTRAL[name][0]}, Limits()).options


@pytest.mark.parametrize("name", ["", "org/model", "x" * 129, 7, None, "tiny-base"])
def test_an_adapter_name_is_checked_in_one_place_for_adapters_and_compositions(name):
    from peft_softprompt_plus.serve.requests import check_adapter_name

    for what in ("adapter name", "`--compose` name"):
        with pytest.raises(FrontError, match=f"{what} .* is invalid: use a string of 1 to 128 characters without '/'"):
            check_adapter_name(name, "tiny-base", what)
    check_adapter_name("x" * 128, "tiny-base")


def test_the_default_max_tokens_is_the_route_s():
    limits = Limits(default_max_tokens=300)
    assert (limits.default_max_tokens_for("chat"), limits.default_max_tokens_for("completions")) == (300, 16)
