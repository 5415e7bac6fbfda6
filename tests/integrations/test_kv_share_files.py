"""The share files vLLM's KV connector reads (`integrations/kv_connector_core.py`) as `softprompt-plus serve`
publishes them: each is hashed again, with the config in its metadata, the first time a process reads it, so a
planted, stale or torn file is refused with its reason (0 matched positions, nothing raised inside vLLM), and a
verified one costs a lookup per request while the process's cache, bounded in bytes, keeps it."""

from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from peft_softprompt_plus._names import SAVED_KV_KEY, VLLM_KV_TENSOR
from peft_softprompt_plus.files.content_hash import content_hash
from peft_softprompt_plus.integrations import kv_connector_core as core

POSITIONS, HEAD_SIZE = 6, 8
MODEL = core.ModelShape(layers=4, kv_heads=2, head_size=HEAD_SIZE)
CONFIG = {"prompt_level": "kv", "num_virtual_tokens": POSITIONS, "init_seed": 3}


def _publish(folder, values: torch.Tensor, config: dict, name=None) -> str:
    """`values` as the front publishes them (serve/share.py), under `name` (else their content hash)."""
    digest = name or content_hash(config, {SAVED_KV_KEY: values})
    save_file({VLLM_KV_TENSOR: values}, str(folder / f"{digest}.safetensors"), metadata=core.file_metadata(config))
    return digest


def test_a_published_file_is_served_and_its_metadata_holds_only_the_counted_config(tmp_path):
    values = torch.randn(4, 2, 2, POSITIONS, HEAD_SIZE)  # [layers, 2, Hkv, N, hd]
    digest = _publish(tmp_path, values, CONFIG)
    assert core.match(str(tmp_path), digest, MODEL, POSITIONS + 1, 0) == (POSITIONS, None)
    assert torch.equal(core.shared_prompt(str(tmp_path), digest), values)
    assert core.file_metadata(CONFIG) == {core.CONFIG_KEY: '{"num_virtual_tokens": 6, "prompt_level": "kv"}'}


def test_a_planted_or_stale_share_file_matches_nothing_and_says_why(tmp_path):
    values = torch.randn(4, 2, 2, POSITIONS, HEAD_SIZE)
    right, folder = content_hash(CONFIG, {SAVED_KV_KEY: values}), str(tmp_path)
    for wrong in (values + 1e-3, values.double()):  # planted under its name, or its tensor changed since
        _publish(tmp_path, wrong, CONFIG, name=right)
        found = content_hash(CONFIG, {SAVED_KV_KEY: wrong})
        assert core.match(folder, right, MODEL, 9, 0) == (
            0,
            f"the KV prompt {right!r} can't be read from {folder}: {tmp_path / right}.safetensors hashes to {found}, "
            "not to its name: a stale or planted file (loading the adapter into `softprompt-plus serve` again "
            "publishes it as it should be)",
        )
    _publish(tmp_path, values, {**CONFIG, "kv_text_start": POSITIONS + 2}, name=right)  # for another config
    assert "not to its name: a stale or planted file" in core.match(folder, right, MODEL, 9, 0)[1]
    save_file({VLLM_KV_TENSOR: values}, str(tmp_path / f"{right}.safetensors"))  # no config to hash it with
    assert "holds no config to hash it with: the front did not publish it" in core.match(folder, right, MODEL, 9, 0)[1]
    save_file({"other": values}, str(tmp_path / f"{right}.safetensors"), metadata=core.file_metadata(CONFIG))
    assert "holds the tensors ['other'], not the one 'kv_prompt'" in core.match(folder, right, MODEL, 9, 0)[1]
    (tmp_path / f"{right}.safetensors").write_bytes(b"torn")
    assert "is not a safetensors file" in core.match(folder, right, MODEL, 9, 0)[1]
    _publish(tmp_path, values, CONFIG)  # a refused file is read again: once right, it is served
    assert core.match(folder, right, MODEL, 9, 0) == (POSITIONS, None)


def test_a_share_file_is_hashed_once_while_kept_and_again_once_pushed_out_by_bytes(tmp_path):
    values = [torch.randn(4, 2, 2, POSITIONS, HEAD_SIZE) for _ in range(3)]  # 1,536 bytes each
    digests = [_publish(tmp_path, v, {**CONFIG, "init_seed": i}) for i, v in enumerate(values)]
    cache = core.PromptCache(max_bytes=2 * values[0].numel() * 4)  # room for two
    with mock.patch.object(core, "verified_prompt", wraps=core.verified_prompt) as verify:
        for computed in (0, 2, 4):
            assert core.match(str(tmp_path), digests[0], MODEL, 9, computed, cache) == (POSITIONS - computed, None)
        assert verify.call_count == 1  # then one lookup per request while it is kept
        for digest in digests[1:]:
            cache(str(tmp_path), digest)
        assert cache.bytes == 2 * values[0].numel() * 4 and verify.call_count == 3
        assert torch.equal(cache(str(tmp_path), digests[0]), values[0])  # pushed out by the third: read again
        assert verify.call_count == 4
        assert torch.equal(cache(str(tmp_path), digests[2]), values[2]) and verify.call_count == 4  # still kept
    with pytest.raises(ValueError, match="`cache_bytes` must be a whole number of bytes .* got -1"):
        core.PromptCache(-1)
    tiny = core.PromptCache(max_bytes=10)  # too small to keep any: each read is checked, and served
    assert torch.equal(tiny(str(tmp_path), digests[1]), values[1]) and tiny.bytes == 0
