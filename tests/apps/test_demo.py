"""The README's main job (demo.py): the learned prompt clearly beats the frozen model on held-out data."""

import os

import pytest

from peft_softprompt_plus.apps.demo import run_demo, run_real_demo


def test_demo_learns_a_task_it_can_reload(tmp_path):
    result = run_demo(out_dir=str(tmp_path / "adapter"), progress=False)
    assert result.accuracy_with_prompt >= result.accuracy_without_prompt + 0.5
    assert result.accuracy_after_reload == result.accuracy_with_prompt
    assert sorted(os.listdir(tmp_path / "adapter")) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert [continuation.split()[0] for _, continuation in result.samples] == ["seven", "eight", "nine"]


@pytest.mark.slow
def test_the_real_demo_runs_end_to_end_on_a_few_steps(tmp_path):
    result = run_real_demo("smollm2", steps=4, out_dir=str(tmp_path / "adapter"), progress=False, held_out=8)
    assert result.held_out == 8 and len(result.samples) == 5
    assert result.after_reload == result.with_prompt  # the saved adapter is the trained one
    assert 0.0 <= result.zero_shot <= result.three_shot  # scored on the same countries
    assert result.train_seconds > 0
    assert sorted(os.listdir(tmp_path / "adapter")) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_the_demo_cli_runs_the_real_job_for_a_checkpoint_name(monkeypatch, capsys):
    from peft_softprompt_plus.apps import cli, demo

    seen = {}

    def fake_real_demo(name, steps, out_dir, seed):
        seen.update(name=name, steps=steps)
        return demo.RealDemoResult(name, 88, 0.0, 0.2, 0.35, 0.35, 12.0, "/tmp/a", [("France", "Paris")])

    monkeypatch.setattr(demo, "run_real_demo", fake_real_demo)
    assert cli.main(["demo", "--model", "smollm2"]) == 0
    out = capsys.readouterr().out
    assert seen == {"name": "smollm2", "steps": 120}
    assert "hard 3-shot:      20.0%" in out and "learned soft prompt:            35.0%" in out
