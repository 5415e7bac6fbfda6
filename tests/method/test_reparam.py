"""Residual reparameterisation (reparam.py, and its files in saving.py / loading.py): the model reads the encoder's
output while training, the probe covers the encoder, `save_pretrained` writes the folded table as a plain adapter
(the encoder beside it), a folded load computes the same logits with no encoder, and a Trainer resume is
bit-identical."""

import json
import logging
import os

import pytest
import torch
from conftest import random_ids
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from test_families import reference_logits
from transformers import Trainer

from peft_softprompt_plus import SoftPromptPlusConfig, check_gradient_flow
from peft_softprompt_plus._names import ENCODER_FILE, RAW_KEY, SAVED_KEY
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_family, tiny_gpt2

N = 5


def residual(base=None, **config):
    config = {
        "num_virtual_tokens": N,
        "init_seed": 0,
        "reparameterization": "residual",
        "residual_hidden": 16,
        **config,
    }
    return get_peft_model(
        base if base is not None else tiny_gpt2(), SoftPromptPlusConfig(task_type="CAUSAL_LM", **config)
    )


def folded(model, name="default"):
    bank = model.base_model.prompt_bank
    with torch.no_grad():
        return bank.encoders[name](bank.prompts[name]).clone()


def left_padded_batch(vocab=300):
    ids = random_ids(3, 9, vocab=vocab)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return ids, mask


def test_the_encoder_starts_on_the_embeddings_scale_and_stays_float32():
    model = residual(residual_hidden=32)
    bank = model.base_model.prompt_bank
    encoder, raw = bank.encoders["default"], bank.prompts["default"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "base_model.prompt_bank.softprompt_plus_prompt.default",
        *(
            f"base_model.prompt_bank.softprompt_plus_encoder.default.{k}"
            for k in ("down.weight", "down.bias", "up.weight", "up.bias", "norm.weight", "norm.bias")
        ),
    ]
    wte = model.get_base_model().get_input_embeddings().weight
    branch = folded(model) - raw.detach()
    assert 0.5 < branch.std().item() / wte.std().item() < 2.0  # not a unit-variance LayerNorm swamping the prompt
    model.half()
    assert raw.dtype == torch.float32 and all(p.dtype == torch.float32 for p in encoder.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_reads_the_encoded_prompt(family):
    model = residual(tiny_family(family, vocab_size=300))
    ids, mask = left_padded_batch()
    out = model(input_ids=ids, attention_mask=mask).logits
    ref = reference_logits(model.get_base_model(), folded(model), ids, mask)  # each row as if alone
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-4, rtol=1e-4)


def test_the_probe_and_check_gradient_flow_cover_the_encoder():
    model = residual()  # get_peft_model ran the attach-time probe (validate_gradients='raise')
    report = check_gradient_flow(model)
    assert report.ok, str(report)
    assert set(report.grad_norms) == {
        "default",
        *(
            f"default.encoder.{k}"
            for k in ("down.weight", "down.bias", "up.weight", "up.bias", "norm.weight", "norm.bias")
        ),
    }
    assert all(g > 0 for g in report.grad_norms.values())
    model.base_model.prompt_bank.encoders["default"].up.weight.requires_grad_(False)
    report = check_gradient_flow(model)
    assert "prompt_frozen" in report.codes and "default.encoder.up.weight" in str(report)


def test_save_writes_the_folded_table_as_the_adapter_and_a_folded_load_gives_the_same_logits(tmp_path):
    model = residual()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids, mask = left_padded_batch()
    for _ in range(3):
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path / "a")

    weights = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert set(weights) == {SAVED_KEY} and torch.equal(weights[SAVED_KEY], folded(model))
    beside = load_file(tmp_path / "a" / ENCODER_FILE)
    assert torch.equal(beside[RAW_KEY], model.base_model.prompt("default").detach())
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["reparameterization"] == "residual"

    loaded = PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "a")  # inference: a plain prompt, no encoder
    assert len(loaded.base_model.prompt_bank.encoders) == 0
    assert torch.equal(loaded.base_model.prompt("default").detach(), folded(model))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-6, rtol=0)


