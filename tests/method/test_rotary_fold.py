"""The rotary fold (method/rotary_fold.py): the keys a model caches for a text at positions S.. folded by -(S - T)
equal the keys it caches for the same text at T.., per family (pairing, partial rotary, per-layer rope, layers without
rotary, YaRN's scaling); float64 angles; refusals with the reason; the sliding-window check against every distance."""

import itertools

import pytest
import torch
import transformers

from peft_softprompt_plus.apps.tiny import FAMILIES
from peft_softprompt_plus.method.rotary_fold import (
    LayerRotary,
    check_fold_window,
    fold_kv_prompt,
    layer_windows,
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


def test_layer_windows_are_the_attention_layers_own():
    assert layer_windows(family_config("mistral")) == [8, 8]
    assert layer_windows(family_config("llama")) == [None, None]
    for name in ("qwen2", "gemma2"):
        config = family_config(name)
        with torch.random.fork_rng():
            model = transformers.AutoModelForCausalLM.from_config(config)
        own = [layer.self_attn.sliding_window for layer in model.model.layers]
        assert layer_windows(config) == own and set(own) == {8, None}


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
