"""Gradient reachability: the attach-time probe, `check_gradient_flow` (one test per finding code, plus bad input),
the warn-once on grad-disabled training forwards, and `GradientFlowCallback` on a tiny `Trainer` run."""

import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
from _versions import checkpointing_on
from conftest import random_ids
from peft import PeftModel
from torch import nn

from peft_softprompt_plus import (
    FINDING_CODES,
    GradientFlowCallback,
    GradientFlowError,
    GradientFlowWarning,
    SoftPromptPlusConfig,
    check_gradient_flow,
)
from peft_softprompt_plus.gradients import flow as gf


def _prompt(model):
    return model.base_model.prompt("default")


def _batch(length=6, batch=2):
    ids = random_ids(batch, length)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _cut_block_input(base):
    """A hook that detaches the hidden states entering block 0: nothing before it (prompt included) gets a gradient."""
    return base.transformer.h[0].register_forward_pre_hook(lambda module, args: (args[0].detach(), *args[1:]))


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- attach-time probe


def test_attach_probe_passes_and_leaves_no_trace(make_peft):
    model = make_peft(validate_gradients="raise")
    tuner, prompt = model.base_model, _prompt(model)
    model.eval()
    tuner.model.transformer.h[1].train()  # a mixed mode must come back exactly as it was
    modes = {name: m.training for name, m in model.named_modules()}
    before, rng = _state(model), torch.get_rng_state()

    gf.validate_at_attach(tuner, "default", "raise")

    assert prompt.grad is None
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert {name: m.training for name, m in model.named_modules()} == modes
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert tuner.active_adapter == "default" and prompt.requires_grad


def test_attach_probe_runs_under_no_grad(make_base, make_peft):
    # Attaching inside `no_grad` (common in loading code) must still run a real backward: a healthy model passes,
    # and a cut graph is found for its own cause, not reported as "gradients disabled" nor skipped.
    with torch.no_grad():
        model = make_peft(validate_gradients="raise")
        assert not torch.is_grad_enabled()  # the probe put the caller's grad mode back
    assert _prompt(model).requires_grad and _prompt(model).grad is None

    base = make_base()
    _cut_block_input(base)
    with torch.no_grad(), pytest.raises(GradientFlowError) as err:
        make_peft(base=base, validate_gradients="raise")
    assert [f.code for f in err.value.findings] == ["unreachable"]


def test_attach_under_inference_mode_raises_grad_disabled(make_peft):
    # An inference-tensor prompt is never recorded by autograd: attaching it for training is refused.
    with torch.inference_mode(), pytest.raises(GradientFlowError, match="inference tensor") as err:
        make_peft(validate_gradients="raise")
    assert [f.code for f in err.value.findings] == ["grad_disabled"]


def test_attach_raise_warn_off_on_a_model_that_cuts_the_graph(make_base, make_peft):
    base = make_base()
    _cut_block_input(base)
    with pytest.raises(GradientFlowError) as err:
        make_peft(base=base, validate_gradients="raise")
    assert isinstance(err.value, RuntimeError)
    assert [f.code for f in err.value.findings] == ["unreachable"]
    assert "outputs carry no autograd graph at all" in str(err.value)  # the cut is before every output

    base = make_base()
    _cut_block_input(base)
    with pytest.warns(GradientFlowWarning, match=r"\[unreachable\]"):
        make_peft(base=base, validate_gradients="warn")

    base = make_base()
    _cut_block_input(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFlowWarning)
        make_peft(base=base, validate_gradients="off")


def _detach_last_row(module, args, kwargs):
    embeds = kwargs.get("inputs_embeds")  # [1, N, D] on the shared pass; the text comes as ids
    if embeds is None:
        return None
    return args, {**kwargs, "inputs_embeds": torch.cat([embeds[:, :-1], embeds[:, -1:].detach()], dim=1)}


def test_probe_checks_every_prompt_row(make_base, make_peft):
    # Shared-KV path: every prompt row reaches the loss through the shared pass. Cutting only the last row there
    # starves that one row, and the probe must name it.
    base = make_base()
    base.transformer.register_forward_pre_hook(_detach_last_row, with_kwargs=True)
    with pytest.raises(GradientFlowError, match=r"rows \[4\] of its 5 rows") as err:
        make_peft(base=base, num_virtual_tokens=5, forward_path="shared_kv")
    assert [f.code for f in err.value.findings] == ["zero_gradient"]


