"""KV prompts at the forward (forward/kv_pass.py, `prompt_level='kv'`) on every family whose attention runs through
transformers' registry: against PEFT CARTRIDGE holding the same keys/values (its forward: logits, loss over labels
1.., gradient), against the input prompt the KV prompt was lifted from (logits under left padding), with gradient
checkpointing, in `generate` (a manual greedy loop; batched equals alone), mixed with input prompts and base rows,
and composed."""

import pytest
import torch
from _versions import checkpointing_on
from peft import CartridgeConfig, get_peft_model
from test_families import CONCAT_ONLY, VOCAB, batch

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_family

N = 5
KV_FAMILIES = sorted(f for f in FAMILIES if f not in CONCAT_ONLY)


def kv_model(family, task="CAUSAL_LM", adapter_name="default", **config):
    config = SoftPromptPlusConfig(
        task_type=task, **{"num_virtual_tokens": N, "init_seed": 0, "prompt_level": "kv", **config}
    )
    return get_peft_model(tiny_family(family, VOCAB, task=task), config, adapter_name=adapter_name)


def as_cartridge(values: torch.Tensor) -> torch.Tensor:
    """Our `[layers, 2, Hkv, N, hd]` as PEFT CARTRIDGE's `prompt_embeddings` `[N, layers*2*Hkv*hd]` (layer-major, key
    before value: its `2*layer` and `2*layer+1` slots)."""
    return values.permute(3, 0, 1, 2, 4).reshape(values.shape[3], -1)


def cartridge(family, values, frozen):
    ref = get_peft_model(
        tiny_family(family, VOCAB),
        CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=values.shape[3], num_frozen_tokens=frozen),
    )
    ref.prompt_encoder["default"].load_prompt_embeddings(as_cartridge(values.detach()))
    return ref


@pytest.fixture(params=KV_FAMILIES)
def family(request):
    return request.param


@pytest.mark.parametrize("frozen", [0, 1])
def test_logits_loss_and_gradient_equal_peft_cartridge(family, frozen):
    """PEFT's forward with past_key_values is the reference; its `generate` is not (it ignores the trained cache)."""
    model = kv_model(family, kv_frozen_positions=frozen).train()
    values = model.base_model.prompt_bank.values("default")
    ref = cartridge(family, values, frozen).train()
    ids = torch.randint(2, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert ours.logits.shape == theirs.logits.shape == (3, 9, VOCAB)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-6, rtol=1e-6)
    ours.loss.backward()
    theirs.loss.backward()
    grad = model.base_model.prompt("default").grad  # [layers, 2, Hkv, N - frozen, hd]
    want = ref.prompt_encoder["default"].trainable_embedding.grad  # [N - frozen, ...]
    torch.testing.assert_close(as_cartridge(grad), want, atol=1e-6, rtol=1e-5)


def test_a_lifted_input_prompt_gives_its_logits(family, tmp_path):
    """Under left padding, in eval: the KV prompt lifted from an input prompt reads the keys/values that prompt's pass
    computed, so every real position's logits are equal."""
    source = get_peft_model(tiny_family(family, VOCAB), SoftPromptPlusConfig(num_virtual_tokens=N, init_seed=3))
    source.save_pretrained(tmp_path)
    model = kv_model(family, prompt_init="adapter", prompt_init_adapter=str(tmp_path))
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        want = source.eval()(input_ids=ids, attention_mask=mask).logits
        got = model.eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
def test_checkpointing_gives_the_same_gradient(family, checkpointing):
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for on in (False, True):
        model = kv_model(family)
        if on:
            checkpointing_on(model.get_base_model(), reentrant=checkpointing == "reentrant")
        model.train()(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append(model.base_model.prompt("default").grad)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_greedy_generate_equals_a_manual_loop_batched_and_alone(family):
    model = kv_model(family).eval()
    ids, mask = batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=1)
    for row in range(ids.shape[0]):
        want = ids[row : row + 1, mask[row].bool()]
        for _ in range(5):  # full forwards, no cache: the prompt read by every step's own pass
            with torch.no_grad():
                step = model(input_ids=want).logits[:, -1].argmax(-1, keepdim=True)
            want = torch.cat([want, step], dim=1)
        alone = model.generate(input_ids=ids[row : row + 1, mask[row].bool()], max_new_tokens=5, do_sample=False)
        assert torch.equal(out[row, -5:], want[0, -5:])
        assert torch.equal(alone[0, -5:], want[0, -5:])


