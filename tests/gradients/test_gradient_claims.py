"""The claims that circulate about soft-prompt gradients, each settled on a tiny GPT-2 (see docs/gradient-flow.md).

Every test builds the user-code pattern a claim is about, shows what autograd really does (grad None, zero, or equal
to a reference), and, where the pattern is a bug, that `check_gradient_flow` names it with the right code.
"""

import pytest
import torch
from _versions import CACHE, cache_of
from conftest import random_ids
from torch import nn

from peft_softprompt_plus import GradientFlowWarning, check_gradient_flow

N, D = 4, 64  # virtual tokens, tiny GPT-2 width


def _frozen(make_base, **overrides):
    base = make_base(**overrides)
    base.requires_grad_(False)
    return base


def _concat_loss(gpt2, prompt, ids):
    """Hand-written prompt tuning: `[prompt; wte(ids)]` through GPT-2, the prompt positions unlabeled."""
    text = gpt2.transformer.wte(ids)  # [B, L, D]
    embeds = torch.cat([prompt.to(text.dtype).expand(len(ids), -1, -1), text], dim=1)  # [B, N+L, D]
    labels = torch.cat([torch.full((len(ids), len(prompt)), -100), ids], dim=1)  # [B, N+L]
    return gpt2(inputs_embeds=embeds, labels=labels).loss


class _UserModel(nn.Module):
    """A user's own soft-prompt module; `enter(prompt)` is how their code turns the prompt into what GPT-2 sees."""

    def __init__(self, gpt2, prompt, enter=lambda p: p):
        super().__init__()
        self.gpt2, self.prompt, self.enter = gpt2, prompt, enter

    def forward(self, input_ids, labels=None):
        return {"loss": _concat_loss(self.gpt2, self.enter(self.prompt), input_ids)}


def _grad(loss, tensor):
    return torch.autograd.grad(loss, [tensor], allow_unused=True)[0]


def _batch(batch=2, length=5):
    ids = random_ids(batch, length)
    return {"input_ids": ids, "labels": ids}


# ------------------------------------------------------------------ past_key_values / use_cache


def test_cache_carries_the_gradient(make_base):
    gpt2, ids = _frozen(make_base), random_ids(1, 5)
    prompt = nn.Parameter(torch.randn(N, D) * 0.02)
    cache = cache_of(gpt2.transformer(inputs_embeds=prompt[None], use_cache=True))  # the prompt's keys/values
    positions = torch.arange(N, N + ids.shape[1])[None]  # [1, L]
    logits = gpt2(input_ids=ids, **{CACHE: cache}, position_ids=positions).logits  # [1, L, V]
    loss = nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    via_cache = _grad(loss, prompt)
    text = gpt2.transformer.wte(ids)
    logits = gpt2(inputs_embeds=torch.cat([prompt[None], text], 1)).logits[:, N:]  # [1, L, V]
    via_concat = _grad(nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]), prompt)
    assert via_cache is not None and via_cache.abs().sum() > 0
    torch.testing.assert_close(via_cache, via_concat, rtol=1e-4, atol=1e-7)


def test_cache_built_under_no_grad_cuts_the_gradient(make_base):
    class CachedUnderNoGrad(nn.Module):  # the real bug behind the claim: a prefix cache computed once, without grad
        def __init__(self):
            super().__init__()
            self.gpt2, self.prompt = _frozen(make_base), nn.Parameter(torch.randn(N, D) * 0.02)

        def forward(self, input_ids, labels):
            with torch.no_grad():
                cache = cache_of(self.gpt2.transformer(inputs_embeds=self.prompt[None], use_cache=True))
            cache.batch_repeat_interleave(len(input_ids))
            positions = torch.arange(N, N + input_ids.shape[1]).expand(len(input_ids), -1)
            return self.gpt2(input_ids=input_ids, **{CACHE: cache}, position_ids=positions, labels=labels)

    model = CachedUnderNoGrad()
    report = check_gradient_flow(model, _batch(), prompt=model.prompt)
    assert report.codes == ["unreachable"] and "runs it without autograd" in str(report)


