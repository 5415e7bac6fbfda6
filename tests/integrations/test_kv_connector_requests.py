"""What a request asks of the KV connector (`integrations/kv_connector_requests.py`), whatever JSON a client sent to
vLLM directly: the connector's scheduler side (its vLLM imports stood in, tests/serve/kv_connector_stub.py) never
raises, matches 0 positions with a reason for anything but a well-formed request, and never serves a KV prompt under
a salt some request ran under without it."""

import json

import kv_connector_stub
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peft_softprompt_plus._names import VLLM_KV_PARAM, VLLM_KV_REFUSED, VLLM_KV_SERVED
from peft_softprompt_plus.integrations import kv_connector_requests as requests
from peft_softprompt_plus.serve.share import publish

POSITIONS = 4
SALT = "s" * 32
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def share(tmp_path_factory):
    folder = tmp_path_factory.mktemp("share")
    layers, kv_heads, head_size = kv_connector_stub.tiny_base()
    config = {"num_virtual_tokens": POSITIONS, "prompt_level": "kv"}
    digest = publish(str(folder), config, torch.randn(layers, 2, kv_heads, POSITIONS, head_size))
    return str(folder), digest


@pytest.fixture(scope="module")
def connector(share):
    return kv_connector_stub.scheduler_connector(share[0])


def _body(params, salt) -> dict:
    return {"prompt": [7] * POSITIONS + [11, 12], "kv_transfer_params": params, "cache_salt": salt}


@settings(max_examples=300, deadline=None)
@given(params=JSON, salt=JSON)
def test_any_json_in_the_connector_s_fields_matches_nothing_and_says_why_never_raising(connector, params, salt):
    named, reason = requests.named_prompt(params, salt)
    assert named is None and (reason is None or isinstance(reason, str))
    mark = kv_connector_stub.served_mark(connector, _body(params, salt))  # the real scheduler side: no raise
    assert mark is None or set(mark) == {VLLM_KV_REFUSED}
    if reason is not None:
        assert mark == {VLLM_KV_REFUSED: reason}
    json.dumps(mark)  # vLLM returns it to the client as JSON


@settings(max_examples=200, deadline=None)
@given(value=JSON, extra=st.dictionaries(st.text(max_size=20), JSON, max_size=3), salt=JSON)
def test_any_json_as_the_prompt_s_name_matches_nothing_and_says_why_never_raising(connector, value, extra, salt):
    params = {**extra, VLLM_KV_PARAM: value}
    mark = kv_connector_stub.served_mark(connector, _body(params, salt))
    assert set(mark) == {VLLM_KV_REFUSED} and isinstance(mark[VLLM_KV_REFUSED], str)


@pytest.mark.parametrize(
    ("params", "salt", "why"),
    [
        ([1, 2], SALT, "`kv_transfer_params` must be an object, got list [1, 2]"),
        ({VLLM_KV_PARAM: 1}, SALT, f"`kv_transfer_params.{VLLM_KV_PARAM}` must be a content hash (16 to 64 "),
        ({VLLM_KV_PARAM: "ab" * 8 + "\n"}, SALT, "got str 'abababababababab\\n'"),  # `$` would take the newline
        ({VLLM_KV_PARAM: "../../etc/passwd"}, SALT, "must be a content hash"),
        ({VLLM_KV_PARAM: "ab" * 16}, None, "a KV request must carry a `cache_salt` of 16 to 128"),
        ({VLLM_KV_PARAM: "ab" * 16}, "short", "got str 'short'"),
        ({VLLM_KV_PARAM: "ab" * 16}, ["a" * 20], "got list"),
    ],
)
def test_malformed_fields_sent_to_vllm_directly_are_named_in_the_refusal(params, salt, why):
    named, reason = requests.named_prompt(params, salt)
    assert named is None and why in reason


def test_a_well_formed_request_is_named_and_one_without_the_key_is_not_the_connector_s(share):
    assert requests.named_prompt({VLLM_KV_PARAM: share[1], "other": 1}, SALT) == (requests.Named(share[1], SALT), None)
    assert requests.named_prompt(None, SALT) == (None, None)
    assert requests.named_prompt({"do_remote_prefill": True}, None) == (None, None)  # another connector's field


def test_the_engine_s_salt_book_is_bounded_and_forgets_the_oldest_first():
    book = requests.SaltBook(limit=3)
    for i in range(5):
        book.retire(f"{i}" * 16, "refused")
    assert book.why_not("0" * 16) is None and book.why_not("1" * 16) is None
    assert "was retired (refused)" in book.why_not("4" * 16)
    book.served("9" * 16)
    book.without_prompt("9" * 16)  # a KV prompt's salt used without one: retired
    assert "a request that named no KV prompt ran under it" in book.why_not("9" * 16)
    book.without_prompt("8" * 16)  # first used without one: never serves one
    assert "was used by a request that named no KV prompt" in book.why_not("8" * 16)
    book.without_prompt(None)
    book.retire(None, "no salt: nothing to retire")


def test_a_served_salt_is_retired_when_a_worker_fails_to_write_its_prompt(share, connector):
    """vLLM fails such a request and evicts its blocks (`kv_load_failure_policy="fail"`); the salt goes too."""
    import types

    folder, digest = share
    body = _body({VLLM_KV_PARAM: digest}, "w" * 32)
    request = kv_connector_stub._request(body)
    assert connector.get_num_new_matched_tokens(request, 0) == (POSITIONS, False)
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([5, 6],))
    connector.update_state_after_alloc(request, blocks, POSITIONS)
    connector.build_connector_meta(None)
    connector.update_connector_output(types.SimpleNamespace(invalid_block_ids={5}))
    assert "a worker failed to write its KV prompt" in connector._salts.why_not("w" * 32)
    assert connector.request_finished(request, [])[1] == {VLLM_KV_SERVED: digest}  # vLLM fails it: a 500 upstream
    later = kv_connector_stub.served_mark(connector, body)
    assert "was retired (a worker failed to write its KV prompt)" in later[VLLM_KV_REFUSED]


def test_the_connector_refuses_to_start_where_a_failed_load_would_be_recomputed(share):
    with pytest.raises(ValueError, match="`kv_load_failure_policy` must be 'fail' for this connector, got 'recomp"):
        kv_connector_stub.scheduler_connector(share[0], policy="recompute")
