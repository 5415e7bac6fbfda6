"""Save/load (PEFT hooks in tuner.py, the crash-safe save in integrations/peft_registry.py, model_card.py)."""

import json
import os

import pytest
import safetensors.torch
import torch
from conftest import random_ids
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import tiny_gpt2


@pytest.fixture
def trained(tiny_model_dir):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0),
    )
    with torch.no_grad():
        model.base_model.prompt("default").normal_()
    return model.eval()


def test_saved_files_and_exact_keys(trained, tmp_path):
    trained.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    tensors = safetensors.torch.load_file(tmp_path / "adapter_model.safetensors")
    assert set(tensors) == {"base_model.softprompt_plus.prompt"}
    assert tensors["base_model.softprompt_plus.prompt"].dtype == torch.float32
    assert torch.equal(tensors["base_model.softprompt_plus.prompt"], trained.base_model.prompt("default"))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "SOFTPROMPT_PLUS" and config["num_virtual_tokens"] == 4


def test_reload_gives_bit_equal_logits(trained, tiny_model_dir, tmp_path):
    ids = random_ids(2, 6)
    expected = trained(input_ids=ids).logits
    trained.save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = PeftModel.from_pretrained(base, tmp_path)
    assert torch.equal(loaded(input_ids=ids).logits, expected)
    assert base.lm_head.weight is base.transformer.wte.weight
    auto = AutoPeftModelForCausalLM.from_pretrained(tmp_path)  # base path taken from the adapter config
    assert torch.equal(auto(input_ids=ids).logits, expected)
    assert not any(p.requires_grad for p in loaded.parameters())  # inference by default, like any PEFT adapter


def test_reload_trainable_and_multiple_adapters(trained, tiny_model_dir, tmp_path):
    trained.save_pretrained(tmp_path / "a")
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "a", is_trainable=True
    )
    assert [n for n, p in loaded.named_parameters() if p.requires_grad] == [
        "base_model.prompt_bank.softprompt_plus_prompt.default"
    ]
    loaded.load_adapter(tmp_path / "a", adapter_name="second")
    loaded.set_adapter("second")
    ids = random_ids(1, 5)
    torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)


def test_model_card(trained, tmp_path):
    trained.save_pretrained(tmp_path / "my-adapter")
    card = (tmp_path / "my-adapter" / "README.md").read_text()
    assert "library_name: peft" in card and "base_model:" in card and "softprompt-plus" in card
    snippet = card[card.index("```python") :]
    assert snippet.splitlines()[1].startswith("import peft_softprompt_plus")
    assert str(tmp_path / "my-adapter") in snippet
    trained.save_pretrained(tmp_path / "my-adapter")  # re-saving keeps one section
    assert (tmp_path / "my-adapter" / "README.md").read_text().count("## Soft prompt (peft-softprompt-plus)") == 1


def test_wrong_base_is_explained(trained, tmp_path):
    trained.save_pretrained(tmp_path)
    wider = tiny_gpt2(n_embd=32)
    flags = {n: p.requires_grad for n, p in wider.named_parameters()}
    with pytest.raises(ValueError, match=r"hidden size 64, but this base model's is 32"):
        PeftModel.from_pretrained(wider, tmp_path, is_trainable=True)
    assert {n: p.requires_grad for n, p in wider.named_parameters()} == flags  # the caller's base is untouched


def _tree_bytes(root):
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}


def test_failed_save_leaves_previous_adapter_intact(trained, tmp_path, monkeypatch):
    # The target gets its own parent, so the staging folders beside it (saving.py: `.<target>.softprompt-plus-save-
    # <pid>-...`) are the only other entries there.
    target = tmp_path / "adapter"
    trained.save_pretrained(target)
    before = _tree_bytes(target)
    assert os.listdir(tmp_path) == ["adapter"]  # a successful save cleans up its staging folder too
    with torch.no_grad():
        trained.base_model.prompt("default").add_(1.0)
    written_to = []

    def disk_full(tensors, filename, *args, **kwargs):
        written_to.append(os.path.relpath(filename, tmp_path))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("peft.peft_model.safe_save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        trained.save_pretrained(target)
    # The failure came while the save wrote into a staging folder, not into the target; else the check below that it
    # is gone would pass without a staging folder ever existing.
    [written] = written_to
    staging, file = os.path.split(written)
    assert file == "adapter_model.safetensors" and staging.startswith(f".adapter.softprompt-plus-save-{os.getpid()}-")
    assert _tree_bytes(target) == before
    assert os.listdir(tmp_path) == ["adapter"]


def test_save_into_a_file_path_is_refused(trained, tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    with pytest.raises(ValueError, match="should be a directory|must be a directory"):
        trained.save_pretrained(target)
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("is_trainable", [False, True])
def test_low_cpu_mem_usage_load(trained, tiny_model_dir, tmp_path, is_trainable):
    """PEFT builds the prompt on the meta device and fills it from the file; the probe waits for real values."""
    trained.save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = PeftModel.from_pretrained(base, tmp_path, low_cpu_mem_usage=True, is_trainable=is_trainable)
    prompt = loaded.base_model.prompt("default")
    assert prompt.device.type == "cpu" and prompt.dtype == torch.float32 and prompt.requires_grad == is_trainable
    ids = random_ids(1, 5)
    assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)


@pytest.mark.slow
def test_a_killed_save_leaves_the_old_adapter_or_the_new_one(tiny_model_dir, tmp_path):
    # A save killed before or after any of its filesystem steps, or at random instants on a slow filesystem, leaves a
    # folder that loads as exactly the old adapter (N=4) or the new one (N=6); the next save removes the leftovers.
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_save_kill_worker.py")
    out = tmp_path / "kills.json"
    done = subprocess.run(
        [sys.executable, worker, str(tiny_model_dir), str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] >= 4  # links, fsyncs, the exchange: the kill points are real
    seen = {"old": 0, "new": 0}
    for outcome in result["outcomes"]:
        matches = [name for name, prompt in result["expected"].items() if outcome["prompt"] == prompt]
        assert matches, f"kill at {outcome['kill_at']}: the folder loads as neither the old nor the new adapter"
        seen[matches[0]] += 1
    assert seen["old"] and seen["new"]  # kills early and late both happened
    assert result["leftovers"] == []