def test_shared_kv_path_equals_concatenation(make_base, make_peft):
    grads = []
    for path in ("shared_kv", "concat"):
        model = make_peft(base=make_base(), forward_path=path)
        prompt = model.base_model.prompt("default")
        grads.append(_grad(model(**_batch()).loss, prompt))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ slicing, clone, detach


def test_slicing_and_clone_keep_the_gradient(make_base):
    gpt2, ids = _frozen(make_base), random_ids(2, 5)
    prompt = nn.Parameter(torch.randn(N + 2, D) * 0.02)
    sliced = _grad(_concat_loss(gpt2, prompt[:N], ids), prompt)
    assert (sliced[:N].abs().sum(dim=1) > 0).all() and (sliced[N:] == 0).all()  # only the rows used
    direct = _grad(_concat_loss(gpt2, prompt, ids), prompt)
    cloned = _grad(_concat_loss(gpt2, prompt.clone(), ids), prompt)
    torch.testing.assert_close(cloned, direct, rtol=0, atol=0)


def test_detach_or_data_cuts_the_gradient(make_base):
    for enter in (lambda p: p.detach(), lambda p: p.data):
        model = _UserModel(_frozen(make_base), nn.Parameter(torch.randn(N, D) * 0.02), enter)
        assert check_gradient_flow(model, _batch(), prompt=model.prompt).codes == ["unreachable"]


def test_parameter_from_a_wte_slice_edits_the_tied_lm_head(make_base):
    gpt2 = _frozen(make_base)
    prompt = nn.Parameter(gpt2.transformer.wte.weight[:N])  # no clone: a view of wte, itself lm_head
    lm_head_before = gpt2.lm_head.weight.detach().clone()
    report = check_gradient_flow(_UserModel(gpt2, prompt), _batch(), prompt=prompt)
    assert report.codes == ["aliases_base_weights"] and "lm_head.weight" in str(report)
    optimizer = torch.optim.SGD([prompt], lr=1.0)
    _concat_loss(gpt2, prompt, random_ids(2, 5)).backward()
    optimizer.step()
    assert not torch.equal(gpt2.lm_head.weight, lm_head_before)  # the "prompt" step edited the output layer


# ------------------------------------------------------------------ input_ids, inputs_embeds


def test_learnable_tokens_cannot_ride_in_input_ids(make_base):
    class SoftIds(nn.Module):  # "learnable tokens" concatenated to the integer ids
        def __init__(self):
            super().__init__()
            self.gpt2, self.ids = _frozen(make_base), nn.Parameter(torch.rand(N) * 200 + 2)

        def forward(self, input_ids, labels):
            ids = torch.cat([self.ids.long().expand(len(input_ids), -1), input_ids], dim=1)  # [B, N+L] int64
            return self.gpt2(input_ids=ids, labels=torch.cat([torch.full((len(ids), N), -100), labels], 1))

    model = SoftIds()
    assert not model.ids.long().requires_grad  # integers carry no gradient
    assert check_gradient_flow(model, _batch(), prompt=model.ids).codes == ["unreachable"]


def test_training_new_token_rows_trains_the_whole_tied_matrix(make_base):
    gpt2 = make_base()
    gpt2.requires_grad_(False)
    gpt2.transformer.wte.weight.requires_grad_(True)  # "train the new tokens' embeddings"
    assert gpt2.lm_head.weight.requires_grad  # the same Parameter: the output layer trains too
    prompt = nn.Parameter(torch.randn(N, D) * 0.02)
    report = check_gradient_flow(_UserModel(gpt2, prompt), _batch(), prompt=prompt)
    assert report.codes == ["base_trainable"] and "tied to" in str(report)


