"""The fold (files/fold.py). The keys' arithmetic: the keys a model caches for a text at positions S.. folded by
-(S - T) equal the keys it caches for the same text at T.., per family (pairing, partial rotary, per-layer rope, layers
without rotary, YaRN's scaling); float64 angles; refusals with the reason; the sliding-window check against every
distance. The adapters: a folded adapter's logits and greedy tokens on a text equal the original's, whose text starts
at S > N, on Llama, Qwen2, Gemma-2 (its window wider than any text here), Phi-3 and GPT-NeoX (partial rotary); from a
folder (saved and loaded back) and from a loaded model (in place, then CARTRIDGE export); refused on GPT-2 and on a
base config that differs from the adapter's."""

import itertools
import json

import pytest
import torch
import transformers
from peft import PeftModel, get_peft_model
from transformers import DynamicCache

from peft_softprompt_plus import SoftPromptPlusConfig, fold_adapter, save_folded, to_cartridge
from peft_softprompt_plus.apps.tiny import FAMILIES
from peft_softprompt_plus.files.fold import (
    LayerRotary,
    check_fold_window,
    fold_kv_prompt,
    rotary_layers,
    rotate_keys,
)

VOCAB = 300
_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=1)
_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def family_config(name: str, **overrides):
    config_name, kwargs = FAMILIES[name]
    return getattr(transformers, config_name)(vocab_size=VOCAB, **{**kwargs, **overrides})


def _yarn():
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 512}
    return family_config("llama", rope_parameters=rope)


def _llama3():
    rope = dict(rope_type="llama3", factor=8.0, rope_theta=500000.0, low_freq_factor=1.0, high_freq_factor=4.0)
    return family_config("llama", rope_parameters={**rope, "original_max_position_embeddings": 64})


CONFIGS = {
    "llama": lambda: family_config("llama"),
    "llama_yarn": _yarn,
    "llama3_rope": _llama3,
    "qwen2": lambda: family_config("qwen2"),
    "gemma2": lambda: family_config("gemma2"),
    "phi3_partial": lambda: family_config("phi3", partial_rotary_factor=0.5),
    "gpt_neox": lambda: family_config("gpt_neox"),  # rotary_pct 0.25: 4 of 16 dims turn
    "gptj": lambda: family_config("gptj"),  # interleaved pairs, rotary_dim 8 of 16
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=VOCAB, **_SMALL, head_dim=16, layer_types=["sliding_attention", "full_attention"], **_IDS
    ),
    "smollm3": lambda: transformers.SmolLM3Config(vocab_size=VOCAB, **_SMALL, no_rope_layers=[1, 0], **_IDS),
}


def cached_keys_values(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """What `model` caches for `ids` `[1, L]` placed at positions start..: `[layers, 2, Hkv, L, hd]`."""
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None], use_cache=True)
    cache = out.cache
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_keys_of_a_text_at_s_fold_to_its_keys_at_t(name):
    config = CONFIGS[name]()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    at_s, at_t = cached_keys_values(model, ids, 40), cached_keys_values(model, ids, 3)
    folded = fold_kv_prompt(at_s, config, from_start=46, to_start=9)  # N=6: text starts 46 -> 9, keys 40.. -> 3..
    torch.testing.assert_close(folded, at_t, atol=2e-6, rtol=1e-6)
    assert torch.equal(folded[:, 1], at_s[:, 1])  # values never move
    assert (at_s[:, 0] - at_t[:, 0]).abs().max() > 0.05  # the positions did change the keys


