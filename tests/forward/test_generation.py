"""generate() (generation.py): a manual greedy loop as reference, and batched/cache invariants."""

import pytest
import torch
from _versions import cache_of
from conftest import random_ids


def manual_greedy(model, ids, new_tokens):
    """The reference: no cache, argmax of the full prompted forward, one token at a time."""
    cur = ids
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(input_ids=cur).logits[:, -1].argmax(-1, keepdim=True)
            cur = torch.cat([cur, nxt], dim=1)
    return cur


@pytest.fixture
def model(make_base, make_peft):
    # A random GPT-2 at the default init is nearly the identity map (greedy repeats the last token); a wider init
    # gives it real attention, so the tests below can tell a right prompt from a wrong one.
    model = make_peft(base=make_base(initializer_range=0.5), num_virtual_tokens=6).eval()
    with torch.no_grad():  # a loud prompt, so that getting it wrong anywhere changes the tokens
        model.base_model.prompt("default").normal_(0.0, 1.0)
    return model


def test_greedy_equals_manual_loop(model):
    ids = random_ids(3, 5, seed=11)
    out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    assert out.shape == (3, 15)
    assert torch.equal(out[:, :5], ids)  # the input ids, then the new tokens: no virtual positions
    for row in range(3):
        assert torch.equal(out[row], manual_greedy(model, ids[row : row + 1], 10)[0])


def test_greedy_differs_from_base_model(model):
    """The prompt really is in effect during generation (a guard against silently generating without it)."""
    ids = random_ids(4, 5, seed=12)
    ours = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    with model.disable_adapter():
        base = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert not torch.equal(ours, base)


def test_cache_on_equals_cache_off(model):
    ids = random_ids(2, 5, seed=13)
    on = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, use_cache=True)
    off = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(on, off)