def _drop_the_kv_keyword(module, args, kwargs):
    return args, {k: v for k, v in kwargs.items() if k != "softprompt_plus_kv"}


def test_a_kv_prompt_the_attention_never_reads_is_named(make_peft):
    """A KV prompt has no embedding path: its only way in is the keyword each attention layer reads. A hook added
    after attach that drops it (here, on every block) leaves the outputs without a graph; the finding and its fix
    say so."""
    model = make_peft(prompt_level="kv")
    assert check_gradient_flow(model).ok
    for block in model.get_base_model().transformer.h:
        block.register_forward_pre_hook(_drop_the_kv_keyword, with_kwargs=True)
    report = check_gradient_flow(model)
    assert [f.code for f in report.findings] == ["unreachable"]
    assert "for a KV prompt, no attention layer reads the keys/values handed to it" in report.findings[0].message
    assert "`softprompt_plus_kv`" in report.findings[0].fix


def test_a_kv_prompt_is_judged_per_position():
    """Keys outside every query's sliding window (8) get no gradient; the probe names those positions."""
    from peft import get_peft_model

    from peft_softprompt_plus.apps.tiny import tiny_family

    config = SoftPromptPlusConfig(num_virtual_tokens=12, prompt_level="kv", kv_frozen_positions=0)
    with pytest.raises(GradientFlowError, match=r"exactly zero in positions \[0, 1, 2, 3, 4\] of its 12 positions"):
        get_peft_model(tiny_family("mistral", 300), config)


@pytest.mark.parametrize("reentrant", [True, False])
def test_probe_under_gradient_checkpointing_leaves_no_grad(make_base, make_peft, reentrant):
    # Reentrant checkpointing refuses `torch.autograd.grad`; the probe falls back to backward() and restores `.grad`.
    base = make_base()
    checkpointing_on(base, reentrant)
    model = make_peft(base=base, validate_gradients="raise")
    assert all(p.grad is None for p in model.parameters())
    prompt = _prompt(model)
    prompt.grad = marker = torch.full_like(prompt, 7.0)  # a gradient the user accumulated must survive the check
    report = check_gradient_flow(model, _batch())
    assert report.ok and report.grad_norms["default"] > 0
    assert prompt.grad is marker and torch.all(marker == 7.0)


def test_probe_covers_sequence_classification(make_peft):
    model = make_peft(task_type="SEQ_CLS", validate_gradients="raise")
    assert check_gradient_flow(model).ok  # the `score` copy in modules_to_save is allowed to train


def test_probe_on_an_inactive_added_adapter_restores_its_state(make_peft):
    model = make_peft()
    model.add_adapter("second", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=1))
    tuner, second = model.base_model, model.base_model.prompt("second")
    assert not second.requires_grad
    gf.validate_at_attach(tuner, "second", "raise")
    assert tuner.active_adapter == "default" and not second.requires_grad and second.grad is None


def test_add_adapter_runs_the_probe(make_peft):
    model = make_peft()
    _cut_block_input(model.base_model.model)
    with pytest.raises(GradientFlowError, match=r"\[unreachable\]"):
        model.add_adapter("second", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=1))


def test_from_pretrained_trainable_runs_the_probe(make_base, make_peft, tmp_path):
    make_peft().save_pretrained(tmp_path)
    base = make_base()
    handle = _cut_block_input(base)
    with pytest.raises(GradientFlowError, match=r"\[unreachable\]"):
        PeftModel.from_pretrained(base, tmp_path, is_trainable=True)
    PeftModel.from_pretrained(base, tmp_path, is_trainable=False)  # inference: nothing to prove
    handle.remove()


# ---------------------------------------------------------------------------------------------- check_gradient_flow


