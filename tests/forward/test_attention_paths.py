"""Which attention a forward runs (forward/attention.py), and that each one equals the concatenation reference:
`sdpa_lower_right` (one prompt, no padding: no mask tensor), `sdpa_mask`/`eager_mask` (one explicit mask per forward),
on every family, with and without checkpointing, logits and the prompt's gradient."""

import pytest
import torch
from _versions import checkpointing_on
from peft import get_peft_model
from test_families import CONCAT_ONLY, VOCAB, N, assert_equals_reference

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_family

EAGER = {"gemma2"}  # soft-capping: the family's own eager code
SLIDING = {"mistral", "gemma2"}  # windows (8) shorter than N + L in every layer: the prompt can leave a window
SOME_SLIDING = {"qwen2"}  # its first layer is full attention (`max_window_layers=1`), the others windowed


def _attach(family):
    model = get_peft_model(
        tiny_family(family, VOCAB), SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0)
    )
    return model, model.base_model.prompt("default")


def _expected(family, padded: bool) -> frozenset:
    if family in CONCAT_ONLY:
        return frozenset({"concat"})
    if family in EAGER:
        return frozenset({"eager_mask"})
    if padded or family in SLIDING:
        return frozenset({"sdpa_mask"})
    if family in SOME_SLIDING:  # decided per layer: the window is the layer's
        return frozenset({"sdpa_lower_right", "sdpa_mask"})
    return frozenset({"sdpa_lower_right"})


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_kernel_equals_the_concatenation(family, padded, checkpointing):
    model, prompt = _attach(family)
    reference = tiny_family(family, VOCAB)
    ids = torch.randint(2, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
    if checkpointing:
        checkpointing_on(model.get_base_model(), reentrant=False)
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert model.base_model.forward_state.last_kernels == _expected(family, padded)
    assert_equals_reference(logits, prompt, reference, ids, mask)


def test_the_lower_right_kernel_gives_the_mask_kernel_s_numbers():
    # One batch through the lower-right bias, and the same batch routed to two adapters holding the same prompt (a
    # per-row batch, so the explicit mask): equal to rounding, so the choice never changes a result.
    model, prompt = _attach("llama")
    model.add_adapter("twin", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N))
    with torch.no_grad():
        model.base_model.prompt("twin").copy_(prompt)
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        free = model(input_ids=ids).logits
        assert model.base_model.forward_state.last_kernels == {"sdpa_lower_right"}
        routed = model(input_ids=ids, adapter_names=["default", "twin"]).logits
        assert model.base_model.forward_state.last_kernels == {"sdpa_mask"}
    torch.testing.assert_close(free, routed, atol=1e-6, rtol=1e-6)


def test_under_a_dispatch_mode_the_mask_path_takes_over():
    # The lower-right bias is a tensor subclass, which can't be made inside a TorchDispatchMode (FLOP counters,
    # memory watchers): the explicit mask computes the same attention there.
    from torch.utils.flop_counter import FlopCounterMode

    model, _ = _attach("llama")
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        free = model(input_ids=ids).logits
        with FlopCounterMode(display=False):
            counted = model(input_ids=ids).logits
        assert model.base_model.forward_state.last_kernels == {"sdpa_mask"}
    torch.testing.assert_close(free, counted, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_a_gpu_training_step_with_one_prompt_concatenates(family, monkeypatch):
    # bench/RESULTS.md: on a GPU the shared prompt pass makes a training step launch-bound, so `auto` concatenates
    # there; the test stands in for the GPU. Sliding windows, inference and mixed batches keep the shared pass.
    from peft_softprompt_plus.forward import prompted

    model, prompt = _attach(family)
    ids = torch.randint(2, VOCAB, (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    model.train()
    shared = model(input_ids=ids, attention_mask=mask).logits
    monkeypatch.setattr(prompted, "_on_gpu", lambda model: True)
    gpu = model(input_ids=ids, attention_mask=mask).logits
    state = model.base_model.forward_state
    assert state.last_kernels == ({"sdpa_mask"} if family == "mistral" else {"concat"})
    real = mask.bool()
    torch.testing.assert_close(gpu[real], shared[real], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert "concat" not in state.last_kernels  # inference keeps the shared, stored pass
    model.add_adapter("other", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N))
    model(input_ids=ids, attention_mask=mask, adapter_names=["default", "other", "default"])
    assert "concat" not in state.last_kernels  # a mixed batch reads each row's prompt at the attention


def test_on_a_gpu_only_a_training_step_concatenates(monkeypatch):
    """`auto`'s GPU rule is for a training step: the model in training mode with gradients on. An eval forward
    outside `no_grad` and every `generate` (which picks its path before transformers turns gradients off, even on a
    model left in training mode) keep the attention; a KV prompt never concatenates."""
    from peft_softprompt_plus.forward import generation, prompted

    model, _ = _attach("llama")
    model.add_adapter("kv", SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv"))
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(prompted, "_on_gpu", lambda model: True)
    concatenated = []
    original = generation.generate_concat
    monkeypatch.setattr(generation, "generate_concat", lambda *a: concatenated.append(a) or original(*a))
    state = model.base_model.forward_state
    model.train()(input_ids=ids, labels=ids)
    assert state.last_kernels == {"concat"}  # the measured GPU rule still holds for training
    model.eval()(input_ids=ids)  # gradients on, but not training
    assert "concat" not in state.last_kernels
    for mode in (model.train, model.eval):
        mode()
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    assert concatenated == []
    model.set_adapter("kv")
    model.train()(input_ids=ids, labels=ids)
    assert "concat" not in state.last_kernels