def test_left_padded_batch_equals_unbatched(model):
    short, long = random_ids(1, 3, seed=14), random_ids(1, 6, seed=15)
    batch = torch.cat([torch.cat([torch.ones(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=1)
    assert torch.equal(out[0, 3:], model.generate(input_ids=short, max_new_tokens=7, do_sample=False)[0])
    assert torch.equal(out[1], model.generate(input_ids=long, max_new_tokens=7, do_sample=False)[0])


def test_beam_search_batched_equals_unbatched(model):
    ids = random_ids(2, 4, seed=16)
    batched = model.generate(input_ids=ids, max_new_tokens=5, num_beams=3, do_sample=False)
    for row in range(2):
        single = model.generate(input_ids=ids[row : row + 1], max_new_tokens=5, num_beams=3, do_sample=False)
        assert torch.equal(batched[row], single[0])


def test_beam_search_cache_on_equals_off(model):
    ids = random_ids(1, 4, seed=17)
    kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False)
    assert torch.equal(
        model.generate(input_ids=ids, **kwargs), model.generate(input_ids=ids, use_cache=False, **kwargs)
    )


def test_sampling_is_seeded_and_cache_independent(model):
    ids = random_ids(2, 4, seed=18)
    kwargs = dict(max_new_tokens=6, do_sample=True, top_k=20, num_return_sequences=2)
    torch.manual_seed(3)
    a = model.generate(input_ids=ids, **kwargs)
    torch.manual_seed(3)
    b = model.generate(input_ids=ids, use_cache=False, **kwargs)
    assert a.shape == (4, 10)
    assert torch.equal(a, b)


def test_default_and_explicit_lengths_match_base(model):
    ids = random_ids(1, 4, seed=19)
    with model.disable_adapter():
        base_default, base_max = model.generate(input_ids=ids), model.generate(input_ids=ids, max_length=9)
    assert model.generate(input_ids=ids).shape == base_default.shape
    assert model.generate(input_ids=ids, max_length=9).shape == base_max.shape == (1, 9)


def test_return_dict_looks_like_the_base_models(model):
    # Code written against the base model's `generate` output (fields, per-step scores, the cache) reads ours as is.
    ids = random_ids(1, 4, seed=20)
    kwargs = dict(
        max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    out = model.generate(input_ids=ids, **kwargs)
    with model.disable_adapter():
        base = model.generate(input_ids=ids, **kwargs)
    assert type(out) is type(base) and list(out.keys()) == list(base.keys())
    assert out.sequences.shape == base.sequences.shape == (1, 7)
    assert torch.equal(out.sequences[:, :4], ids) and torch.equal(base.sequences[:, :4], ids)
    for field in ("scores", "logits"):
        assert [step.shape for step in out[field]] == [step.shape for step in base[field]], field
    assert [layer.keys.shape for layer in cache_of(out).layers] == [
        layer.keys.shape for layer in cache_of(base).layers
    ]
    # The same layout, but the prompted model's own scores: greedy picked the tokens they rank first.
    assert torch.equal(torch.stack(out.scores, dim=1).argmax(-1), out.sequences[:, 4:])
    assert not torch.equal(out.sequences, base.sequences)


@pytest.mark.parametrize("num_virtual_tokens", [2, 30])
def test_the_cache_holds_the_text_alone(make_base, make_peft, num_virtual_tokens):
    # Decode steps read the one prompt KV at the attention: a row's cache doesn't grow with N.
    model = make_peft(num_virtual_tokens=num_virtual_tokens).eval()
    ids = random_ids(3, 5, seed=22)
    out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    for layer in cache_of(out).layers:
        assert layer.keys.shape[:3] == (3, model.config.n_head, 5 + 4 - 1)


def test_repetition_penalty_sees_only_the_text(model):
    # No placeholder ids stand in for the prompt, so logits processors that read `input_ids` see what the base
    # model's would: the manual loop applies the same processor to the real ids.
    from transformers import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(1.5)
    ids = random_ids(2, 4, seed=23)
    out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, repetition_penalty=1.5)
    cur = ids
    with torch.no_grad():
        for _ in range(6):
            scores = penalty(cur, model(input_ids=cur).logits[:, -1])
            cur = torch.cat([cur, scores.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, cur)


def test_prompt_kv_is_reused_until_the_prompt_changes(model):
    tuner = model.base_model
    ids = random_ids(1, 4, seed=21)
    first = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    entry = tuner.forward_state.kv_store._entries["default"]
    model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert tuner.forward_state.kv_store._entries["default"] is entry  # reused, not recomputed
    prompt = tuner.prompt("default")
    opt = torch.optim.SGD([prompt], lr=10.0)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    second = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert tuner.forward_state.kv_store._entries["default"] is not entry  # the optimizer step invalidated it
    assert torch.equal(second, manual_greedy(model, ids, 4))
    assert not torch.equal(first, second)


def test_generate_rejects_embeds_and_caches(model):
    ids = random_ids(1, 4)
    with pytest.raises(ValueError, match="`input_ids` is required"):
        model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"would need 133 positions.*N=6.*L=125.*\(2\), but the model has 128"):
        model.generate(input_ids=random_ids(1, 125), max_new_tokens=2)


def test_a_prompt_edited_behind_autograds_back_is_seen(model):
    # `.data` edits (and fused optimizers) change values without bumping the version counter; the store compares the
    # values themselves, for generate and for inference forwards alike.
    ids = random_ids(1, 4, seed=24)
    before = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        logits_before = model(input_ids=ids).logits
    prompt = model.base_model.prompt("default")
    version = prompt._version
    prompt.data.mul_(-1.0)
    assert prompt._version == version
    after = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(after, manual_greedy(model, ids, 4)) and not torch.equal(before, after)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, logits_before)


def test_inference_forwards_reuse_the_stored_prompt_pass(model, monkeypatch):
    from peft_softprompt_plus.forward import paths as forward_paths

    calls = []
    original = forward_paths.prompt_pass
    monkeypatch.setattr(forward_paths, "prompt_pass", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = random_ids(2, 5, seed=25)
    with torch.no_grad():
        first = model(input_ids=ids).logits
        second = model(input_ids=ids, labels=ids)
    assert len(calls) == 1  # computed once, then read from the store
    torch.testing.assert_close(first, second.logits)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, second.loss)  # with grad: a fresh pass
    assert len(calls) == 2


def test_logits_to_keep_without_labels_reads_the_stored_prompt_pass(model, monkeypatch):
    # Distillation scores the last K positions only; trimming the logits must not send the prompt into the text pass.
    from peft_softprompt_plus.forward import paths as forward_paths

    calls = []
    original = forward_paths.prompt_pass
    monkeypatch.setattr(forward_paths, "prompt_pass", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = random_ids(2, 6, seed=26)
    with torch.no_grad():
        full = model(input_ids=ids).logits  # [B, L, V]
        kept = model(input_ids=ids, logits_to_keep=3).logits  # [B, 3, V]
    assert len(calls) == 1  # the second forward read the stored pass
    torch.testing.assert_close(kept, full[:, -3:])
    with_grad = model(input_ids=ids, logits_to_keep=3).logits
    torch.testing.assert_close(with_grad, kept)
