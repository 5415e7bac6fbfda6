"""Forward semantics (semantics.py, forward/paths.py, tasks.py) against PEFT PROMPT_TUNING and invariants."""

import importlib
import warnings

import pytest
import torch
from _versions import HAS_NEW_NAMES
from conftest import prompt_tuning_reference, random_ids
from transformers.loss.loss_utils import ForCausalLMLoss

N = 5


def prompt_of(model):
    return model.base_model.prompt("default")


def peft_reference(make_base, ours, task="CAUSAL_LM"):
    """PEFT PROMPT_TUNING on an identical base, holding the same prompt values (fp32, dropout 0)."""
    return prompt_tuning_reference(make_base(task=task), prompt_of(ours), task)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("forward_path", ["shared_kv", "concat"])
def test_matches_peft_prompt_tuning(make_base, make_peft, forward_path):
    ours = make_peft(num_virtual_tokens=N, forward_path=forward_path)
    ref = peft_reference(make_base, ours)
    ids = random_ids(3, 9)
    labels = ids.clone()
    labels[0, :3] = -100
    out, ref_out = ours(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)

    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-5 * abs(ref_out.loss.item())
    assert out.logits.shape == (3, 9, ours.config.vocab_size)  # base-shaped: no virtual positions
    torch.testing.assert_close(out.logits, ref_out.logits[:, N:], atol=1e-5, rtol=1e-5)
    (g,) = torch.autograd.grad(out.loss, prompt_of(ours))
    (g_ref,) = torch.autograd.grad(ref_out.loss, ref.prompt_encoder["default"].embedding.weight)
    assert rel(g, g_ref) <= 1e-4
    assert g.dtype == torch.float32


def test_loss_includes_first_text_token(make_peft):
    """Only text token 0 is labelled: the loss must still be defined (predicted from the last prompt position)."""
    model = make_peft()
    ids = random_ids(2, 4)
    labels = torch.full_like(ids, -100)
    labels[:, 0] = ids[:, 0]
    loss = model(input_ids=ids, labels=labels).loss
    assert torch.isfinite(loss) and loss.item() > 0
    (g,) = torch.autograd.grad(loss, prompt_of(model))
    assert g.abs().sum() > 0


def test_shared_kv_equals_concat(make_base, make_peft):
    a = make_peft(forward_path="shared_kv")
    b = make_peft(forward_path="concat")
    ids = random_ids(4, 7, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, 5:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    out_a = a(input_ids=ids, attention_mask=mask, labels=labels)
    out_b = b(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out_a.loss, out_b.loss, atol=1e-6, rtol=1e-6)
    real = mask.bool()
    torch.testing.assert_close(out_a.logits[real], out_b.logits[real], atol=1e-5, rtol=1e-5)
    (ga,) = torch.autograd.grad(out_a.loss, prompt_of(a))
    (gb,) = torch.autograd.grad(out_b.loss, prompt_of(b))
    assert rel(ga, gb) <= 1e-5


def _labels_variants(ids):
    all_text = ids.clone()
    first_masked = ids.clone()
    first_masked[:, 0] = -100  # completion-only losses mask the start of every row
    some = ids.clone()
    some[1, :4] = -100
    return {"all": all_text, "first_masked": first_masked, "some": some}


@pytest.mark.parametrize("which", ["all", "first_masked", "some"])
@pytest.mark.parametrize("num_items", [None, 11])
def test_first_token_from_the_shared_pass_matches_peft(make_base, make_peft, which, num_items):
    # The shared pass predicts text token 0 once for every row; with the Trainer's `num_items_in_batch` the loss
    # is a sum over that count, as in PEFT, and otherwise a mean over every labelled token.
    ours = make_peft(num_virtual_tokens=N, forward_path="shared_kv")
    ref = peft_reference(make_base, ours)
    ids = random_ids(3, 8, seed=4)
    labels = _labels_variants(ids)[which]
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    out, ref_out = ours(input_ids=ids, labels=labels, **extra), ref(input_ids=ids, labels=labels, **extra)
    torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-6, rtol=1e-5)
    (g,) = torch.autograd.grad(out.loss, prompt_of(ours))
    (g_ref,) = torch.autograd.grad(ref_out.loss, ref.prompt_encoder["default"].embedding.weight)
    assert rel(g, g_ref) <= 1e-4