def test_yarn_s_scaling_is_in_the_stored_keys_and_never_applied_again():
    """Against transformers' own YaRN rotary: a turn by p is its rotation at position p, without the attention
    scaling it bakes into cos/sin (the stored keys carry that scale once already)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = _yarn()
    layer = rotary_layers(config)[0]
    assert layer.attention_scaling > 1.1
    rope = LlamaRotaryEmbedding(config)
    keys = torch.randn(1, 4, 3, 16)  # [B, Hkv, T, hd]
    for shift in (7, 300):
        cos, sin = rope(keys, torch.full((1, 3), shift))  # [1, T, hd], times the scaling
        want, _ = apply_rotary_pos_emb(keys, keys, cos / layer.attention_scaling, sin / layer.attention_scaling)
        torch.testing.assert_close(rotate_keys(keys[0], layer, shift), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate_keys(keys[0], layer, 7).norm(dim=-1), keys[0].norm(dim=-1))  # no scale


def test_per_layer_rope_and_layers_without_rotary():
    gemma3 = rotary_layers(CONFIGS["gemma3"]())  # local base 10k, global 1M
    assert not torch.equal(gemma3[0].inv_freq, gemma3[1].inv_freq)
    smollm3 = rotary_layers(CONFIGS["smollm3"]())
    assert smollm3[0].inv_freq is not None and smollm3[1].inv_freq is None
    values = torch.randn(2, 2, 2, 5, 16)
    folded = fold_kv_prompt(values, CONFIGS["smollm3"](), 20, 5)
    assert torch.equal(folded[1], values[1]) and not torch.equal(folded[0], values[0])


def test_partial_rotary_turns_only_its_share_and_pairing_is_the_family_s():
    neox = rotary_layers(CONFIGS["gpt_neox"]())[0]
    assert neox.inv_freq.shape == (2,) and not neox.interleaved  # 4 of 16 dims, rotate-half
    keys = torch.randn(2, 5, 16)
    turned = rotate_keys(keys, neox, -11)
    assert torch.equal(turned[..., 4:], keys[..., 4:]) and not torch.equal(turned[..., :4], keys[..., :4])
    gptj = rotary_layers(CONFIGS["gptj"]())[0]
    assert gptj.interleaved and gptj.inv_freq.shape == (4,)
    other = LayerRotary(gptj.inv_freq, interleaved=False)
    assert (rotate_keys(keys, gptj, -11) - rotate_keys(keys, other, -11)).abs().max() > 0.1  # pairing matters


def test_angles_are_float64():
    """Turning by a million positions and back lands where turning by the difference does: with float32 angles each
    turn is off by up to 0.03 rad at that shift; with the fold's float64 angles the round trip is exact to float32."""
    rotary = rotary_layers(family_config("llama"))[0]
    keys = torch.randn(2, 3, 16)
    far = rotate_keys(rotate_keys(keys, rotary, 1_000_003), rotary, -1_000_000)
    torch.testing.assert_close(far, rotate_keys(keys, rotary, 3), atol=2e-6, rtol=1e-6)
    assert far.dtype == torch.float32  # the keys' own dtype back


@pytest.mark.parametrize(
    "config, match",
    [
        (lambda: family_config("gpt2"), r"gpt2 adds learned absolute position embeddings"),
        (lambda: family_config("opt"), r"opt adds learned absolute position embeddings"),
        (
            lambda: family_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            r"its rope_type 'dynamic' recomputes the frequencies from the sequence's length",
        ),
        (
            lambda: family_config(
                "phi3",
                max_position_embeddings=256,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 64,
                },
            ),
            r"its rope_type 'longrope' recomputes the frequencies",
        ),
        (lambda: family_config("bloom"), r"'bloom' is not a family whose rotary this fold knows exactly"),
    ],
)
def test_a_fold_that_cannot_be_exact_is_refused_with_the_reason(config, match):
    values = torch.randn(2, 2, 2, 5, 16)
    with pytest.raises(ValueError, match=r"`model_config` can't fold a KV prompt's keys: " + match):
        fold_kv_prompt(values, config(), 9, 5)
    assert torch.equal(fold_kv_prompt(values, config(), 5, 5), values)  # nothing to move: any model


def test_arguments_are_checked():
    config = family_config("llama")
    with pytest.raises(ValueError, match=r"`values` must be a KV prompt's .* got shape \[2, 5, 16\]"):
        fold_kv_prompt(torch.randn(2, 5, 16), config, 9, 5)
    with pytest.raises(ValueError, match=r"`to_start` must be an int >= N \(5\).* got 4"):
        fold_kv_prompt(torch.randn(2, 2, 2, 5, 16), config, 9, 4)
    with pytest.raises(ValueError, match=r"`values` has 3 layers, but `model_config` has 2"):
        fold_kv_prompt(torch.randn(3, 2, 2, 5, 16), config, 9, 5)


