"""Context tuning's per-row masks over a KV prompt's positions while training (forward/kv_regularize.py). The
reference for leave-one-out: the same forward through a KV prompt with that demonstration's positions removed (the
kept keys/values as they are, the same text start). Invariants: a masked position gets no gradient from its row;
eval and `generate` read every position; dropout repeats under a seed and never drops a frozen position; a
checkpointed forward reads the same mask."""

import pytest
import torch
from _versions import checkpointing_on
from peft import get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig, check_gradient_flow
from peft_softprompt_plus.apps.tiny import tiny_family
from peft_softprompt_plus.distill import kv_start
from peft_softprompt_plus.forward import kv_regularize

DEMOS = ["red green blue", "cat dog bird fish", "one two three"]


@pytest.fixture
def tok_dir(tiny_model_dir):  # conftest's tiny model folder holds the tiny tokenizer
    return tiny_model_dir


@pytest.fixture
def tok(tokenizer):
    return tokenizer


def _demo_config(tok_dir, **kw):
    return SoftPromptPlusConfig(
        prompt_level="kv", prompt_init="demonstrations", prompt_init_texts=DEMOS, num_virtual_tokens=None,
        tokenizer_name_or_path=tok_dir, validate_gradients="off", **kw,
    )  # fmt: skip


def _model(tok, tok_dir, removed=True, **kw):
    """Adapter "demo" (demonstrations), "input" (an input prompt), and "removed_i": demo without demonstration i's
    positions, its text at the same start."""
    model = get_peft_model(tiny_family("llama", len(tok)), _demo_config(tok_dir, **kw), adapter_name="demo")
    model.add_adapter("input", SoftPromptPlusConfig(num_virtual_tokens=3, init_seed=1, validate_gradients="off"))
    config, values = model.peft_config["demo"], model.base_model.prompt("demo").detach()
    for i, (start, end) in enumerate(config.demonstration_spans if removed else []):
        kept = [j for j in range(config.num_virtual_tokens) if not start <= j < end]
        name = f"removed_{i}"
        model.add_adapter(name, SoftPromptPlusConfig(
            prompt_level="kv", num_virtual_tokens=len(kept), kv_text_start=config.kv_text_start, init_seed=0,
            validate_gradients="off",
        ))  # fmt: skip
        kv_start.install(model, name, values[..., kept, :])
        model.base_model.prompt(name).requires_grad_(True)  # a reference whose gradient is compared
    return model