def test_transformers_uses_inputs_embeds_in_the_graph(make_base):
    gpt2, ids = _frozen(make_base), random_ids(2, 5)
    seen = {}

    def keep(module, args, output):
        output.retain_grad()
        seen["embeds"] = output

    handle = gpt2.transformer.wte.register_forward_hook(keep)
    gpt2.transformer.wte.weight.requires_grad_(True)  # so the id path records a graph at all
    gpt2(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    embeds = gpt2.transformer.wte(ids).detach().requires_grad_(True)
    (via_embeds,) = torch.autograd.grad(gpt2(inputs_embeds=embeds, labels=ids).loss, [embeds])
    torch.testing.assert_close(via_embeds, seen["embeds"].grad, rtol=0, atol=0)  # used as is: no copy, no detach


def test_inputs_embeds_input_gives_the_same_prompt_gradient(make_peft):
    model = make_peft()
    prompt, batch = model.base_model.prompt("default"), _batch()
    via_ids = _grad(model(**batch).loss, prompt)
    embeds = model.base_model.model.transformer.wte(batch["input_ids"])
    via_embeds = _grad(model(inputs_embeds=embeds, labels=batch["labels"]).loss, prompt)
    assert via_ids.abs().sum() > 0
    torch.testing.assert_close(via_embeds, via_ids, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ no_grad, generate, optimizer


def test_no_grad_records_no_graph(make_peft):
    model = make_peft().train()
    with torch.no_grad(), pytest.warns(GradientFlowWarning, match=r"\[grad_disabled\]"):
        loss = model(**_batch()).loss
    with torch.no_grad():
        report = check_gradient_flow(model, _batch())
    assert not loss.requires_grad and report.codes == ["grad_disabled"]


def test_generate_runs_without_gradients(make_peft):
    model = make_peft()
    modes = []
    handle = model.base_model.model.register_forward_pre_hook(lambda m, a: modes.append(torch.is_grad_enabled()))
    out = model.generate(input_ids=random_ids(1, 3), max_new_tokens=2, do_sample=False)
    handle.remove()
    assert modes and not any(modes)
    assert out.dtype == torch.long and not out.requires_grad


def test_optimizer_without_the_prompt_never_moves_it(make_peft):
    model = make_peft()
    prompt = model.base_model.prompt("default")
    before = prompt.detach().clone()
    optimizer = torch.optim.SGD([model.base_model.model.transformer.wpe.weight], lr=1.0)  # forgot the prompt
    model(**_batch()).loss.backward()
    optimizer.step()
    assert prompt.grad.abs().sum() > 0 and torch.equal(prompt, before)  # a gradient, and no update
    prompt.grad = None
    assert check_gradient_flow(model, _batch(), optimizer).codes == ["not_in_optimizer"]


# ------------------------------------------------------------------ weight tying, freezing


def _prompt_grad(model, batch):
    return _grad(model(**batch).loss, model.base_model.prompt("default"))


def test_weight_tying_does_not_touch_the_prompt_gradient(make_base, make_peft):
    batch = _batch()
    tied = make_peft(base=make_base())
    untied_base = make_base()
    untied_base.lm_head.weight = nn.Parameter(untied_base.lm_head.weight.detach().clone())
    untied_base.config.tie_word_embeddings = False
    untied = make_peft(base=untied_base)
    assert untied.base_model.model.lm_head.weight is not untied.base_model.model.transformer.wte.weight
    torch.testing.assert_close(_prompt_grad(untied, batch), _prompt_grad(tied, batch), rtol=0, atol=0)


def test_freezing_the_embedding_changes_nothing_for_the_prompt(make_peft):
    model, batch = make_peft(), _batch()
    wte = model.base_model.model.transformer.wte.weight
    assert not wte.requires_grad  # attaching already froze it
    frozen = _prompt_grad(model, batch)
    wte.requires_grad_(True)
    torch.testing.assert_close(_prompt_grad(model, batch), frozen, rtol=0, atol=0)
    assert check_gradient_flow(model, batch).codes == ["base_trainable"]  # unfrozen only costs memory and risk


# ------------------------------------------------------------------ dtype, device, fp16


def test_dtype_and_device_casts_keep_the_gradient(make_base):
    gpt2, ids = _frozen(make_base), random_ids(2, 5)
    prompt = nn.Parameter(torch.randn(N, D, dtype=torch.float64) * 0.02)
    grad = _grad(_concat_loss(gpt2, prompt.to(torch.float32), ids), prompt)  # cast at the point of use
    assert grad.dtype == torch.float64 and grad.abs().sum() > 0
    assert prompt.to("cpu") is prompt  # a move to where it already is copies nothing
    with pytest.raises(RuntimeError):  # a real mismatch is loud, not silent
        gpt2(inputs_embeds=torch.randn(1, 3, D, dtype=torch.float64))


def test_a_cast_before_wrapping_loses_the_leaf(make_base):
    prompt = nn.Parameter(torch.randn(N, D, dtype=torch.float64) * 0.02).to(torch.float32)  # or `.cuda()`
    model = _UserModel(_frozen(make_base), prompt)
    assert not prompt.is_leaf and list(model.parameters(recurse=False)) == []
    assert check_gradient_flow(model, _batch(), prompt=prompt).codes == ["non_leaf_prompt"]


def test_fp16_prompt_loses_updates_and_gradscaler_refuses_it():
    value = torch.tensor(1.0, dtype=torch.float16)
    assert value + 1e-4 == value  # an update below fp16 resolution at 1.0 (~1e-3) vanishes
    prompt = nn.Parameter(torch.ones(N, D, dtype=torch.float16))
    optimizer, scaler = torch.optim.SGD([prompt], lr=1e-3), torch.amp.GradScaler("cpu")
    scaler.scale((prompt.float() * 2).sum()).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(optimizer)


def test_fp32_prompt_on_an_fp16_model_trains(make_base, make_peft):
    model = make_peft(base=make_base().half())
    prompt = model.base_model.prompt("default")
    assert prompt.dtype == torch.float32
    before = prompt.detach().clone()
    optimizer, scaler = torch.optim.SGD([prompt], lr=1e-2), torch.amp.GradScaler("cpu")
    scaler.scale(model(**_batch(batch=1, length=3)).loss).backward()
    assert prompt.grad.dtype == torch.float32 and prompt.grad.abs().sum() > 0
    scaler.step(optimizer)
    assert not torch.equal(prompt, before)


# ------------------------------------------------------------------ no_grad at init, loss handling, addition


def test_parameters_made_under_no_grad_still_require_grad(make_base):
    with torch.no_grad():
        param = nn.Parameter(torch.randn(N, D) * 0.02)
        computed = torch.randn(N, D, requires_grad=True) * 0.02  # the real trap: an op result, not a Parameter
    assert param.requires_grad and not computed.requires_grad
    model = _UserModel(_frozen(make_base), computed)
    assert check_gradient_flow(model, _batch(), prompt=computed).codes == ["prompt_frozen"]


def test_detach_or_numpy_on_the_loss_or_logits_cuts_it(make_peft):
    model = make_peft()

    def from_detached_logits(outputs, batch):
        logits = outputs.logits.detach()[:, :-1]  # [B, L-1, V]
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())

    assert check_gradient_flow(model, _batch(), loss_fn=from_detached_logits).codes == ["loss_without_graph"]
    assert check_gradient_flow(model, _batch(), loss_fn=lambda o, b: o.loss.item()).codes == ["loss_without_graph"]
    with pytest.raises(RuntimeError, match="Can't call numpy"):  # numpy without detach is refused outright
        model(**_batch()).loss.numpy()


def test_adding_the_prompt_reaches_it_but_is_another_model(make_base):
    gpt2, ids = _frozen(make_base), random_ids(2, N)  # addition forces L == N
    prompt = nn.Parameter(torch.randn(N, D) * 0.02)
    text = gpt2.transformer.wte(ids).detach().requires_grad_(True)  # [B, N, D]
    loss = gpt2(inputs_embeds=text + prompt, labels=ids).loss
    grad_prompt, grad_text = torch.autograd.grad(loss, [prompt, text])
    torch.testing.assert_close(grad_prompt, grad_text.sum(dim=0), rtol=1e-5, atol=1e-8)  # reaches: the batch sum
    concat = _concat_loss(gpt2, prompt, ids)
    assert not torch.allclose(loss, concat)  # but it is a different model from prompt tuning
    with pytest.raises(RuntimeError):
        gpt2.transformer.wte(random_ids(2, N + 1)) + prompt  # and it cannot take any other text length
