"""An adapter's content hash (files/content_hash.py): equal content hashes equal wherever it was saved from, one prompt
value or one field that changes the computation changes it, the fields it leaves out are saved fields, and the
definition is pinned (a KV prompt's published file name depends on it)."""

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from peft_softprompt_plus._names import SAVED_KEY
from peft_softprompt_plus.files.content_hash import NOT_COMPUTED, content_hash


def _saved(make_peft, folder, **config):
    make_peft(**config).save_pretrained(folder)
    saved = json.loads((folder / "adapter_config.json").read_text())
    return saved, load_file(folder / "adapter_model.safetensors")


@pytest.fixture
def saved(make_peft, tmp_path):
    return _saved(make_peft, tmp_path / "a", num_virtual_tokens=4, init_seed=0, prompt_init="random")


def test_equal_content_hashes_equal_whatever_its_provenance(saved, make_peft, tmp_path):
    config, tensors = saved
    # Another adapter's config, differing in provenance only (its start, seed and base path), with the first's prompt.
    again_config, _ = _saved(make_peft, tmp_path / "b", num_virtual_tokens=4, init_seed=1, prompt_init="vocab")
    again_config["base_model_name_or_path"] = "/somewhere/else"
    assert again_config != config
    assert content_hash(again_config, {k: v.clone() for k, v in tensors.items()}) == content_hash(config, tensors)
    assert len(content_hash(config, tensors)) == 32


def test_one_prompt_value_changes_the_hash(saved):
    config, tensors = saved
    changed = tensors[SAVED_KEY].clone()
    changed[2, 5] = torch.nextafter(changed[2, 5], torch.tensor(float("inf")))  # one ulp, one value
    assert content_hash(config, {SAVED_KEY: changed}) != content_hash(config, tensors)
    assert content_hash(config, {SAVED_KEY: tensors[SAVED_KEY].double()}) != content_hash(config, tensors)


@pytest.mark.parametrize(
    "field, value",
    [("chat_format", "student"), ("prompt_prefix_ids", [1]), ("prompt_suffix_ids", [2]), ("prompt_level", "kv")],
)
def test_a_field_that_changes_the_computation_changes_the_hash(saved, field, value):
    config, tensors = saved
    assert config[field] != value
    assert content_hash({**config, field: value}, tensors) != content_hash(config, tensors)


def test_the_fields_left_out_are_saved_fields_and_change_nothing(saved):
    config, tensors = saved
    assert NOT_COMPUTED <= set(config)  # a renamed field would otherwise start counting unseen
    provenance = {**config, **{key: f"other {key}" for key in NOT_COMPUTED}}
    assert content_hash(provenance, tensors) == content_hash(config, tensors)


def test_the_definition_is_pinned():
    # A change here renames every published KV prompt (the front publishes it again under the new name): change the
    # VERSION with the definition. The reference spells the docstring's definition out with hashlib and numpy.
    config = {"num_virtual_tokens": 2, "chat_format": None, "init_seed": 3}
    tensors = {"b": torch.arange(3, dtype=torch.int64), "a": torch.arange(4, dtype=torch.float32).reshape(2, 2)}
    header = {"config": {"chat_format": None, "num_virtual_tokens": 2}}
    header["tensors"] = [["a", "torch.float32", [2, 2]], ["b", "torch.int64", [3]]]
    reference = hashlib.sha256(b"peft-softprompt-plus adapter content 1\n")
    reference.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    reference.update(np.arange(4, dtype="<f4").tobytes() + np.arange(3, dtype="<i8").tobytes())
    assert content_hash(config, tensors) == reference.hexdigest()[:32] == "92c2ae0ace7395702a13b93878c27b40"
