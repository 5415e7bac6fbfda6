"""Adapters and the base model (tuner.py, prompt_bank.py, tying.py): exact base outputs, untouched weights, ties."""

import pytest
import torch
from conftest import prompt_tuning_reference, random_ids
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from peft_softprompt_plus import GradientFlowError, SoftPromptPlusConfig
from peft_softprompt_plus.forward.attention import is_installed


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def train_steps(model, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = random_ids(2, 6)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_one_trainable_float32_tensor_not_aliasing_the_base(make_base, make_peft):
    model = make_peft()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n, _ in trainable] == ["base_model.prompt_bank.softprompt_plus_prompt.default"]
    prompt = trainable[0][1]
    assert prompt.dtype == torch.float32 and prompt.is_leaf and prompt.shape == (5, 64)
    base_ptrs = {p.untyped_storage().data_ptr() for p in model.base_model.model.parameters()}
    assert prompt.untyped_storage().data_ptr() not in base_ptrs


def test_training_leaves_base_bit_identical_and_tie_intact(make_base, make_peft):
    base = make_base()
    before = snapshot(base)
    wte = base.transformer.wte.weight
    model = train_steps(make_peft(base=base, prompt_init="vocab"), steps=5)
    after = snapshot(model.base_model.model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert base.lm_head.weight is base.transformer.wte.weight is wte  # still one Parameter
    assert not wte.requires_grad


def test_prompt_stays_float32_through_half_and_to(make_peft):
    model = make_peft()
    prompt = model.base_model.prompt("default")
    model.half()
    assert model.base_model.model.transformer.wte.weight.dtype == torch.float16
    assert prompt.dtype == torch.float32 and model.base_model.prompt("default") is prompt
    model.to(torch.bfloat16)
    assert prompt.dtype == torch.float32


def test_disable_adapter_gives_base_outputs_exactly(make_base, make_peft):
    model = make_peft(base=make_base(seed=1))
    reference = make_base(seed=1)
    ids = random_ids(2, 6)
    with model.disable_adapter():
        disabled = model(input_ids=ids).logits
        gen = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(disabled, reference(input_ids=ids).logits)
    assert torch.equal(gen, reference.generate(input_ids=ids, max_new_tokens=4, do_sample=False))
    assert not torch.equal(model(input_ids=ids).logits[:, :1], disabled[:, :1])  # enabled again afterwards
    assert model.base_model.prompt("default").requires_grad


def test_add_set_delete_adapters(make_peft):
    model = make_peft()
    model.add_adapter("other", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=1))
    bank = model.base_model.prompt_bank
    assert set(bank.prompts) == {"default", "other"}
    assert bank.prompts["default"].requires_grad and not bank.prompts["other"].requires_grad
    ids = random_ids(1, 4)
    default_logits = model(input_ids=ids).logits
    model.set_adapter("other")
    assert bank.prompts["other"].requires_grad and not bank.prompts["default"].requires_grad
    assert not torch.allclose(model(input_ids=ids).logits, default_logits)
    model.set_adapter("default")
    torch.testing.assert_close(model(input_ids=ids).logits, default_logits)
    model.delete_adapter("other")
    assert set(bank.prompts) == {"default"} and list(model.peft_config) == ["default"]
    with pytest.raises(ValueError, match="already exists"):
        model.add_adapter("default", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))


def test_unload_returns_the_untouched_base(make_base, make_peft):
    base = make_base()
    flags = {n: p.requires_grad for n, p in base.named_parameters()}
    before = snapshot(base)
    model = train_steps(make_peft(base=base))
    unloaded = model.unload()
    assert unloaded is base
    assert {n: p.requires_grad for n, p in unloaded.named_parameters()} == flags
    assert all(torch.equal(before[k], v) for k, v in snapshot(unloaded).items())
    assert not hasattr(unloaded, "peft_config")


def test_merge_and_unload_is_refused(make_peft):
    with pytest.raises(ValueError, match="cannot be merged"):
        make_peft().merge_and_unload()


@pytest.mark.parametrize("module", ["lm_head", "wte", "transformer.wte"])
def test_training_a_tied_weight_is_refused(make_base, module):
    base = make_base()
    with pytest.raises(ValueError, match=r"tied to.*training one trains the\s+other"):
        get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", modules_to_save=[module]))
    assert not any(hasattr(m, "modules_to_save") for m in base.modules())  # nothing half-attached