def _crosses(n: int, start_a: int, start_b: int, length: int, window: int) -> bool:
    """Every prompt-to-text distance, kept or not (q - k < W) at each start: does any differ?"""
    pairs = itertools.product(range(n), range(length))
    return any((start_a + j - p < window) != (start_b + j - p < window) for p, j in pairs)


def test_the_window_check_refuses_exactly_the_requests_a_window_cuts_differently():
    config = family_config("mistral")  # window 8 on every layer
    checked = 0
    for n, length, shift, to_extra in itertools.product(range(1, 5), range(1, 8), range(0, 6), range(0, 3)):
        to_start = n + to_extra
        from_start = to_start + shift
        crosses = _crosses(n, from_start, to_start, length, 8)
        try:
            check_fold_window(config, n, from_start, to_start, length)
            refused = False
        except ValueError as err:
            assert "sliding window (8)" in str(err)
            refused = True
        assert refused == crosses, (n, from_start, to_start, length)
        checked += 1
    assert checked == 4 * 7 * 6 * 3
    with pytest.raises(ValueError, match=r"`text_length`=5 is too long .* Keep text_length <= 3"):
        check_fold_window(config, 4, 5, 4, 5)
    check_fold_window(family_config("llama"), 4, 500, 4, 500)  # no window: nothing to cut


def _windowed_logits(model, values: torch.Tensor, start: int, ids: torch.Tensor, window: int) -> torch.Tensor:
    """`model` reading `values` (`[layers, 2, Hkv, N, hd]`, at positions 0..N-1) with the text `ids` `[1, L]` at
    start..: each key kept while its distance in positions is below `window`, as where the text really sat."""
    n, length = values.shape[-2], ids.shape[1]
    queries = torch.arange(start, start + length)[:, None]  # [L, 1]
    keys = torch.cat([torch.arange(n), torch.arange(start, start + length)])[None]  # [1, N+L]
    keep = (keys <= queries) & (queries - keys < window)
    mask = torch.zeros(1, 1, length, n + length).masked_fill(~keep, float("-inf"))
    cache = transformers.DynamicCache()
    for layer in range(values.shape[0]):
        cache.update(values[layer, 0][None], values[layer, 1][None], layer)
    positions = torch.arange(start, start + length)[None]
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, attention_mask=mask, position_ids=positions).logits


@pytest.mark.parametrize("length", [2, 3, 5])
def test_a_request_the_window_check_passes_is_exact_and_one_it_refuses_is_not(length):
    config = family_config("mistral")  # window 8 on every layer
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    n, start, window = 4, 6, 8
    values = cached_keys_values(model, torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(2)), 0)
    ids = torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(3))
    original = _windowed_logits(model, values, start, ids, window)
    folded = _windowed_logits(model, fold_kv_prompt(values, config, start, n), n, ids, window)
    try:
        check_fold_window(config, n, start, n, length)
        passed = True
    except ValueError:
        passed = False
    assert passed == (length <= window - start)
    if passed:
        torch.testing.assert_close(folded, original, atol=1e-5, rtol=1e-5)
    else:
        assert (folded - original).abs().max() > 1e-3


# The adapters folded: from a folder or a loaded model.

N, S = 5, 17
OVERRIDES = {  # no window cuts here (a window is checked per request: above)
    "llama": {},
    "qwen2": dict(use_sliding_window=False, sliding_window=None),
    "gemma2": dict(sliding_window=4096),  # Gemma-2 needs a window; this one reaches past every text here
    "phi3": dict(partial_rotary_factor=0.5),
    "gpt_neox": {},  # rotary_pct 0.25
}
IDS = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 6


def base(name: str):
    config_name, kwargs = FAMILIES[name]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **{**kwargs, **OVERRIDES.get(name, {})})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def kv_adapter(name: str, start: int = S):
    """A KV adapter whose text starts at `start`. Its keys are made at N (a window refuses a later start at attach,
    since the window measures distances from the text), then its start is moved: the keys it reads don't change."""
    config = SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv", init_seed=3)
    model = get_peft_model(base(name), config).eval()
    model.peft_config["default"].kv_text_start = start
    return model


