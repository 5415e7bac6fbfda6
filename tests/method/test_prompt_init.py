"""Initial prompt values (prompt_init.py)."""

import pytest
import torch

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.method.prompt_init import initial_prompt


def init(model, **kwargs):
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", **kwargs)
    return initial_prompt(config, model.get_input_embeddings(), model.config)


def test_random_matches_embedding_statistics(make_base):
    model = make_base()
    wte = model.transformer.wte.weight
    with torch.no_grad():  # half the rows small, half large, off zero: a vocab row's own spread is far from wte's
        scale = torch.tensor([0.2, 3.0]).repeat(wte.shape[0])[: wte.shape[0], None]
        wte.copy_(torch.randn(wte.shape, generator=torch.Generator().manual_seed(1)) * scale + 0.5)
    reference = wte.detach().double()
    mean, std = reference.mean().item(), reference.std(unbiased=False).item()
    prompt = init(model, num_virtual_tokens=64, prompt_init="random", init_seed=0)
    assert prompt.shape == (64, 64) and prompt.dtype == torch.float32
    assert abs(prompt.mean().item() - mean) < 0.1 * std
    assert abs(prompt.std().item() - std) < 0.1 * std
    # The whole-prompt statistics above are also those of rows copied from wte (vocab init); i.i.d. noise at wte's
    # scale also gives every row wte's spread, which copied rows of 0.2 or 3 times the noise don't.
    row_spread = prompt.std(dim=1) / std  # [N]
    assert row_spread.min().item() > 0.6 and row_spread.max().item() < 1.4, row_spread
    assert not (prompt[:, None, :] == wte.detach()[None]).all(dim=-1).any()  # no row is a token's embedding
    assert torch.equal(prompt, init(model, num_virtual_tokens=64, prompt_init="random", init_seed=0))  # seeded
    assert not torch.equal(prompt, init(model, num_virtual_tokens=64, prompt_init="random", init_seed=1))


def test_vocab_copies_non_special_rows(make_base):
    model = make_base()
    wte = model.transformer.wte.weight.detach()
    prompt = init(model, num_virtual_tokens=50, prompt_init="vocab", init_seed=0)
    rows = [(wte == row).all(dim=1).nonzero().flatten().tolist() for row in prompt]
    assert all(len(r) == 1 for r in rows)
    assert not {r[0] for r in rows} & {0, 1}  # end-of-text and pad are excluded
    assert prompt.untyped_storage().data_ptr() != wte.untyped_storage().data_ptr()


