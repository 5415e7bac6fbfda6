"""A KV prompt's config, starting values and base (method/kv_init.py, the bank's frozen positions): every
`prompt_init` is the input prompt it names run once through the frozen model; a lift keeps an input adapter's logits,
its hard prefix and suffix included; the attention sink stays frozen; keys recorded on another base are refused."""

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import DynamicCache

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import tiny_family

VOCAB = 300


def kv(base, **config):
    return get_peft_model(base, SoftPromptPlusConfig(**{"num_virtual_tokens": 5, "prompt_level": "kv", **config}))


def values(model, name="default"):
    return model.base_model.prompt_bank.values(name).detach()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(forward_path="concat"), r"`forward_path`='concat' can't be used with `prompt_level='kv'`.*Use 'auto'"),
        (dict(reparameterization="residual"), r"`reparameterization`='residual' can't .*Use 'none'"),
        (dict(prompt_prefix_ids=[0]), r"`prompt_prefix_ids`=\[0\] can't .*no frozen hard text.*prompt_init='adapter'"),
        (dict(prompt_suffix="x", tokenizer_name_or_path="t"), r"`prompt_suffix`='x' can't be used"),
        (dict(kv_frozen_positions=5), r"`kv_frozen_positions` must be an int in \[0, num_virtual_tokens\) = \[0, 5\)"),
        (dict(kv_frozen_positions=-1), r"`kv_frozen_positions` must be .* got -1"),
        (dict(kv_text_start=4), r"`kv_text_start` must be an int >= num_virtual_tokens \(5\), got 4"),
        (dict(prompt_level="keys"), r"`prompt_level` must be one of \['input', 'kv'\], got 'keys'"),
    ],
)
def test_a_kv_config_refuses_what_it_cannot_be(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SoftPromptPlusConfig(num_virtual_tokens=5, prompt_level=kwargs.pop("prompt_level", "kv"), **kwargs)


def test_kv_fields_on_an_input_config_are_refused():
    with pytest.raises(ValueError, match=r"`kv_text_start`=9 only applies to `prompt_level='kv'`, got .*'input'"):
        SoftPromptPlusConfig(num_virtual_tokens=5, kv_text_start=9)


def test_every_position_trains_by_default_and_the_choice_is_recorded():
    assert SoftPromptPlusConfig(prompt_level="kv", num_virtual_tokens=5).kv_frozen_positions == 0
    sink = SoftPromptPlusConfig(prompt_level="kv", num_virtual_tokens=5, kv_frozen_positions=1)
    assert sink.kv_frozen_positions == 1
    assert SoftPromptPlusConfig(num_virtual_tokens=5).kv_frozen_positions is None  # input prompts have none


def test_text_start_is_the_keys_of_the_text_s_first_tokens(tiny_model_dir, tokenizer):
    """Cartridges' best start: the keys/values the model caches for the text, position by position."""
    from transformers import AutoModelForCausalLM

    text = " red green blue yellow black white"
    model = kv(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        prompt_init="text",
        prompt_init_text=text,
        tokenizer_name_or_path=tiny_model_dir,
    )
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:5]])
    with torch.no_grad():
        cache = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids, use_cache=True).past_key_values
    got = values(model)  # [layers, 2, Hkv, N, hd]
    for layer in range(got.shape[0]):
        torch.testing.assert_close(got[layer, 0], cache.layers[layer].keys[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[layer, 1], cache.layers[layer].values[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("init", ["vocab", "random"])
def test_every_init_is_its_input_prompt_run_once(init, tmp_path):
    source = get_peft_model(
        tiny_family("llama", VOCAB), SoftPromptPlusConfig(num_virtual_tokens=5, prompt_init=init, init_seed=4)
    )
    source.save_pretrained(tmp_path)
    direct = kv(tiny_family("llama", VOCAB), prompt_init=init, init_seed=4)
    lifted = kv(tiny_family("llama", VOCAB), prompt_init="adapter", prompt_init_adapter=str(tmp_path))
    assert values(direct).dtype == torch.float32
    torch.testing.assert_close(values(direct), values(lifted), atol=0, rtol=0)


def test_a_lift_folds_the_hard_prefix_and_suffix_in(tmp_path):
    source = get_peft_model(
        tiny_family("llama", VOCAB),
        SoftPromptPlusConfig(num_virtual_tokens=3, prompt_prefix_ids=[0], prompt_suffix_ids=[7, 8], init_seed=1),
    )
    source.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"input adapter of 6 positions \(prompt_prefix_ids 1 \+ 3 soft \+ "
        r"prompt_suffix_ids 2\).*pass num_virtual_tokens=6, got 5",
    ):
        kv(tiny_family("llama", VOCAB), prompt_init="adapter", prompt_init_adapter=str(tmp_path))
    model = kv(
        tiny_family("llama", VOCAB), num_virtual_tokens=6, prompt_init="adapter", prompt_init_adapter=str(tmp_path)
    )
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(input_ids=ids).logits, source.eval()(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    assert model.peft_config["default"].prompt_prefix_ids is None  # folded in, not kept


def test_a_kv_folder_is_copied_with_its_text_start(tmp_path):
    first = kv(tiny_family("llama", VOCAB), kv_text_start=9, init_seed=2)
    first.save_pretrained(tmp_path)
    copy = kv(tiny_family("llama", VOCAB), prompt_init="adapter", prompt_init_adapter=str(tmp_path))
    assert torch.equal(values(copy), values(first))
    assert copy.peft_config["default"].kv_text_start == 9
    with pytest.raises(
        ValueError, match=r"KV adapter of 5 positions; copying it keeps them all: pass num_virtual_tokens=5"
    ):
        kv(tiny_family("llama", VOCAB), num_virtual_tokens=4, prompt_init="adapter", prompt_init_adapter=str(tmp_path))
    with pytest.raises(
        ValueError, match=r"is a KV adapter \(prompt_level='kv'\): its keys/values can't start an input"
    ):
        get_peft_model(
            tiny_family("llama", VOCAB),
            SoftPromptPlusConfig(num_virtual_tokens=5, prompt_init="adapter", prompt_init_adapter=str(tmp_path)),
        )


def test_the_text_starts_where_the_config_says():
    """`kv_text_start` > N: the text's positions start there (keys kept at their own positions in a longer text). The
    reference is the base model reading the same keys/values from a cache, with position ids from 12."""
    model = kv(tiny_family("llama", VOCAB), kv_text_start=12, init_seed=3).eval()
    stored = values(model)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    for layer in range(stored.shape[0]):
        cache.update(stored[layer, 0].expand(2, -1, -1, -1), stored[layer, 1].expand(2, -1, -1, -1), layer)
    base = tiny_family("llama", VOCAB)
    with torch.no_grad():
        want = base(
            input_ids=ids,
            past_key_values=cache,
            attention_mask=torch.ones(2, 5 + 6, dtype=torch.long),
            position_ids=torch.arange(12, 18).expand(2, -1),
        ).logits
        got = model(input_ids=ids).logits
        at_n = kv(tiny_family("llama", VOCAB), init_seed=3).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, at_n, atol=1e-3)  # rotary keys: the text's positions matter


def test_a_sliding_window_model_refuses_a_later_text_start():
    with pytest.raises(ValueError, match=r"`kv_text_start`=9 .* sliding window \(8\).*Use kv_text_start=None"):
        kv(tiny_family("mistral", VOCAB), kv_text_start=9)


def test_the_sink_stays_frozen_through_training_and_set_adapter(tmp_path):
    model = kv(tiny_family("llama", VOCAB), init_seed=0, kv_frozen_positions=1).train()
    bank = model.base_model.prompt_bank
    sink, start = bank.sinks["default"].detach().clone(), bank.prompts["default"].detach().clone()
    assert not bank.sinks["default"].requires_grad and bank.prompts["default"].shape[-2] == 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)  # decay would move a held sink
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(bank.sinks["default"], sink) and not torch.equal(bank.prompts["default"], start)
    model.set_adapter("default")
    assert not bank.sinks["default"].requires_grad
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_family("llama", VOCAB), tmp_path, is_trainable=True)
    assert not loaded.base_model.prompt_bank.sinks["default"].requires_grad
    assert torch.equal(values(loaded), values(model))
    trainable = [n for n, p in loaded.named_parameters() if p.requires_grad]
    assert trainable == ["base_model.prompt_bank.softprompt_plus_prompt.default"]