def test_the_loss_runs_over_labels_one_on():
    """A KV prompt has no last position: label 0 is never a target, so changing it changes nothing."""
    model = kv_model("llama").train()
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids)
    other = ids.clone()
    other[:, 0] = (other[:, 0] + 1) % VOCAB
    assert torch.equal(model(input_ids=ids, labels=other).loss, out.loss)
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want)


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_families_outside_the_registry_refuse_it_by_name(family):
    base = tiny_family(family, VOCAB)
    own = base.config._attn_implementation
    with pytest.raises(ValueError, match=rf"`prompt_level`='kv' needs .*\({family}\) computes attention outside"):
        get_peft_model(base, SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv"))
    assert base.config._attn_implementation == own
    assert not any("softprompt" in n for n, _ in base.named_parameters())


# ------------------------------------------------------------------------------------ many prompts in one batch


def many(family="llama"):
    model = kv_model(family, adapter_name="kv_a")
    model.add_adapter("kv_b", SoftPromptPlusConfig(num_virtual_tokens=3, prompt_level="kv", init_seed=1))
    model.add_adapter("inp", SoftPromptPlusConfig(num_virtual_tokens=4, init_seed=2))
    return model.eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_kv_input_and_base_rows_in_one_batch_equal_each_alone(family):
    model = many(family)
    ids, mask = batch()
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, mask[:1]])
    rows = ["kv_a", "inp", "__base__", "kv_b"]
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        mixed = model(input_ids=ids, attention_mask=mask, adapter_names=rows).logits
        for row, name in enumerate(rows):
            real = mask[row].bool()
            alone = model(input_ids=ids[row : row + 1, real], adapter_names=[name]).logits[0]
            torch.testing.assert_close(mixed[row, real], alone, atol=1e-5, rtol=1e-5)
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, adapter_names=rows)
    assert out.loss.isfinite() and out.logits.shape == (4, 12, VOCAB)


def test_a_mixed_batch_counts_label_zero_for_input_rows_only():
    """The input row's last prompt position predicts its label 0; the KV and base rows have nothing that does."""
    model = many().train()
    ids = torch.randint(2, VOCAB, (4, 6), generator=torch.Generator().manual_seed(4))
    rows = ["kv_a", "inp", "__base__", "kv_b"]
    out = model(input_ids=ids, labels=ids, adapter_names=rows)
    sums = [
        torch.nn.functional.cross_entropy(out.logits[b, :-1].float(), ids[b, 1:], reduction="sum") for b in range(4)
    ]
    only_first = torch.full_like(ids[1:2], -100)
    only_first[0, 0] = ids[1, 0]
    first = model(input_ids=ids[1:2], labels=only_first, adapter_names=["inp"]).loss  # the one label-0 term
    torch.testing.assert_close(out.loss, (sum(sums) + first) / (4 * 5 + 1), atol=1e-5, rtol=1e-5)


def test_mixed_generate_equals_each_row_alone():
    model = many()
    ids, mask = batch()
    rows = ["kv_b", "inp", "kv_a"]
    out = model.generate(
        input_ids=ids, attention_mask=mask, adapter_names=rows, max_new_tokens=4, do_sample=False, pad_token_id=1
    )
    for row, name in enumerate(rows):
        model.set_adapter(name)
        alone = model.generate(input_ids=ids[row : row + 1, mask[row].bool()], max_new_tokens=4, do_sample=False)
        assert torch.equal(out[row, -4:], alone[0, -4:])


def test_composed_kv_adapters_equal_one_adapter_holding_both_caches():
    """Cartridges' composition: each cache keeps its own positions, concatenated in order, the text after both."""
    model = many()
    bank = model.base_model.prompt_bank
    joint = torch.cat([bank.values("kv_a"), bank.values("kv_b")], dim=-2).detach()  # [layers, 2, Hkv, 8, hd]
    model.add_adapter("joint", SoftPromptPlusConfig(num_virtual_tokens=8, prompt_level="kv", kv_frozen_positions=0))
    with torch.no_grad():
        model.base_model.prompt("joint").copy_(joint)
    ids, mask = batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, adapter_names=["joint"] * 3).logits
        per_row = model(input_ids=ids, attention_mask=mask, adapter_names=[["kv_a", "kv_b"], "inp", "joint"]).logits
        model.set_adapter(["kv_a", "kv_b"])
        whole = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(whole[real], want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_row[0][real[0]], want[0][real[0]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_row[2][real[2]], want[2][real[2]], atol=1e-5, rtol=1e-5)
    # Both caches are read: the composition is neither one alone. (Attention doesn't see the order of its keys,
    # whose positions are in them already: the order given only decides the layout.)
    with torch.no_grad():
        first_alone = model(input_ids=ids, attention_mask=mask, adapter_names=["kv_a"] * 3).logits
    assert not torch.allclose(first_alone[real], want[real], atol=1e-3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    model.set_adapter("joint")
    assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False))