def reference(name: str, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The base model reading `values` `[layers, 2, Hkv, N, hd]` from its cache with the text at `start`, without this
    package: the logits on IDS and the greedy tokens, one full forward per new token."""
    model, rows = base(name), IDS.shape[0]

    def logits(ids):
        cache = DynamicCache()
        for layer in range(values.shape[0]):
            cache.update(values[layer, 0].expand(rows, -1, -1, -1), values[layer, 1].expand(rows, -1, -1, -1), layer)
        positions = torch.arange(start, start + ids.shape[1]).expand(rows, -1)
        mask = torch.ones(rows, N + ids.shape[1], dtype=torch.long)
        with torch.no_grad():
            return model(input_ids=ids, cache=cache, attention_mask=mask, position_ids=positions).logits

    tokens = IDS
    for _ in range(NEW_TOKENS):
        tokens = torch.cat([tokens, logits(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return logits(IDS), tokens


def logits_and_tokens(model):
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        tokens = model.generate(input_ids=IDS, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=1)
    return logits, tokens


def stored(model) -> torch.Tensor:
    return model.base_model.prompt_bank.values("default").detach().clone()


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_a_folded_folder_computes_what_the_original_computed(name, tmp_path):
    original = kv_adapter(name)
    original.save_pretrained(tmp_path / "original")
    want_logits, want_tokens = reference(name, stored(original), S)
    config = save_folded(tmp_path / "original", tmp_path / "folded", model_config=original.get_base_model().config)
    assert config["kv_text_start"] == N
    folded = PeftModel.from_pretrained(base(name), tmp_path / "folded").eval()
    assert folded.peft_config["default"].kv_text_start == N
    got_logits, got_tokens = logits_and_tokens(folded)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    unfolded_at_n, _ = reference(name, stored(original), N)  # the same keys read from N without the fold
    assert (unfolded_at_n - want_logits).abs().max() > 1e-3


def test_a_loaded_adapter_folds_in_place_and_then_exports_to_cartridge(tmp_path):
    model = kv_adapter("llama")
    want_logits, want_tokens = logits_and_tokens(model)
    with pytest.raises(ValueError, match=r"starts its text at kv_text_start=17, not at N=5"):
        to_cartridge(model, tmp_path / "cartridge")
    config, values = fold_adapter(model)  # returned, the model unchanged
    assert config["kv_text_start"] == N and model.peft_config["default"].kv_text_start == S
    fold_adapter(model, in_place=True)
    assert model.peft_config["default"].kv_text_start == N
    assert torch.equal(model.base_model.prompt_bank.values("default").detach(), values)
    got_logits, got_tokens = logits_and_tokens(model)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    to_cartridge(model, tmp_path / "cartridge")
    assert json.loads((tmp_path / "cartridge" / "adapter_config.json").read_text())["peft_type"] == "CARTRIDGE"


def test_a_folder_folds_with_its_base_s_config_or_refuses_another(tmp_path):
    model = kv_adapter("llama")
    model.save_pretrained(tmp_path / "adapter")
    base_config = model.get_base_model().config
    config, values = fold_adapter(tmp_path / "adapter", model_config=base_config)
    assert config["kv_text_start"] == N and list(values.shape) == [2, 2, 2, N, 16]
    other = transformers.LlamaConfig(**{**base_config.to_dict(), "rope_parameters": {"rope_theta": 500.0}})
    with pytest.raises(ValueError, match=r"recorded on another base model .*rope_parameters"):
        fold_adapter(tmp_path / "adapter", model_config=other)
    with pytest.raises(ValueError, match=r"`model_config` is None, and the base of `source`=.* Pass `model_config="):
        fold_adapter(tmp_path / "adapter")  # a base built in memory: no folder to read its config from


def test_absolute_positions_are_refused_and_an_input_adapter_has_nothing_to_fold():
    gpt2 = get_peft_model(base("gpt2"), SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv", kv_text_start=S))
    with pytest.raises(ValueError, match=r"gpt2 adds learned absolute position embeddings"):
        fold_adapter(gpt2)
    with pytest.raises(ValueError, match=r"only a KV adapter \(prompt_level='kv'\) stores keys to fold"):
        fold_adapter(get_peft_model(base("llama"), SoftPromptPlusConfig(num_virtual_tokens=N)))
