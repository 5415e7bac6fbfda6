"""A model's sliding windows (forward/windows.py): read per layer as each family's attention layers hold them."""

import torch
import transformers

from peft_softprompt_plus.apps.tiny import FAMILIES
from peft_softprompt_plus.forward.windows import layer_windows, smallest_window, text_config


def family_config(name: str, **overrides):
    config_name, kwargs = FAMILIES[name]
    return getattr(transformers, config_name)(vocab_size=300, **{**kwargs, **overrides})


def test_layer_windows_are_the_attention_layers_own():
    assert layer_windows(family_config("mistral")) == [8, 8]
    assert layer_windows(family_config("llama")) == [None, None]
    for name in ("qwen2", "gemma2"):
        config = family_config(name)
        with torch.random.fork_rng():
            model = transformers.AutoModelForCausalLM.from_config(config)
        own = [layer.self_attn.sliding_window for layer in model.model.layers]
        assert layer_windows(config) == own and set(own) == {8, None}


def test_the_smallest_window_is_the_narrowest_layer_s_and_none_without_one():
    assert smallest_window(None) is None
    assert smallest_window(family_config("llama")) is None
    assert smallest_window(family_config("mistral")) == 8
    assert (
        smallest_window(family_config("qwen2", sliding_window=6, layer_types=["full_attention", "sliding_attention"]))
        == 6
    )
    assert smallest_window(family_config("qwen2", sliding_window=6, layer_types=["full_attention"] * 2)) is None


def test_a_multimodal_config_is_read_through_its_text_config():
    inner = family_config("mistral")

    class Outer:
        def get_text_config(self):
            return inner

    assert text_config(Outer()) is inner and text_config(inner) is inner
    assert smallest_window(Outer()) == 8