def _row(tok, i):
    return tok(DEMOS[i], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_a_demonstration_row_reads_the_prompt_without_its_own_positions(tok, tok_dir, checkpointing):
    """Rows: demonstration 1 (left-padded), a plain row, an input-prompt row and a base row in one batch."""
    model = _model(tok, tok_dir)
    if checkpointing:
        checkpointing_on(model.get_base_model(), reentrant=checkpointing == "reentrant")
    model.train()
    demo, other = _row(tok, 1), tok("white black horse sheep", add_special_tokens=False)["input_ids"]
    width = max(len(demo), len(other))
    ids = torch.tensor([[0] * (width - len(demo)) + demo, other, other, other])
    mask = (torch.arange(width) >= torch.tensor([width - len(demo), 0, 0, 0])[:, None]).long()
    names = ["demo", "demo", "input", "__base__"]
    out = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    out[0, mask[0].bool()].sum().backward()
    grad = model.base_model.prompt("demo").grad.clone()
    model.zero_grad()
    ref = model(input_ids=ids[:1], attention_mask=mask[:1], adapter_names=["removed_1"]).logits
    ref[0, mask[0].bool()].sum().backward()
    torch.testing.assert_close(out[0, mask[0].bool()], ref[0, mask[0].bool()], atol=1e-5, rtol=1e-5)
    start, end = model.peft_config["demo"].demonstration_spans[1]
    kept = [j for j in range(grad.shape[-2]) if not start <= j < end]
    torch.testing.assert_close(grad[..., kept, :], model.base_model.prompt("removed_1").grad, atol=1e-5, rtol=1e-4)
    assert grad[..., start:end, :].abs().max() == 0  # the masked positions get nothing from that row
    with torch.no_grad():  # the plain row reads every position, as in eval
        model.eval()
        every = model(input_ids=ids[1:2], adapter_names=["demo"]).logits
    torch.testing.assert_close(out[1], every[0], atol=1e-5, rtol=1e-5)


def test_eval_and_generate_read_every_position(tok, tok_dir):
    model = _model(tok, tok_dir).eval()
    ids = torch.tensor([_row(tok, 0)])
    with torch.no_grad():
        masked_in_training = model(input_ids=ids, adapter_names=["removed_0"]).logits
        got = model(input_ids=ids, adapter_names=["demo"]).logits
    assert not torch.allclose(got, masked_in_training, atol=1e-4)  # the row reads its own demonstration in eval
    model.train()
    with torch.no_grad():  # gradients off: not a training step either
        torch.testing.assert_close(model(input_ids=ids, adapter_names=["demo"]).logits, got)
    model.eval()
    want = model.generate(input_ids=ids, adapter_names=["demo"], max_new_tokens=3, do_sample=False, pad_token_id=1)
    model.train()
    again = model.generate(input_ids=ids, adapter_names=["demo"], max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert torch.equal(want, again)


def test_a_demonstration_index_column_names_the_row_and_is_checked(tok, tok_dir):
    model = _model(tok, tok_dir).train()
    other = torch.tensor([tok("white black horse", add_special_tokens=False)["input_ids"]])
    named = model(input_ids=other, adapter_names=["demo"], demonstration_index=torch.tensor([2])).logits
    ref = model(input_ids=other, adapter_names=["removed_2"]).logits
    torch.testing.assert_close(named, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"`demonstration_index`\[0\]=3 is out of range for adapter 'demo', which"):
        model(input_ids=other, adapter_names=["demo"], demonstration_index=torch.tensor([3]))
    with pytest.raises(ValueError, match=r"`demonstration_index` must hold one int per row \(1"):
        model(input_ids=other, demonstration_index=torch.tensor([0.5]))


def _keeps(model, monkeypatch):
    seen, real = [], kv_regularize.row_keep

    def spy(*args, **kwargs):
        keep = real(*args, **kwargs)
        seen.append(keep)
        return keep

    monkeypatch.setattr(kv_regularize, "row_keep", spy)
    return seen


def test_dropout_repeats_under_a_seed_spares_frozen_positions_and_is_off_in_eval(tok, tok_dir, monkeypatch):
    model = _model(tok, tok_dir, False, kv_position_dropout=0.5, kv_frozen_positions=2, kv_leave_one_out=False)
    seen = _keeps(model, monkeypatch)
    ids = torch.tensor([tok("white black horse", add_special_tokens=False)["input_ids"]] * 8)
    model.train()
    torch.manual_seed(0)
    first = model(input_ids=ids, adapter_names=["demo"] * 8).logits
    torch.manual_seed(0)
    second = model(input_ids=ids, adapter_names=["demo"] * 8).logits
    assert torch.equal(first, second) and torch.equal(seen[0], seen[1])
    keep = seen[0]
    assert keep[:, :2].all() and not keep[:, 2:].all() and keep[:, 2:].any()  # frozen kept; about half dropped
    assert not torch.equal(keep[0], keep[1]) or not torch.equal(keep[1], keep[2])  # per row
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, adapter_names=["demo"] * 8)
    assert seen[-1] is None


def test_checkpointing_reads_the_same_dropout_mask(tok, tok_dir, monkeypatch):
    grads, seen = [], _keeps(None, monkeypatch)
    for checkpointing, dropout in ((False, 0.3), (True, 0.3), (False, 0.0)):
        model = _model(tok, tok_dir, False, kv_position_dropout=dropout, kv_leave_one_out=False)
        if checkpointing:
            checkpointing_on(model.get_base_model(), reentrant=False)
        model.train()
        ids = torch.tensor([_row(tok, 0), tok("white black horse", add_special_tokens=False)["input_ids"][:3]])
        torch.manual_seed(5)
        model(input_ids=ids, adapter_names=["demo", "demo"]).logits.square().mean().backward()
        grads.append(model.base_model.prompt("demo").grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
    dropped = [keep for keep in seen if keep is not None]
    assert dropped and all(torch.equal(keep, dropped[0]) for keep in dropped)  # one mask, read again on recompute
    assert not dropped[0].all()  # positions were dropped: the equality above is not dropout doing nothing
    assert not torch.allclose(grads[0], grads[2])  # and the gradient shows it, against no dropout


def test_the_trainer_hands_a_collator_s_demonstration_index_to_the_forward(tok, tok_dir, tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    model = _model(tok, tok_dir, False)
    seen = []
    real = kv_regularize.row_keep

    keeps = []

    def spy(tuner, route, input_ids, attention_mask, demonstration_index, width, batch):
        seen.append(demonstration_index)
        keeps.append(real(tuner, route, input_ids, attention_mask, demonstration_index, width, batch))
        return keeps[-1]

    monkeypatch.setattr(kv_regularize, "row_keep", spy)
    rows = [{"input_ids": _row(tok, i)[:3], "index": i} for i in range(3)]

    def collate(features):
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": ids, "demonstration_index": torch.tensor([f["index"] for f in features])}

    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=3, max_steps=1, report_to=[], use_cpu=True,
        remove_unused_columns=False, save_strategy="no",
    )  # fmt: skip
    start = model.base_model.prompt("demo").detach().clone()
    Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
    (order,) = [t.tolist() for t in seen if t is not None]
    assert sorted(order) == [0, 1, 2]  # the batch, shuffled
    (keep,) = [k for k in keeps if k is not None]
    spans = model.peft_config["demo"].demonstration_spans
    for row, i in enumerate(order):  # each row reads every position but its own demonstration's
        wanted = torch.ones(keep.shape[1], dtype=torch.bool)
        wanted[spans[i][0] : spans[i][1]] = False
        assert torch.equal(keep[row].cpu(), wanted), (row, i)
    assert not torch.equal(model.base_model.prompt("demo").detach(), start)  # the step reached the prompt


def test_the_attach_probe_reads_every_position_despite_dropout(tok, tok_dir):
    """The probe asks whether the gradient can reach each position; a dropped one would read as a dead position."""
    config = SoftPromptPlusConfig(
        prompt_level="kv", prompt_init="demonstrations", prompt_init_texts=DEMOS, num_virtual_tokens=None,
        tokenizer_name_or_path=tok_dir, kv_position_dropout=0.9,
    )  # fmt: skip
    model = get_peft_model(tiny_family("llama", len(tok)), config)  # validate_gradients="raise"
    report = check_gradient_flow(model)
    assert report.ok, report