def test_text_tiles_and_truncates(make_base, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    model = make_base()
    ids = tokenizer(" red green", add_special_tokens=False)["input_ids"]
    wte = model.transformer.wte.weight.detach()
    prompt = init(
        model,
        num_virtual_tokens=5,
        prompt_init="text",
        prompt_init_text=" red green",
        tokenizer_name_or_path=str(tmp_path),
    )
    expected = (ids * 5)[:5]
    assert torch.equal(prompt, wte[expected])


def test_text_with_a_foreign_tokenizer_is_explained(make_base, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    small = make_base(vocab_size=10)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 10"):
        init(
            small,
            num_virtual_tokens=3,
            prompt_init="text",
            prompt_init_text=" red green",
            tokenizer_name_or_path=str(tmp_path),
        )
    with pytest.raises(ValueError, match="could not be loaded"):
        init(
            small,
            num_virtual_tokens=3,
            prompt_init="text",
            prompt_init_text="x",
            tokenizer_name_or_path=str(tmp_path / "nope"),
        )


def test_labels_are_sub_token_means_then_frequent_tokens(make_base, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    model = make_base()
    wte = model.transformer.wte.weight.detach()
    labels = [" red", " purple yellow"]  # one and several sub-tokens
    config = dict(prompt_init="labels", prompt_init_labels=labels, tokenizer_name_or_path=str(tmp_path), init_seed=0)
    prompt = init(model, num_virtual_tokens=6, **config)
    assert prompt.shape == (6, 64) and prompt.dtype == torch.float32
    for row, label in enumerate(labels):
        ids = tokenizer(label, add_special_tokens=False)["input_ids"]
        torch.testing.assert_close(prompt[row], wte[ids].mean(dim=0))
    rest = [(wte == row).all(dim=1).nonzero().flatten().tolist() for row in prompt[2:]]
    picked = [r[0] for r in rest]
    assert all(len(r) == 1 for r in rest) and len(set(picked)) == 4  # distinct vocabulary rows
    assert not set(picked) & {0, 1}  # never a special token
    assert torch.equal(prompt, init(model, num_virtual_tokens=6, **config))  # seeded
    capped = init(model, num_virtual_tokens=1, **config)
    torch.testing.assert_close(capped[0], prompt[0])  # labels past N are not used


def test_labels_with_a_foreign_tokenizer_are_explained(make_base, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 10"):
        init(
            make_base(vocab_size=10),
            num_virtual_tokens=3,
            prompt_init="labels",
            prompt_init_labels=[" green"],
            tokenizer_name_or_path=str(tmp_path),
        )


def test_inits_follow_what_the_embedding_module_outputs_even_when_it_scales():
    # transformers 5's Gemma-2 multiplies its rows by sqrt(D) inside the embedding module: a prompt built from raw
    # weight rows would start sqrt(D) = 8 times smaller than the text it sits beside.
    from peft_softprompt_plus.apps.tiny import tiny_family

    model = tiny_family("gemma2", vocab_size=300)
    embedding = model.get_input_embeddings()
    outputs = embedding(torch.arange(300)).detach()  # [V, D], scaled
    assert not torch.allclose(outputs, embedding.weight.detach())
    vocab = init(model, num_virtual_tokens=8, prompt_init="vocab", init_seed=0)
    assert all((outputs == row).all(dim=1).any() for row in vocab)
    random = init(model, num_virtual_tokens=256, init_seed=0)
    assert abs(random.std().item() / outputs.std().item() - 1) < 0.1


def test_adapter_init_starts_from_a_saved_prompt_and_fills_a_longer_one(make_base, make_peft, tmp_path):
    source = make_peft(num_virtual_tokens=3, init_seed=4)
    with torch.no_grad():
        source.base_model.prompt("default").normal_()
    saved = source.base_model.prompt("default").detach().clone()
    source.save_pretrained(tmp_path / "source")
    source_dir = str(tmp_path / "source")
    same = init(make_base(), num_virtual_tokens=3, prompt_init="adapter", prompt_init_adapter=source_dir)
    assert torch.equal(same, saved)
    from_source = dict(prompt_init="adapter", prompt_init_adapter=source_dir)
    longer = init(make_base(), num_virtual_tokens=5, init_seed=1, **from_source)
    vocab = init(make_base(), num_virtual_tokens=2, prompt_init="vocab", init_seed=1)
    assert torch.equal(longer[:3], saved) and torch.equal(longer[3:], vocab)


def test_adapter_init_refuses_what_it_cant_start_from(make_base, make_peft, tmp_path):
    make_peft(num_virtual_tokens=3).save_pretrained(tmp_path / "three")
    three = str(tmp_path / "three")
    with pytest.raises(ValueError, match=r"holds 3 virtual tokens, more than num_virtual_tokens=2.*>= 3"):
        init(make_base(), num_virtual_tokens=2, prompt_init="adapter", prompt_init_adapter=three)
    with pytest.raises(ValueError, match=r"`prompt_init_adapter`='.*nowhere' can't start this prompt: .* no adapter"):
        init(make_base(), prompt_init="adapter", prompt_init_adapter=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="hidden size 64, but this base model.s is 48"):
        init(make_base(n_embd=48), num_virtual_tokens=3, prompt_init="adapter", prompt_init_adapter=three)
    with pytest.raises(ValueError, match=r"`prompt_init_adapter` must be the folder of a saved adapter .* got None"):
        SoftPromptPlusConfig(task_type="CAUSAL_LM", prompt_init="adapter")
    with pytest.raises(ValueError, match=r"only used with `prompt_init='adapter'`, got prompt_init='vocab'"):
        SoftPromptPlusConfig(task_type="CAUSAL_LM", prompt_init_adapter="x")
