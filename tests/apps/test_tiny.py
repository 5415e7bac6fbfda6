"""The tiny model zoo (apps/tiny.py): seeded, and leaving the caller's random state alone."""

import torch

from peft_softprompt_plus.apps.tiny import tiny_family, tiny_gpt2


def test_a_tiny_model_is_its_seed_s_and_leaves_the_global_random_state_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, again, other = tiny_gpt2(seed=3), tiny_gpt2(seed=3), tiny_gpt2(seed=4)
    tiny_family("llama", seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's next draw is the one it would have had
    weights = [m.transformer.h[0].attn.c_attn.weight for m in (first, again, other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
