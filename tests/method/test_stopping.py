"""KeepBest (stopping.py): the best step's values come back in place, patience stops, bad input is named."""

import pytest
import torch

from peft_softprompt_plus import KeepBest


def test_the_best_values_come_back_in_place_and_patience_stops(make_peft):
    model = make_peft()
    prompt = model.base_model.prompt("default")
    keep = KeepBest(patience=2)
    values = {}
    for step, score in enumerate([0.2, 0.5, 0.4, 0.5]):  # 0.5 again is no improvement
        with torch.no_grad():
            prompt.add_(1.0)
        values[step] = prompt.detach().clone()
        stop = keep.update(model, score, step)
        assert stop == (step == 3)
    assert (keep.best_step, keep.best_score, keep.since_best) == (1, 0.5, 2)
    keep.restore(model)
    assert model.base_model.prompt("default") is prompt and torch.equal(prompt, values[1])


def test_a_loss_improves_downwards_and_min_delta_counts(make_peft):
    model = make_peft()
    keep = KeepBest(higher_is_better=False, min_delta=0.1)
    for step, loss in enumerate([2.0, 1.95, 1.5, 1.45]):
        assert not keep.update(model, loss, step)  # no patience: never stops
    assert keep.best_step == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(patience=0), r"`patience` must be a positive int or None, got 0"),
        (dict(patience=True), r"`patience` must be a positive int or None, got True"),
        (dict(higher_is_better="yes"), r"`higher_is_better` must be True or False, got 'yes'"),
        (dict(min_delta=-1), r"`min_delta` must be a number >= 0, got -1"),
    ],
)
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KeepBest(**kwargs)


def test_bad_scores_and_early_restore_are_named(make_peft, make_base):
    model = make_peft()
    keep = KeepBest()
    with pytest.raises(ValueError, match=r"Nothing to restore"):
        keep.restore(model)
    with pytest.raises(ValueError, match=r"`score` must be a finite number, got nan at step 3"):
        keep.update(model, float("nan"), 3)
    with pytest.raises(ValueError, match="no trainable parameters"):
        KeepBest().update(make_base().requires_grad_(False), 1.0, 0)
    keep.update(model, 1.0, 0)
    with pytest.raises(ValueError, match="lacks the parameters"):
        keep.restore(make_base())


def test_the_custom_loop_example_keeps_its_best_step(capsys, monkeypatch):
    import pathlib
    import runpy
    import sys

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--steps", "30"])
    runpy.run_path(str(example), run_name="__main__")
    out = capsys.readouterr().out
    losses = {int(line.split()[1]): float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")}
    kept = int(out.split("kept step ")[1].split()[0])
    assert kept == min(losses, key=lambda s: (losses[s], s)) and "[not_in_optimizer]" in out
