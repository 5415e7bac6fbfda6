"""The prompt at the attention across decoder families (attention.py): every family in `tiny.FAMILIES` against a
plain `inputs_embeds` concatenation reference, with left padding, with gradient checkpointing, and in `generate`."""

import importlib
import inspect

import pytest
import torch
from _versions import checkpointing_on
from peft import get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_family

N = 5
VOCAB = 300
# Families whose attention doesn't run through transformers' registry fall back to concatenation: Bloom and Falcon,
# and any family whose modeling code doesn't use the registry at all in the installed release (GPT-J before 5.24).
CONCAT_ONLY = {"bloom", "falcon"} | {
    family
    for family in FAMILIES
    if "ALL_ATTENTION_FUNCTIONS"
    not in inspect.getsource(importlib.import_module(f"transformers.models.{family}.modeling_{family}"))
}


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (3, 12), generator=g)  # 5 + 12 > every sliding window (8)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :2] = 0
    return ids, mask


def reference_logits(base, prompt, ids, mask):
    """Each row as if alone: `[pads; prompt; real text]` through `inputs_embeds` (a row's left padding moved in front
    of the prompt), prompt positions 0..N-1, text from N. Neither positions nor a sliding window's distances count
    the pads. A causal LM's `[B, L, V]` text logits; a classifier's `[B, labels]`."""
    embeds = base.get_input_embeddings()(ids)  # [B, L, D]
    rows, num_prompt, length = ids.shape[0], prompt.shape[0], ids.shape[1]
    pads = (mask == 0).sum(1).tolist()
    assert all(mask[b, pads[b] :].all() for b in range(rows)), "left padding only"
    head = prompt.to(embeds.dtype)
    sequence = torch.stack([torch.cat([embeds[b, : pads[b]], head, embeds[b, pads[b] :]]) for b in range(rows)])
    full_mask = torch.stack(
        [
            torch.cat([mask[b, : pads[b]], torch.ones(num_prompt + length - pads[b], dtype=mask.dtype)])
            for b in range(rows)
        ]
    )
    kwargs = {"inputs_embeds": sequence, "attention_mask": full_mask}  # [B, N+L, D], [B, N+L]
    if "position_ids" in inspect.signature(base.forward).parameters:
        kwargs["position_ids"] = (full_mask.cumsum(1) - 1).clamp(min=0)  # [B, N+L]
    logits = base(**kwargs).logits
    return logits[:, num_prompt:] if logits.dim() == 3 else logits


def assert_equals_reference(logits, prompt, reference, ids, mask):
    """Training-mode logits `[B, L, V]` on the real positions, and the prompt's gradient from a loss over them, equal
    the concatenation reference's."""
    real = mask.bool()
    copy = prompt.detach().clone().requires_grad_()
    want = reference_logits(reference.train(), copy, ids, mask)
    torch.testing.assert_close(logits[real], want[real], atol=1e-4, rtol=1e-4)
    # A loss over every real position reaches the prompt through every layer.
    logits[real].logsumexp(-1).sum().backward()
    want[real].logsumexp(-1).sum().backward()
    assert rel(prompt.grad, copy.grad) <= 1e-4


def attach(family):
    model = get_peft_model(
        tiny_family(family, VOCAB), SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0)
    )
    return model, model.base_model.prompt("default")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def test_path_is_the_attention_where_the_family_allows_it(family):
    model, _ = attach(family)
    assert model.base_model.forward_state.attention_path is (family not in CONCAT_ONLY)
    attn = model.config._attn_implementation
    assert attn.startswith("softprompt_plus_") is (family not in CONCAT_ONLY)
    own = tiny_family(family, VOCAB).config._attn_implementation
    with model.disable_adapter():
        assert model.config._attn_implementation == own  # a disabled adapter hands the model's own setting back
    assert model.config._attn_implementation == attn
    assert model.unload().config._attn_implementation == own  # and so does unload


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_left_padded_logits_and_gradient_equal_concatenation(family, checkpointing):
    model, prompt = attach(family)
    reference = tiny_family(family, VOCAB)
    ids, mask = batch()
    if checkpointing:
        checkpointing_on(model.get_base_model(), reentrant=checkpointing == "reentrant")
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (3, 12, VOCAB)
    assert_equals_reference(logits, prompt, reference, ids, mask)


def test_greedy_generate_equals_a_no_cache_loop(family):
    model, prompt = attach(family)
    reference = tiny_family(family, VOCAB)
    ids, mask = batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    want, want_mask = ids, mask
    for _ in range(6):
        with torch.no_grad():
            step = reference_logits(reference, prompt.detach(), want, want_mask)[:, -1].argmax(-1, keepdim=True)
        want = torch.cat([want, step], dim=1)
        want_mask = torch.cat([want_mask, torch.ones_like(step)], dim=1)
    assert torch.equal(out, want)


# ------------------------------------------------------------------------------------ task x forward path x family

MATRIX_FAMILIES = ["gpt2", "llama", "bloom"]  # learned positions, rotary + GQA, ALiBi (concatenation only)


@pytest.mark.parametrize("family", MATRIX_FAMILIES)
@pytest.mark.parametrize("forward_path", ["shared_kv", "concat"])
@pytest.mark.parametrize("task", ["CAUSAL_LM", "SEQ_CLS"])
def test_task_path_family_matrix(task, forward_path, family):
    config = SoftPromptPlusConfig(task_type=task, num_virtual_tokens=N, init_seed=0, forward_path=forward_path)
    if forward_path == "shared_kv" and family in CONCAT_ONLY:  # asked for what the family can't do: say so at once
        base = tiny_family(family, VOCAB, task=task)
        with pytest.raises(ValueError, match=r"`forward_path`='shared_kv' needs .* Use forward_path='auto'"):
            get_peft_model(base, config)
        assert base.config._attn_implementation == tiny_family(family, VOCAB, task=task).config._attn_implementation
        assert not any(p.grad is not None or "softprompt" in n for n, p in base.named_parameters())
        return
    model = get_peft_model(tiny_family(family, VOCAB, task=task), config).train()
    prompt = model.base_model.prompt("default")
    reference = tiny_family(family, VOCAB, task=task).train()
    ids, mask = batch()
    real = mask.bool()

    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    copy = prompt.detach().clone().requires_grad_()
    want = reference_logits(reference, copy, ids, mask)
    if task == "CAUSAL_LM":
        assert out.logits.shape == (3, 12, VOCAB)
        got, want = out.logits[real], want[real]
    else:
        assert out.logits.shape == (3, 3)  # one row per example, pooled at its last real token
        got = out.logits
    # Output shaping is the task's, whatever the path: hidden states cover the text only.
    assert all(h.shape[:2] == (3, 12) for h in out.hidden_states)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    got.logsumexp(-1).sum().backward()
    want.logsumexp(-1).sum().backward()
    assert rel(prompt.grad, copy.grad) <= 1e-4
