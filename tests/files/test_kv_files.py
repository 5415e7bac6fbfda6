"""A KV prompt's files (files/saving.py, files/reading.py, files/loading.py, files/inspect_adapter.py, the model
card): the saved keys as an exact set, bit-equal reloads (its frozen positions included), crash-safe saves, every
broken file named, and a release from before KV prompts refusing the folder with the version it needs."""

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from peft_softprompt_plus import AdapterFileError, SoftPromptPlusConfig
from peft_softprompt_plus._names import KV_SINCE, SAVED_KV_KEY
from peft_softprompt_plus.apps.tiny import tiny_family
from peft_softprompt_plus.files.inspect_adapter import inspect_adapter

VOCAB = 300
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEFORE_KV = "ddec03c12e2a134c91cba755c51584f999dc7d5b"  # main's last commit before KV prompts (release 0.2.0's code)


def base():
    return tiny_family("llama", VOCAB)


@pytest.fixture
def trained(tmp_path):
    config = SoftPromptPlusConfig(num_virtual_tokens=5, prompt_level="kv", init_seed=0, kv_frozen_positions=1)
    model = get_peft_model(base(), config)
    model.add_adapter("other", SoftPromptPlusConfig(num_virtual_tokens=3, prompt_level="kv", kv_frozen_positions=0))
    with torch.no_grad():
        for name in ("default", "other"):
            model.base_model.prompt(name).add_(torch.randn(model.base_model.prompt(name).shape) * 0.1)
    return model.eval()


def values(model, name="default"):
    return model.base_model.prompt_bank.values(name).detach()


def test_the_saved_files_hold_one_tensor_under_the_kv_key(trained, tmp_path):
    trained.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert set(tensors) == {SAVED_KV_KEY} and f">={KV_SINCE}" in SAVED_KV_KEY
    assert tensors[SAVED_KV_KEY].dtype == torch.float32 and torch.equal(tensors[SAVED_KV_KEY], values(trained))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["prompt_level"] == "kv" and config["kv_frozen_positions"] == 1 and config["kv_text_start"] == 5
    assert config["kv_base"] == {
        "model_type": "llama",
        "layers": 2,
        "kv_heads": 2,
        "head_dim": 16,
        "settings": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    }
    other = load_file(tmp_path / "other" / "adapter_model.safetensors")
    assert set(other) == {SAVED_KV_KEY} and other[SAVED_KV_KEY].shape == (2, 2, 2, 3, 16)


@pytest.mark.parametrize("is_trainable", [False, True])
def test_reload_is_bit_equal_with_the_sink_apart(trained, tmp_path, is_trainable):
    trained.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(base(), tmp_path, is_trainable=is_trainable)
    loaded.load_adapter(tmp_path / "other", adapter_name="other")
    for name in ("default", "other"):
        assert torch.equal(values(loaded, name), values(trained, name))
    assert loaded.base_model.prompt("default").shape == (2, 2, 2, 4, 16)  # the trained positions after the sink
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, trained(input_ids=ids).logits)
    trainable = {n for n, p in loaded.named_parameters() if p.requires_grad}
    assert trainable == ({"base_model.prompt_bank.softprompt_plus_prompt.default"} if is_trainable else set())