def test_a_trainable_load_restores_the_raw_prompt_and_the_encoder_exactly(tmp_path):
    model = residual(init_seed=3)
    model.save_pretrained(tmp_path / "a")
    again = PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "a", is_trainable=True)
    bank, source = again.base_model.prompt_bank, model.base_model.prompt_bank
    assert torch.equal(bank.prompts["default"], source.prompts["default"])
    for (k, v), (k2, v2) in zip(
        bank.encoders["default"].state_dict().items(), source.encoders["default"].state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2)
    assert all(p.requires_grad for p in bank.trainable("default").values())


def test_without_the_encoder_file_a_trainable_load_trains_the_folded_table_plainly(tmp_path, caplog):
    model = residual()
    model.save_pretrained(tmp_path / "a")
    os.remove(tmp_path / "a" / ENCODER_FILE)
    with caplog.at_level(logging.WARNING):
        again = PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "a", is_trainable=True)
    assert f"has no {ENCODER_FILE}" in caplog.text
    assert len(again.base_model.prompt_bank.encoders) == 0
    assert torch.equal(again.base_model.prompt("default").detach(), folded(model))
    assert again.base_model.prompt("default").requires_grad


def test_a_mismatched_encoder_file_is_named(tmp_path):
    from peft_softprompt_plus import AdapterFileError

    residual(residual_hidden=16).save_pretrained(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["residual_hidden"] = 8
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterFileError, match=rf"{ENCODER_FILE}' does not fit adapter 'default'"):
        PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "a", is_trainable=True)


def test_mixed_batches_route_rows_to_a_residual_and_a_plain_adapter():
    model = residual()
    model.add_adapter("plain", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=1))
    ids, mask = left_padded_batch()
    names = ["default", "plain", "default"]
    with torch.no_grad():
        mixed = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        for row, name in enumerate(names):
            model.set_adapter(name)
            alone = model(input_ids=ids[row : row + 1], attention_mask=mask[row : row + 1]).logits
            real = mask[row].bool()
            torch.testing.assert_close(mixed[row][real], alone[0][real], atol=1e-5, rtol=1e-5)


def test_trainer_resume_of_a_residual_adapter_is_bit_identical(tmp_path, tokenizer):
    from test_trainer import args, lm_dataset

    data = lm_dataset(tokenizer)
    common = dict(max_steps=4, save_steps=2, learning_rate=1e-2, seed=7, data_seed=7)
    straight = residual()
    Trainer(model=straight, args=args(tmp_path / "straight", **common), train_dataset=data).train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    assert (checkpoint / ENCODER_FILE).is_file()

    resumed = residual(init_seed=123)
    second = Trainer(model=resumed, args=args(tmp_path / "resumed", **common), train_dataset=data)
    second.train(resume_from_checkpoint=str(checkpoint))
    assert second.state.global_step == 4
    after, before = resumed.base_model.prompt_bank, straight.base_model.prompt_bank
    for name, tensor in before.trainable("default").items():
        assert torch.equal(after.trainable("default")[name], tensor), name
    at_two = load_file(checkpoint / ENCODER_FILE)[RAW_KEY]
    assert not torch.equal(at_two, before.prompts["default"].detach())  # steps 3 and 4 ran after the resume


def test_init_seed_draws_the_encoder_too_and_leaves_the_callers_generator_alone():
    base = tiny_gpt2()  # seeds the global generator itself
    torch.manual_seed(5)
    expected_next = torch.rand(3)
    torch.manual_seed(5)
    first = residual(base, init_seed=11).base_model.prompt_bank.encoders["default"].state_dict()
    assert torch.equal(torch.rand(3), expected_next)  # the caller's stream is where it was
    second = residual(init_seed=11).base_model.prompt_bank.encoders["default"].state_dict()
    other = residual(init_seed=12).base_model.prompt_bank.encoders["default"].state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["down.weight"], other["down.weight"])