def test_composing_an_input_adapter_is_refused():
    model = many()
    with pytest.raises(ValueError, match=r"`set_adapter` composes \['kv_a', 'inp'\].*\['inp'\] is an input"):
        model.set_adapter(["kv_a", "inp"])
    with pytest.raises(ValueError, match=r"row 1 composes \['inp', 'kv_b'\].*only KV adapters"):
        model(input_ids=torch.ones(2, 3, dtype=torch.long), adapter_names=["kv_a", ["inp", "kv_b"]])


def test_composed_adapters_train_together():
    model = many().train()
    model.set_adapter(["kv_a", "kv_b"])
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    for name in ("kv_a", "kv_b"):
        assert model.base_model.prompt(name).grad.abs().sum() > 0
    assert model.base_model.prompt("inp").grad is None


# ------------------------------------------------------------------------------------ sequence classification


def test_sequence_classification_equals_the_lifted_input_prompt(tmp_path):
    source = get_peft_model(
        tiny_family("llama", VOCAB, task="SEQ_CLS"), SoftPromptPlusConfig(task_type="SEQ_CLS", num_virtual_tokens=N)
    )
    source.save_pretrained(tmp_path)
    model = kv_model("llama", task="SEQ_CLS", prompt_init="adapter", prompt_init_adapter=str(tmp_path))
    with torch.no_grad():  # the score head starts as the base's in both
        model.base_model.model.score.modules_to_save["default"].weight.copy_(
            source.base_model.model.score.modules_to_save["default"].weight
        )
    ids, mask = batch()
    mask[0, -3:] = 0  # right padding too: each row pools its last real token
    with torch.no_grad():
        want = source.eval()(input_ids=ids, attention_mask=mask).logits
        got = model.eval()(input_ids=ids, attention_mask=mask).logits
    assert got.shape == (3, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_mixed_batch_is_the_same_when_the_last_prompt_position_rides_with_the_text():
    """A keyword the model may read labels with (here `logits_to_keep` beside labels) runs the input prompts' last
    position in the text pass; a KV row has none, so its head there is a masked zero row. Same loss and logits."""
    model = many().train()
    ids = torch.randint(2, VOCAB, (4, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[2, -2:] = 0  # right padding: under left padding a pad predicts the first real token, path by path
    labels = ids.masked_fill(mask == 0, -100)
    rows = ["kv_a", "inp", "__base__", "kv_b"]
    shared = model(input_ids=ids, attention_mask=mask, labels=labels, adapter_names=rows)
    riding = model(input_ids=ids, attention_mask=mask, labels=labels, adapter_names=rows, logits_to_keep=0)
    assert riding.logits.shape == shared.logits.shape == (4, 6, VOCAB)
    real = mask.bool()
    torch.testing.assert_close(riding.logits[real], shared.logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(riding.loss, shared.loss, atol=1e-6, rtol=1e-6)


def test_a_one_token_input_prompt_riding_with_the_text_runs_no_prompt_pass():
    """N=1 and a keyword that may read the labels: the one position runs with the text, and nothing is left for a
    prompt pass (which would have zero positions). Same loss as without the keyword, alone and beside a KV row."""
    model = get_peft_model(tiny_family("llama", VOCAB), SoftPromptPlusConfig(num_virtual_tokens=1, init_seed=0))
    model.add_adapter("kv", SoftPromptPlusConfig(num_virtual_tokens=3, prompt_level="kv"))
    model.train()
    ids = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    for rows in (["default", "default"], ["default", "kv"]):
        shared = model(input_ids=ids, labels=ids, adapter_names=rows).loss
        riding = model(input_ids=ids, labels=ids, adapter_names=rows, logits_to_keep=0).loss
        torch.testing.assert_close(riding, shared, atol=1e-6, rtol=1e-6)
