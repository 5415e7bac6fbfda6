"""Hypothesis strategies for `softprompt-plus serve` request bodies: valid ones (every field at a value vLLM takes),
and malformed ones that say which field they broke. Shared by the serve tests and bench/vllm_check.py (which sends
them to a real vLLM)."""

from __future__ import annotations

from hypothesis import strategies as st

# Short ASCII texts: what fits a tiny test model's 128 positions with room for an answer.
SHORT = st.text(st.sampled_from("abcdefgh ."), min_size=1, max_size=8)
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=24)
NUMBERS = st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=True, allow_infinity=True))
ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)
_OPTIONAL = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 1, 5, 50]),
    "n": st.integers(1, 2),
    "stop": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2)),
    "seed": st.integers(0, 2**31),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 1),
    "ignore_eos": st.booleans(),
    "user": TEXT,
    "echo": st.just(False),
}


def completion(models: list[str], vocab: int, text=TEXT):
    prompt = st.one_of(
        text,
        st.lists(text, min_size=1, max_size=3),
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8),
    )
    optional = {**_OPTIONAL, "logprobs": st.integers(0, 3)}
    return st.fixed_dictionaries({"model": st.sampled_from(models), "prompt": prompt}, optional=optional)


def chat(models: list[str], text=TEXT):
    turn = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(text, _parts(text))}
    )
    last = st.fixed_dictionaries({"role": st.just("user"), "content": text})
    messages = st.tuples(st.lists(turn, max_size=2), last).map(lambda t: [*t[0], t[1]])
    optional = {**_OPTIONAL, "logprobs": st.just(True), "top_logprobs": st.integers(0, 3)}
    del optional["echo"]
    body = st.fixed_dictionaries({"model": st.sampled_from(models), "messages": messages}, optional=optional)
    return body.map(lambda b: {**b, "logprobs": True} if "top_logprobs" in b else b)  # OpenAI asks for both


def _parts(text=TEXT):
    return st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2)


# field -> values it must never accept (each a 400 that names the field)
BROKEN = {
    "model": st.one_of(st.integers(), st.lists(TEXT, min_size=1, max_size=2), st.dictionaries(TEXT, TEXT, max_size=1)),
    "max_tokens": st.one_of(
        st.integers(max_value=0), st.integers(10**7, 10**9), TEXT, st.floats(1.5, 9.5), st.booleans()
    ),
    "n": st.one_of(st.integers(max_value=0), st.integers(9, 10**6), st.floats(1.5, 3.5), TEXT),
    "temperature": st.one_of(TEXT, st.floats(2.01, 1e9), st.floats(max_value=-0.01), st.booleans(), st.just([1])),
    "top_p": st.one_of(st.floats(1.01, 50), st.just(0), TEXT),
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=2), st.just(""), st.just([""])),
    "seed": st.one_of(TEXT, st.floats(0.5, 9.5), st.integers(2**64, 2**70)),
    "stream": st.one_of(st.integers(), TEXT),
    "logprobs": st.one_of(TEXT, st.integers(21, 1000), st.floats(0.5, 2.5)),
    "user": st.one_of(st.integers(), st.lists(TEXT, min_size=1, max_size=1)),
    "frequency_penalty": st.one_of(st.floats(2.01, 1e6), TEXT),
}
BROKEN_PROMPT = st.one_of(
    st.integers(),
    st.floats(),
    st.just([]),
    st.just([1.5]),
    st.just([["a"]]),
    st.just(["a", 1]),
    st.dictionaries(TEXT, TEXT),
)
BROKEN_MESSAGES = st.one_of(
    st.just([]),
    TEXT,
    st.just([{"role": "wizard", "content": "hi"}]),
    st.just([{"role": "user", "content": 5}]),
    st.just([{"role": "user"}]),
    st.just([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    st.just([{"role": "user", "content": "hi", "tool_calls": []}]),
    st.just(["hi"]),
)
UNKNOWN = st.sampled_from(["response_format", "tools_choice", "logit_bias", "suffix", "best_of", "functions", "x"])


@st.composite
def malformed(draw, models: list[str], vocab: int):
    """(route, body, the field the 400 must name)."""
    route = draw(st.sampled_from(["completions", "chat"]))
    body = draw(completion(models, vocab) if route == "completions" else chat(models))
    body.pop("stream", None)
    kind = draw(st.sampled_from(["field", "prompt", "unknown"]))
    if kind == "field":
        name = draw(st.sampled_from(sorted(BROKEN)))
        if name == "logprobs" and route == "chat":
            name = "top_logprobs"
            body["logprobs"] = True
            body[name] = draw(st.one_of(st.integers(21, 1000), TEXT))
        else:
            body[name] = draw(BROKEN[name])
        return route, body, name
    if kind == "prompt":
        name = "prompt" if route == "completions" else "messages"
        body[name] = draw(BROKEN_PROMPT if route == "completions" else BROKEN_MESSAGES)
        return route, body, name
    name = draw(UNKNOWN)
    body[name] = draw(st.one_of(st.integers(2, 5), st.just({"a": 1}), st.just("json_object")))
    return route, body, name
