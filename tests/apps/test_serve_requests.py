"""apps/serve_requests.py: every field of a request body checked against its route's table, without HTTP."""

from __future__ import annotations

import pytest
import serve_bodies
from hypothesis import HealthCheck, given, settings

from peft_softprompt_plus.apps.serve_requests import FrontError, Limits, parse

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