def test_a_failed_save_leaves_the_kv_adapter_on_disk_intact(trained, tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    trained.save_pretrained(target)
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    with torch.no_grad():
        trained.base_model.prompt("default").add_(1.0)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("peft.peft_model.safe_save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        trained.save_pretrained(target)
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, match",
    [
        (dict(num_virtual_tokens=6), r"holds 5 positions, but adapter_config.json says num_virtual_tokens=6"),
        (dict(prompt_level="input"), r"holds a KV prompt, but its adapter_config.json says `prompt_level` is not"),
        (
            dict(kv_base={"model_type": "llama", "layers": 3, "kv_heads": 2, "head_dim": 16}),
            r"shape \[2, 2, 2, 5, 16\] .* its config's `kv_base` says \[3, 2, 2, 5, 16\]",
        ),
    ],
)
def test_a_broken_kv_folder_is_named_and_the_base_left_alone(trained, tmp_path, damage, match):
    trained.save_pretrained(tmp_path, selected_adapters=["default"])
    _edit_config(tmp_path, **damage)
    model = base()
    own = model.config._attn_implementation
    with pytest.raises(AdapterFileError, match=match):
        PeftModel.from_pretrained(model, tmp_path)
    assert model.config._attn_implementation == own and not any("softprompt" in n for n, _ in model.named_parameters())


def test_non_finite_keys_are_refused(trained, tmp_path):
    trained.save_pretrained(tmp_path, selected_adapters=["default"])
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    tensors[SAVED_KV_KEY][0, 0, 0, 2, 3] = float("nan")
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(AdapterFileError, match=r"1 non-finite value\(s\)"):
        PeftModel.from_pretrained(base(), tmp_path)


def _release_before_kv(tmp_path) -> str:
    """The package's source as main held it before KV prompts, from this clone's history."""
    try:
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", BEFORE_KV, "src"], capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"this checkout has no git history to take the earlier release from ({err})")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path / "old", filter="data")
    return str(tmp_path / "old" / "src")


@pytest.mark.slow
def test_a_release_before_kv_prompts_names_the_version_it_needs(trained, tmp_path):
    trained.save_pretrained(tmp_path / "adapter", selected_adapters=["default"])
    code = (
        "import sys, peft_softprompt_plus\n"
        "assert peft_softprompt_plus.__version__ == '0.2.0', peft_softprompt_plus.__file__\n"
        "from peft import PeftModel\n"
        "from peft_softprompt_plus.apps.tiny import tiny_family\n"
        "from peft_softprompt_plus.files.inspect_adapter import inspect_adapter\n"
        "for load in (lambda: PeftModel.from_pretrained(tiny_family('llama', 300), sys.argv[1]),\n"
        "             lambda: inspect_adapter(sys.argv[1])):\n"
        "    try:\n"
        "        load()\n"
        "    except Exception as err:\n"
        "        print(type(err).__name__, err)\n"
        "    else:\n"
        "        print('LOADED')\n"
    )
    env = dict(os.environ, PYTHONPATH=_release_before_kv(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "adapter")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and "LOADED" not in out.stdout
    assert all(f"requires peft-softprompt-plus>={KV_SINCE}" in line for line in lines), lines


def test_inspect_reports_norms_per_position_and_layer(trained, tmp_path):
    trained.save_pretrained(tmp_path, selected_adapters=["default"])
    report = inspect_adapter(str(tmp_path))
    assert report.shape == [2, 2, 2, 5, 16] and len(report.tokens) == 5 and len(report.layers) == 2
    stored = values(trained)
    torch.testing.assert_close(report.tokens[3].norm, float(stored[..., 3, :].norm()))
    torch.testing.assert_close(report.layers[1]["value"], float(stored[1, 1].norm(dim=-1).mean()))
    assert all(token.nearest == [] for token in report.tokens)
    text = report.format()
    assert "[layers, 2 (key, value), key/value heads, N, head size]" in text and "no nearest vocabulary" in text


def test_the_model_card_says_it_is_a_kv_prompt(trained, tmp_path):
    trained.save_pretrained(tmp_path, selected_adapters=["default"])
    card = (tmp_path / "README.md").read_text()
    assert "A KV prompt for a frozen" in card and "- prompt level: `kv`" in card
    assert "- prompt shape: [2, 2, 2, 5, 16] float32" in card and "text starts at position: 5" in card


# ------------------------------------------------------------------------------------------------ PEFT CARTRIDGE


def test_a_kv_adapter_converts_to_a_cartridge_peft_loads_alone(trained, tmp_path):
    from peft_softprompt_plus import to_cartridge

    to_cartridge(trained, tmp_path / "cartridge")
    config = json.loads((tmp_path / "cartridge" / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "CARTRIDGE" and config["num_virtual_tokens"] == 5 and config["num_frozen_tokens"] == 1
    )
    theirs = PeftModel.from_pretrained(base(), tmp_path / "cartridge").eval()
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"`adapter_name`='nope' must name a KV adapter"):
        to_cartridge(trained, tmp_path / "x", adapter_name="nope")


def test_a_peft_cartridge_converts_to_a_kv_adapter(tmp_path):
    from peft import CartridgeConfig

    from peft_softprompt_plus import from_cartridge

    theirs = get_peft_model(base(), CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=6, num_frozen_tokens=2))
    theirs.save_pretrained(tmp_path / "cartridge")  # PEFT's own save, its random start
    ours = from_cartridge(base(), str(tmp_path / "cartridge")).eval()
    assert ours.peft_config["default"].kv_frozen_positions == 2 and ours.base_model.prompt("default").shape[-2] == 4
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=ids).logits, theirs.eval()(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    other = tiny_family("gpt2", VOCAB)
    with pytest.raises(ValueError, match=r"this base's keys/values for 6 positions are \[2, 2, 4, 6, 16\]"):
        from_cartridge(other, str(tmp_path / "cartridge"))
    assert not any("softprompt" in n for n, _ in other.named_parameters())
    with pytest.raises(ValueError, match=r"holds a 'SOFTPROMPT_PLUS' adapter, not a PEFT CARTRIDGE one"):
        ours.save_pretrained(tmp_path / "ours")
        from_cartridge(base(), str(tmp_path / "ours"))