def test_untied_module_to_save_trains_and_is_saved(make_base, tmp_path):
    model = get_peft_model(make_base(), SoftPromptPlusConfig(task_type="CAUSAL_LM", modules_to_save=["ln_f"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.prompt_bank.softprompt_plus_prompt.default" in trainable
    assert any("ln_f.modules_to_save.default" in n for n in trainable)

    head = model.base_model.model.transformer.ln_f
    original = head.original_module.weight.detach().clone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = random_ids(2, 6)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    trained = head.modules_to_save["default"].weight.detach().clone()
    assert not torch.equal(trained, original)  # the copy trained ...
    assert torch.equal(head.original_module.weight, original)  # ... and the base's own ln_f did not

    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert any(k.endswith("ln_f.weight") for k in saved), sorted(saved)
    loaded = PeftModel.from_pretrained(make_base(), tmp_path)
    torch.testing.assert_close(loaded.base_model.model.transformer.ln_f.modules_to_save["default"].weight, trained)
    torch.testing.assert_close(loaded.base_model.prompt("default"), model.base_model.prompt("default"))


def test_wrong_task_for_model_is_refused(make_base):
    with pytest.raises(ValueError, match=r"`task_type`='SEQ_CLS' needs a model with `.score`"):
        get_peft_model(make_base(), SoftPromptPlusConfig(task_type="SEQ_CLS"))


def test_failed_attach_leaves_the_base_as_it_came(make_base):
    base = make_base()
    base.transformer.ln_f.register_forward_hook(lambda module, args, out: out.detach())  # cuts every gradient
    flags = {n: p.requires_grad for n, p in base.named_parameters()}
    with pytest.raises(GradientFlowError):
        get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM"))
    assert {n: p.requires_grad for n, p in base.named_parameters()} == flags


def test_deleting_the_last_adapter_leaves_the_base_model_as_peft_does(make_base, make_peft, tmp_path):
    base, reference = make_base(seed=1), make_base(seed=1)
    own_attention, own_loss_type = base.config._attn_implementation, base.loss_type
    model = make_peft(base=base)
    ids, mask = random_ids(2, 6), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # stores a prompt pass
    assert is_installed(base.config) and model.base_model.forward_state.kv_store._entries
    attached_loss_type = base.loss_type  # GPT-2 has none; attached, it names the prompted loss
    assert attached_loss_type != own_loss_type

    model.delete_adapter("default")
    assert model.active_adapters == [] and list(model.peft_config) == [] and not model.base_model.prompt_bank.prompts
    assert (base.config._attn_implementation, base.loss_type) == (own_attention, own_loss_type)
    assert model.base_model.forward_state.kv_store._entries == {}
    with torch.no_grad():
        assert torch.equal(
            model.base_model(input_ids=ids, attention_mask=mask).logits,
            reference(input_ids=ids, attention_mask=mask).logits,
        )
    greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert torch.equal(model.base_model.generate(**greedy), reference.generate(**greedy))

    # The PeftModel's own forward and save need an active adapter, in PEFT, for LoRA as for us: the same error.
    lora = get_peft_model(make_base(), LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True))
    lora.delete_adapter("default")
    for call in (lambda m: m(input_ids=ids), lambda m: m.save_pretrained(tmp_path / type(m.base_model).__name__)):
        with pytest.raises(KeyError) as ours:
            call(model)
        with pytest.raises(KeyError) as theirs:
            call(lora)
        assert str(ours.value) == str(theirs.value) == "'default'"
    # PEFT leaves LoRA's target folder empty; ours writes nothing at all, not even a staging folder.
    assert [p.name for p in tmp_path.iterdir()] == ["LoraModel"]

    # A new adapter brings the prompt back: our attention again, and PEFT prompt tuning's logits.
    model.add_adapter("again", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=2))
    model.set_adapter("again")
    assert is_installed(base.config) and base.loss_type == attached_loss_type
    expected = prompt_tuning_reference(make_base(seed=1), model.base_model.prompt("again").detach())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected(input_ids=ids).logits[:, 3:])
    assert model.unload() is base
    assert (base.config._attn_implementation, base.loss_type) == (own_attention, own_loss_type)


def test_an_adapter_added_after_the_last_was_deleted_is_probed(make_base, make_peft):
    base = make_base()
    model = make_peft(base=base)
    model.delete_adapter("default")
    flags = {n: p.requires_grad for n, p in base.named_parameters()}
    base.transformer.ln_f.register_forward_hook(lambda module, args, out: out.detach())  # cuts every gradient
    with pytest.raises(GradientFlowError):
        model.add_adapter("again", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    assert not model.base_model.prompt_bank.prompts and not is_installed(base.config)
    assert {n: p.requires_grad for n, p in base.named_parameters()} == flags  # still frozen, as before the add


@pytest.mark.parametrize("method", ["delete_adapter", "set_adapter"])
def test_unknown_adapter_messages_start_with_peft_s_own(make_base, make_peft, method):
    lora = get_peft_model(make_base(), LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.raises(ValueError) as theirs:
        getattr(lora, method)("unknown-adapter")
    with pytest.raises(ValueError) as ours:
        getattr(make_peft(), method)("unknown-adapter")
    assert str(ours.value).startswith(str(theirs.value).rstrip("."))  # PEFT's tests match on its sentence
    assert "adapters: ['default']" in str(ours.value)


def test_the_0_1_accessor_still_reaches_the_prompt_with_a_future_warning_at_the_user_s_line(make_peft, tmp_path):
    model = make_peft()
    model.add_adapter("other", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=1))
    keys, params = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    with pytest.warns(FutureWarning, match=r"removed in 0\.4\.0; use `model\.base_model\.prompt\(name\)`") as w:
        legacy = model.base_model.softprompt_plus.prompt
    assert w[0].filename == __file__  # points at the caller's line
    assert legacy is model.base_model.prompt_bank.prompts
    assert [legacy[n] is model.base_model.prompt(n) for n in ("default", "other")] == [True, True]
    with pytest.warns(FutureWarning) as w:
        assert model.softprompt_plus.prompt["default"] is legacy["default"]  # through PEFT's attribute forwarding
    assert w[0].filename == __file__
    # Nothing new is registered: state dict, parameters, modules and the saved file are as before.
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == params
    assert [n for n, _ in model.named_modules()] == modules
    model.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "adapter_model.safetensors")) == {"base_model.softprompt_plus.prompt"}
    with pytest.raises(AttributeError):  # nn.Module's own attribute errors are untouched
        getattr(model.base_model, "softprompt_plus_nope")  # noqa: B009
