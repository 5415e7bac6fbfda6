"""The examples that cross layers, run as a user runs them (`python examples/X.py`, offline, tiny models): what each
one saves is checked against the library's own reload, and what it prints against what it returns."""

import json
import pathlib
import runpy
import sys

from peft import PeftModel
from safetensors.torch import load_file

from peft_softprompt_plus._names import SAVED_KV_KEY

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, argv: list[str], monkeypatch) -> dict:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *argv])
    return runpy.run_path(str(EXAMPLES / script), run_name="__main__")


def test_the_kv_prompt_example_trains_reloads_generates_and_converts_to_cartridge(tmp_path, monkeypatch, capsys):
    report = _run("kv_prompt_trainer.py", ["--output-dir", str(tmp_path), "--steps", "3"], monkeypatch)["report"]
    assert report["final_loss"] < report["initial_loss"]
    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == {SAVED_KV_KEY}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["prompt_level"] == "kv" and config["kv_frozen_positions"] == 0 and config["prompt_init"] == "text"
    cartridge = json.loads((tmp_path / "cartridge" / "adapter_config.json").read_text())
    assert cartridge["peft_type"] == "CARTRIDGE" and cartridge["num_virtual_tokens"] == config["num_virtual_tokens"]
    assert report["cartridge_gap"] < 1e-5  # PEFT's CARTRIDGE forward reads the same keys/values
    assert report["sample"].startswith("red green") and f"sample: {report['sample']!r}" in capsys.readouterr().out


def test_the_distill_example_trains_an_input_and_a_kv_student_and_prints_each_report(tmp_path, monkeypatch, capsys):
    result = _run("distill_system_prompt.py", ["--output-dir", str(tmp_path), "--steps", "6"], monkeypatch)["result"]
    reports, out = result["reports"], capsys.readouterr().out
    assert sorted(reports) == ["input", "kv"]
    assert reports["kv"].samples is reports["input"].samples  # both students learn from the same teacher rows
    for level, report in reports.items():
        assert report.student.kl < report.none.kl, level  # each closes part of the gap on turns never trained on
        assert "\n".join(report.lines()) in out and f"--- {level} student" in out
        saved = tmp_path / level
        assert json.loads((saved / "adapter_config.json").read_text())["prompt_level"] == level
    base = runpy.run_path(str(EXAMPLES / "distill_system_prompt.py"), run_name="checked")["tiny_chat_model"]()[0]
    config = PeftModel.from_pretrained(base, tmp_path / "kv").peft_config["default"]
    # The `selected` start keeps the system turn's own positions: the text reads on where that turn ended.
    assert config.prompt_level == "kv" and config.kv_text_start == reports["kv"].prefix_tokens


def test_the_context_tuning_example_starts_from_demonstrations_and_saves_their_spans(tmp_path, monkeypatch, capsys):
    result = _run("context_tuning.py", ["--output-dir", str(tmp_path), "--steps", "4"], monkeypatch)["result"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["prompt_init"] == "demonstrations" and config["demonstration_spans"] == result["spans"]
    assert len(config["demonstration_ids"]) == len(result["demonstrations"]) == 4
    assert config["num_virtual_tokens"] == config["kv_text_start"]  # every position of the context kept
    assert len(result["losses"]) == 4 and "step 4: loss" in capsys.readouterr().out


def test_the_context_tuning_trainer_example_passes_demonstration_index_and_keeps_per_head_origins(
    tmp_path, monkeypatch, capsys
):
    from peft_softprompt_plus.forward import kv_regularize

    monkeypatch.setattr(kv_regularize, "_matched", lambda *a: -1)  # no row told by its ids: the column alone counts
    result = _run("context_tuning_trainer.py", ["--output-dir", str(tmp_path), "--steps", "4"], monkeypatch)["result"]
    counts = result["counts"]
    assert counts["matched"] > 0 and counts["matched"] + counts["unmatched"] == 4 * 4  # 4 steps of 4 rows
    last = result["logged"][-1]  # the Trainer's own log carries the counts (LeaveOneOutLogCallback)
    assert (last["leave_one_out_matched"], last["leave_one_out_unmatched"]) == (counts["matched"], counts["unmatched"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["kv_selection"] == "per_head" and len(config["demonstration_ids"]) == 4
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    origins = saved["base_model.softprompt_plus.kv_origins"]
    assert origins.shape[-1] == config["num_virtual_tokens"] == 6
    assert "leave-one-out rows: {'matched'" in capsys.readouterr().out
