"""The README's main job (demo.py): the learned prompt clearly beats the frozen model on held-out data."""

import os

from peft_softprompt_plus.demo import run_demo


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