def test_check_ok_matches_a_manual_backward_and_leaves_no_trace(make_peft):
    model = make_peft()
    batch, prompt = _batch(), _prompt(model)
    model.eval()
    before, rng = _state(model), torch.get_rng_state()

    report = check_gradient_flow(model, batch, torch.optim.SGD(model.parameters(), lr=0.1))

    assert report.ok and report.findings == [] and "OK" in str(report)
    assert prompt.grad is None and not model.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, _state(model)[k]) for k, v in before.items())
    (reference,) = torch.autograd.grad(model(**batch).loss, [prompt])  # dropout is 0: train == eval numerically
    assert report.grad_norms["default"] == pytest.approx(float(reference.norm()), rel=1e-5)


def test_grad_disabled_under_no_grad_and_inference_mode(make_peft):
    model = make_peft()
    with torch.no_grad():
        report = check_gradient_flow(model, _batch())
    assert report.codes == ["grad_disabled"] and "torch.no_grad()" in report.findings[0].message
    with torch.inference_mode():
        report = check_gradient_flow(model, _batch())
    assert report.codes == ["grad_disabled"] and "inference_mode" in report.findings[0].message


def test_training_forward_without_grad_warns_once_and_check_keeps_that_warning(make_peft):
    model = make_peft()
    with torch.no_grad():
        check_gradient_flow(model, _batch())  # reports, but must not use up the one warning
    model.train()
    with torch.no_grad(), pytest.warns(GradientFlowWarning, match=r"\[grad_disabled\]") as record:
        model(**_batch())
    assert [w.filename for w in record if w.category is GradientFlowWarning] == [__file__]  # points at user code
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", GradientFlowWarning)
        model(**_batch())


def test_prompt_frozen(make_peft):
    model = make_peft()
    _prompt(model).requires_grad_(False)
    assert check_gradient_flow(model, _batch()).codes == ["prompt_frozen"]


def test_unreachable_names_an_ignored_prompt(make_base):
    class IgnoresEmbeds(nn.Module):  # a wrapper that drops `inputs_embeds` and re-embeds the ids
        def __init__(self):
            super().__init__()
            self.gpt2 = make_base()
            self.gpt2.requires_grad_(False)
            self.prompt = nn.Parameter(torch.randn(3, 64) * 0.02)

        def forward(self, input_ids, labels):
            embeds = torch.cat([self.prompt.expand(len(input_ids), -1, -1), self.gpt2.transformer.wte(input_ids)], 1)
            del embeds  # the bug: built, then never passed in
            return self.gpt2(input_ids=input_ids, labels=labels)

    model = IgnoresEmbeds()
    report = check_gradient_flow(
        model, {"input_ids": random_ids(1, 4), "labels": random_ids(1, 4)}, prompt=model.prompt
    )
    assert report.codes == ["unreachable"]
    assert "carry no autograd graph at all: the model never uses the prompt" in report.findings[0].message


@pytest.mark.parametrize(
    "loss_fn",
    [lambda o, b: o.loss.item(), lambda o, b: o.loss.detach(), lambda o, b: o.loss.detach().numpy()],
    ids=["item", "detach", "numpy"],
)
def test_loss_without_graph(make_peft, loss_fn):
    report = check_gradient_flow(make_peft(), _batch(), loss_fn=loss_fn)
    assert report.codes == ["loss_without_graph"]


def test_zero_gradient(make_peft):
    report = check_gradient_flow(make_peft(), _batch(), loss_fn=lambda o, b: o.loss * 0)
    assert report.codes == ["zero_gradient"] and "all its 5 rows" in report.findings[0].message


def test_nonfinite_gradient(make_peft):
    model = make_peft()
    with torch.no_grad():
        _prompt(model)[2, 7] = float("nan")
    report = check_gradient_flow(model, _batch())
    assert report.codes == ["nonfinite_gradient"] and "1 NaN/inf value(s)" in report.findings[0].message