def test_keys_recorded_on_another_base_are_refused(tmp_path):
    kv(tiny_family("llama", VOCAB)).save_pretrained(tmp_path)
    other = tiny_family("llama", VOCAB)
    other.config.rope_parameters = {**other.config.rope_parameters, "rope_theta": 500000.0}
    own = other.config._attn_implementation
    with pytest.raises(
        ValueError, match=r"recorded on another base model .*rope_parameters: .*10000\.0.* != .*500000"
    ):
        PeftModel.from_pretrained(other, tmp_path)
    assert other.config._attn_implementation == own and not any("softprompt" in n for n, _ in other.named_parameters())
    with pytest.raises(ValueError, match=r"layers: 2 != 3"):
        PeftModel.from_pretrained(tiny_family_with(num_hidden_layers=3), tmp_path)


def tiny_family_with(**overrides):
    import transformers

    from peft_softprompt_plus.apps.tiny import FAMILIES

    name, kwargs = FAMILIES["llama"]
    return transformers.LlamaForCausalLM(getattr(transformers, name)(vocab_size=VOCAB, **{**kwargs, **overrides}))


@pytest.mark.parametrize("level", ["input", "kv"])
def test_loading_reads_no_start_of_its_own(level, tmp_path):
    """A saved adapter started from a folder (or a tokenizer) loads where that folder is gone: the load overwrites
    the starting values, so they are not computed."""
    source = get_peft_model(tiny_family("llama", VOCAB), SoftPromptPlusConfig(num_virtual_tokens=5))
    source.save_pretrained(tmp_path / "source")
    config = SoftPromptPlusConfig(
        num_virtual_tokens=5, prompt_level=level, prompt_init="adapter", prompt_init_adapter=str(tmp_path / "source")
    )
    model = get_peft_model(tiny_family("llama", VOCAB), config)
    model.save_pretrained(tmp_path / "trained")
    (tmp_path / "source" / "adapter_model.safetensors").unlink()
    loaded = PeftModel.from_pretrained(tiny_family("llama", VOCAB), tmp_path / "trained", is_trainable=True)
    assert torch.equal(values(loaded), values(model))