def test_no_prompt_position_runs_per_row(make_peft):
    # The LM head sees the text's rows and, once, the last prompt position: no per-row logits at the prompt.
    model = make_peft(num_virtual_tokens=N, forward_path="shared_kv")
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    ids = random_ids(3, 7)
    model(input_ids=ids, labels=ids)
    width = model.config.n_embd
    assert sorted(seen) == [(1, width), (3, 7, width)]


def test_a_custom_loss_function_runs_the_last_prompt_position_in_the_text_pass(make_base, make_peft):
    # The once-for-all first-token term assumes ForCausalLMLoss's `sum / num_items_in_batch`. Any other loss (this
    # one always averages) gets the last prompt position with the text, so it sees every prediction, as in PEFT.
    def mean_only(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels, vocab_size)

    base, ref_base = make_base(), make_base()
    base.loss_function = ref_base.loss_function = mean_only
    ours = make_peft(base=base, num_virtual_tokens=N, forward_path="shared_kv")
    ref = prompt_tuning_reference(ref_base, prompt_of(ours))
    ids = random_ids(2, 6)
    torch.testing.assert_close(ours(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)


_KERNEL_MODULES = {
    "sdpa": "peft_softprompt_plus.forward.attention.sdpa_attention_forward",
    "eager": "transformers.models.gpt2.modeling_gpt2.eager_attention_forward",
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_prompt_mask_is_built_once_per_forward(make_base, make_peft, attn, monkeypatch):
    # Every layer's kernel gets the same mask object, in the form both kernels take without converting it per call:
    # additive [B, 1, L, N+L] in the query's dtype, each row 16-element aligned (a view of a padded buffer), and for
    # sdpa none at all on unpadded rows (the lower-right causal bias, forward/kernels.py).
    module_name, _, fn_name = _KERNEL_MODULES[attn].rpartition(".")
    module = importlib.import_module(module_name)
    kernel, seen = getattr(module, fn_name), []

    def spy(mod, query, key, value, mask, **kwargs):
        seen.append(mask)
        return kernel(mod, query, key, value, mask, **kwargs)

    base = make_base()
    base.set_attn_implementation(attn)
    shared = make_peft(base=base, forward_path="shared_kv").eval()
    assert shared.config._attn_implementation == f"softprompt_plus_{attn}"
    concat = make_peft(forward_path="concat").eval()
    monkeypatch.setattr(module, fn_name, spy)
    ids = random_ids(3, 7)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    for attention_mask, shape in ((None, (3, 1, 7, 12)), (mask, (3, 1, 7, 12))):
        seen.clear()
        got = shared(input_ids=ids, attention_mask=attention_mask).logits
        text_layers = [m for m in seen if m is not None and m.shape[-1] == 12]
        want = concat(input_ids=ids, attention_mask=attention_mask).logits
        real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
        if attn == "sdpa" and attention_mask is None:
            assert text_layers == [] and shared.base_model.forward_state.last_kernels == {"sdpa_lower_right"}
            continue
        assert len(text_layers) == 2 and text_layers[0] is text_layers[1]  # built once, read by both layers
        assert tuple(text_layers[0].shape) == shape
        assert text_layers[0].dtype == torch.float32
        assert text_layers[0].stride()[-2] % 16 == 0 and text_layers[0].stride()[-2] >= 12


@pytest.mark.parametrize("name", ["activation", "gradient"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_shared_kv_under_gradient_checkpointing_equals_concat(make_base, make_peft, reentrant, name):
    # Checkpointing no longer turns the fast path off: the prompt reaches each layer as a forward keyword, which the
    # recomputation sees too; reentrant checkpointing hands its gradients back through a node at the text's input.
    # Both of transformers' names turn it on (`activation_*` from 5.24; `gradient_*` before, deprecated since).
    if name == "activation" and not HAS_NEW_NAMES:
        pytest.skip("transformers < 5.24 has no activation_checkpointing_enable")
    base = make_base()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name's deprecation on 5.24+, not ours
        getattr(base, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": reentrant}})
    assert all(layer.gradient_checkpointing for layer in base.transformer.h)
    shared = make_peft(base=base, forward_path="shared_kv").train()
    concat = make_peft(forward_path="concat").train()
    ids = random_ids(3, 7, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = shared(input_ids=ids, attention_mask=mask, labels=labels)
    ref = concat(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    assert rel(prompt_of(shared).grad, prompt_of(concat).grad) <= 1e-5


def test_too_long_is_refused_before_the_model_fails(make_peft):
    model = make_peft(num_virtual_tokens=10)  # tiny GPT-2 has n_positions=128
    with pytest.raises(ValueError, match=r"N=10.*L=119.*has 128 positions"):
        model(input_ids=random_ids(1, 119))
    model(input_ids=random_ids(1, 118))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one of `input_ids` and `inputs_embeds`"),
        ({"input_ids": "ids", "inputs_embeds": "embeds"}, "exactly one"),
        ({"input_ids": "ids", "position_ids": "ids"}, "`position_ids`"),
        ({"input_ids": "ids", "attention_mask": "bad_mask"}, r"`attention_mask` must have shape \[2, 4\]"),
    ],
)
def test_bad_forward_inputs(make_peft, kwargs, match):
    model = make_peft()
    ids = random_ids(2, 4)
    values = {"ids": ids, "embeds": model.get_input_embeddings()(ids), "bad_mask": torch.ones(2, 5, dtype=torch.long)}
    with pytest.raises(ValueError, match=match):
        model(**{k: values[v] for k, v in kwargs.items()})


@pytest.mark.parametrize("forward_path", ["shared_kv", "concat"])
def test_sequence_classification_pools_last_real_token(make_peft, forward_path):
    model = make_peft(task_type="SEQ_CLS", forward_path=forward_path).eval()
    ids = random_ids(1, 5, seed=7)
    alone = model(input_ids=ids).logits  # [1, C]
    pad = torch.ones(1, 2, dtype=torch.long)  # pad id 1
    right = model(input_ids=torch.cat([ids, pad], 1), attention_mask=torch.tensor([[1] * 5 + [0] * 2])).logits
    left = model(input_ids=torch.cat([pad, ids], 1), attention_mask=torch.tensor([[0] * 2 + [1] * 5])).logits
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=1e-5)
    out = model(input_ids=ids, labels=torch.tensor([1]))
    assert out.loss is not None and out.logits.shape == (1, model.config.num_labels)


def test_sequence_classification_fixes_peft_right_padding(make_base, make_peft):
    """PEFT prompt tuning pools index -1 (a pad) under right padding; ours equals the unpadded row."""
    ours = make_peft(task_type="SEQ_CLS").eval()
    ref = peft_reference(make_base, ours, task="SEQ_CLS").eval()
    ref.base_model.score.modules_to_save["default"].load_state_dict(
        ours.base_model.model.score.modules_to_save["default"].state_dict()
    )
    ids = random_ids(1, 5, seed=7)
    padded = torch.cat([ids, torch.ones(1, 2, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 5 + [0] * 2])
    torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref(input_ids=padded, attention_mask=mask).logits, ref(input_ids=ids).logits, atol=1e-3)
    torch.testing.assert_close(
        ours(input_ids=padded, attention_mask=mask).logits, ours(input_ids=ids).logits, atol=1e-5, rtol=1e-5
    )


def test_labels_that_are_all_ignored_give_a_zero_loss(make_peft):
    # Nothing to predict: a zero loss (and a zero gradient), where the base model's mean over no tokens is NaN.
    model = make_peft(forward_path="shared_kv").train()
    ids = random_ids(2, 5)
    loss = model(input_ids=ids, labels=torch.full_like(ids, -100)).loss
    assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, prompt_of(model))
    assert torch.equal(grad, torch.zeros_like(grad))


def test_token_type_ids_type_the_text_on_the_attention_path(make_base, make_peft):
    # GPT-2 adds wte(token_type_ids) to each text position; the prompt positions have no type.
    model = make_peft(forward_path="shared_kv").eval()
    ids, types = random_ids(2, 5), random_ids(2, 5, seed=7)
    base = make_base()
    embeds = base.get_input_embeddings()(ids) + base.get_input_embeddings()(types)  # what GPT-2 itself adds
    with torch.no_grad():
        typed = model(input_ids=ids, token_type_ids=types).logits
        folded = model(inputs_embeds=embeds).logits
    torch.testing.assert_close(typed, folded, atol=1e-5, rtol=1e-5)
    concat = make_peft(forward_path="concat")
    with pytest.raises(ValueError, match="`token_type_ids` needs the prompt at the attention"):
        concat(input_ids=ids, token_type_ids=types)