def test_not_in_optimizer_also_spots_a_stale_optimizer(make_peft):
    model = make_peft()
    report = check_gradient_flow(model, _batch(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    assert report.codes == ["not_in_optimizer"]
    stale = torch.optim.SGD([nn.Parameter(_prompt(model).detach().clone())], lr=0.1)  # same shape, other object
    report = check_gradient_flow(model, _batch(), stale)
    assert report.codes == ["not_in_optimizer"] and "built before the prompt was replaced" in str(report)


def test_aliases_base_weights_names_the_tied_pair(make_peft):
    model = make_peft()
    _prompt(model).data = model.base_model.model.transformer.wte.weight.data[:5]  # no clone: a view of wte
    report = check_gradient_flow(model, _batch())
    assert report.codes == ["aliases_base_weights"]
    assert "transformer.wte.weight" in str(report) and "lm_head.weight" in str(report)


def test_low_precision_prompt(make_peft):
    model = make_peft()
    _prompt(model).data = _prompt(model).data.half()
    assert check_gradient_flow(model, _batch()).codes == ["low_precision_prompt"]


def test_base_trainable_names_the_tied_pair(make_peft):
    model = make_peft()
    model.base_model.model.lm_head.weight.requires_grad_(True)  # the same Parameter as wte
    report = check_gradient_flow(model, _batch())
    assert report.codes == ["base_trainable"] and "tied to" in str(report)


def test_non_leaf_prompt_in_a_custom_module(make_base):
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = make_base()
            self.gpt2.requires_grad_(False)
            self.prompt = nn.Parameter(torch.randn(3, 64, dtype=torch.float64) * 0.02).to(torch.float32)  # the bug

        def forward(self, input_ids, labels):
            text = self.gpt2.transformer.wte(input_ids)  # [B, L, D]
            embeds = torch.cat([self.prompt.expand(len(input_ids), -1, -1), text], dim=1)  # [B, 3+L, D]
            return self.gpt2(inputs_embeds=embeds, labels=torch.cat([torch.full((len(labels), 3), -100), labels], 1))

    model = Custom()
    ids = random_ids(2, 4)
    assert not [p for p in model.parameters() if p.requires_grad]  # so an optimizer can't even be built
    report = check_gradient_flow(model, {"input_ids": ids, "labels": ids}, prompt=model.prompt)
    assert report.codes == ["non_leaf_prompt"]
    assert report.grad_norms["prompt"] > 0  # the gradient is computed, only never stored on a tensor the user holds


def test_independent_checks_report_every_cause_at_once(make_peft):
    model = make_peft()
    prompt = _prompt(model)
    prompt.data = prompt.data.half()
    prompt.requires_grad_(False)
    model.base_model.model.transformer.wpe.weight.requires_grad_(True)
    report = check_gradient_flow(model, _batch(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    assert report.codes == ["prompt_frozen", "not_in_optimizer", "low_precision_prompt", "base_trainable"]
    with pytest.raises(GradientFlowError) as err:
        report.raise_if_failed()
    assert [f.code for f in err.value.findings] == report.codes
    assert pickle.loads(pickle.dumps(err.value)).findings == err.value.findings  # e.g. raised in a DDP worker


def test_report_str_lists_code_message_and_fix(make_peft):
    model = make_peft()
    _prompt(model).requires_grad_(False)
    text = str(check_gradient_flow(model, _batch()))
    assert "1 problem(s)" in text and "[prompt_frozen]" in text and "Fix: " in text


def test_every_code_has_a_fix_and_runs_on_clean_evidence(make_peft):
    # One table holds each check with its fix; on a healthy model no check finds anything.
    from peft_softprompt_plus.gradients.causes import CHECKS

    assert [c.code for c in CHECKS] == list(FINDING_CODES) and len(set(FINDING_CODES)) == len(CHECKS)
    assert all(c.fix.strip() and c.fix[0].isupper() for c in CHECKS)
    assert check_gradient_flow(make_peft(), _batch()).ok


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors(make_peft):
    model = make_peft()
    ids = random_ids(2, 4)
    with pytest.raises(ValueError, match=r"`batch` must contain `input_ids`.*got keys \['labels'\]"):
        check_gradient_flow(model, {"labels": ids})
    with pytest.raises(ValueError, match=r"returned no loss .*add `labels`"):
        check_gradient_flow(model, {"input_ids": ids})
    with pytest.raises(ValueError, match=r"`batch` \(\['input_ids', 'labels'\]\) could not be run through the model"):
        check_gradient_flow(model, {"input_ids": ids.float(), "labels": ids})  # float ids
    with pytest.raises(
        ValueError, match=r"could not be run through the model: TypeError: `input_ids` must be a torch.Tensor"
    ):
        check_gradient_flow(model, {"input_ids": ids.tolist(), "labels": ids})  # lists, not tensors
    with pytest.raises(TypeError, match=r"`batch` must be a dict"):
        check_gradient_flow(model, "the quick brown fox")
    with pytest.raises(TypeError, match=r"`optimizer` must be a torch.optim.Optimizer .*got generator"):
        check_gradient_flow(model, _batch(), model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(TypeError, match=r"Pass `scheduler.optimizer`"):
        check_gradient_flow(model, _batch(), scheduler)
    with pytest.raises(ValueError, match=r"`loss_fn\(outputs, batch\)` must be a scalar loss, got shape \[2, 6\]"):
        check_gradient_flow(model, _batch(), loss_fn=lambda o, b: o.logits.sum(-1))
    with pytest.raises(TypeError, match=r"`loss_fn\(outputs, batch\)` must be a scalar loss tensor, got NoneType"):
        check_gradient_flow(model, _batch(), loss_fn=lambda o, b: None)
    with pytest.raises(TypeError, match=r"`loss_fn` must be callable"):
        check_gradient_flow(model, _batch(), loss_fn="cross_entropy")
    with pytest.raises(TypeError, match=r"`model` must be a torch.nn.Module"):
        check_gradient_flow(_batch())
    with pytest.raises(ValueError, match=r"has no active softprompt-plus prompt.*pass `prompt=`"):
        check_gradient_flow(nn.Linear(2, 2), torch.zeros(1, 2))
    with pytest.raises(TypeError, match=r"`prompt` must be a tensor"):
        check_gradient_flow(nn.Linear(2, 2), torch.zeros(1, 2), prompt=[1.0])
    with pytest.raises(ValueError, match=r"`batch` is required"):
        check_gradient_flow(nn.Linear(2, 2), prompt=torch.zeros(2))


# ---------------------------------------------------------------------------------------------- Trainer callback


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count=4, length=6):
        self.ids = random_ids(count, length)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def _train(model, tmp_path, callback, optimizer=None, learning_rate=1e-2):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=learning_rate,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[callback], optimizers=(optimizer, None)).train()


def test_callback_passes_a_healthy_run(make_peft, tmp_path):
    model = make_peft()
    start = _prompt(model).detach().clone()
    callback = GradientFlowCallback()
    _train(model, tmp_path, callback)
    assert callback.report is not None and callback.report.ok
    assert not torch.equal(start, _prompt(model).detach())


def test_callback_raises_when_the_optimizer_misses_the_prompt(make_peft, tmp_path):
    model = make_peft()
    optimizer = torch.optim.SGD([model.base_model.model.transformer.wpe.weight], lr=0.1)  # frozen, not the prompt
    with pytest.raises(GradientFlowError, match=r"\[not_in_optimizer\]"):
        _train(model, tmp_path, GradientFlowCallback(on_failure="raise"), optimizer=optimizer)


def test_callback_warns_when_the_step_changes_nothing(make_peft, tmp_path):
    callback = GradientFlowCallback(on_failure="warn")
    with pytest.warns(GradientFlowWarning, match=r"\[prompt_unchanged\].*lr=\[0\.0\]"):
        _train(make_peft(), tmp_path, callback, learning_rate=0.0)
    assert callback.report.codes == ["prompt_unchanged"]


def test_callback_bad_config():
    with pytest.raises(ValueError, match=r"`on_failure` must be one of \['raise', 'warn'\], got 'ignore'"):
        GradientFlowCallback(on_failure="ignore")
    with pytest.raises(ValueError, match="no active softprompt-plus prompt"):
        GradientFlowCallback().on_train_begin(None, None, None, model=nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------- the doc


def test_doc_names_real_tests_and_every_code():
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "gradient-flow.md").read_text()
    cited = re.findall(r"tests/((?:\w+/)?test_\w+\.py)::(test_\w+)", doc)
    assert len(cited) >= 15
    for path, name in cited:
        assert re.search(rf"^def {name}\(", (root / "tests" / path).read_text(), re.M), f"{path}::{name} is missing"
    for code in FINDING_CODES:
        assert f"`{code}`" in doc
