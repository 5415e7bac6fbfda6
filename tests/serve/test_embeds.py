"""serving.py: the embeddings an engine takes (vLLM's `prompt_embeds`, SGLang's `input_embeds`) make the unchanged
base model compute this library's logits and greedy tokens, family by family. The engine itself is stood in for by
the base model fed `inputs_embeds` at default positions `0..N+L-1`, as vLLM and SGLang place an embeddings prompt."""

import base64
import io
import json

import pytest
import torch
from conftest import random_ids
from peft import get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig, prompt_embeds
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_family

N = 4
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]])  # left-padded
# Families with a sliding window (8) shorter than N + L: see test_a_left_padded_batch_moves_the_sliding_window.
SLIDING = sorted(name for name, (_, kwargs) in FAMILIES.items() if kwargs.get("sliding_window"))
GREEDY = dict(max_new_tokens=5, do_sample=False, pad_token_id=1)


def _prompted(family: str, **config):
    config = {"task_type": "CAUSAL_LM", "num_virtual_tokens": N, "init_seed": 3, **config}
    return get_peft_model(tiny_family(family), SoftPromptPlusConfig(**config)).eval()


def _batch():
    return random_ids(3, 7).masked_fill(MASK == 0, 1), MASK


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_base_model_fed_the_embeddings_computes_our_logits_and_tokens(family):
    model, engine = _prompted(family), tiny_family(family)  # the engine: an untouched copy of the base
    ids, mask = _batch()
    rows = prompt_embeds(model, ids, mask)
    embedding = engine.get_input_embeddings()
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
        for b, row in enumerate(rows):
            real = ids[b][mask[b].bool()]  # [L_b]
            # The sequence itself: the prompt as our forward casts it, then the row's token embeddings, no padding.
            assert row.shape == (N + real.shape[0], embedding.embedding_dim) and row.dtype == embedding.weight.dtype
            assert torch.equal(row[:N], model.base_model.prompt_for_use("default"))
            assert torch.equal(row[N:], embedding(real))
            served = engine(inputs_embeds=row[None]).logits[0, N:]  # [L_b, V], positions 0..N+L_b-1
            alone = model(input_ids=real[None]).logits[0]
            torch.testing.assert_close(served, alone, atol=1e-4, rtol=0)
            if family not in SLIDING:
                torch.testing.assert_close(served, batched[b][mask[b].bool()], atol=1e-4, rtol=0)
    generated = model.generate(input_ids=ids, attention_mask=mask, **GREEDY)[:, ids.shape[1] :]  # [B, 5]
    for b, row in enumerate(rows):
        ones = torch.ones(1, row.shape[0], dtype=torch.long)
        served = engine.generate(inputs_embeds=row[None], attention_mask=ones, **GREEDY)[0]  # the new tokens
        real = ids[b][mask[b].bool()][None]
        assert served.tolist() == model.generate(input_ids=real, **GREEDY)[0, real.shape[1] :].tolist()
        if family not in SLIDING:
            assert served.tolist() == generated[b, : served.shape[0]].tolist()


@pytest.mark.parametrize("family", SLIDING)
def test_a_left_padded_batch_leaves_each_sliding_window_where_the_row_alone_has_it(family):
    # docs/serving.md: a sliding-window layer measures the prompt-to-text distance with position ids, which count
    # real tokens only, so a padded row's logits equal the same row alone, which is what an engine computes.
    model, engine = _prompted(family), tiny_family(family)
    ids, mask = _batch()
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).logits
        for b, row in enumerate(prompt_embeds(model, ids, mask)):
            served = engine(inputs_embeds=row[None]).logits[0, N:]
            torch.testing.assert_close(served, batched[b][mask[b].bool()], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_for_an_engine_that_scales_the_embeddings_itself(family):
    # transformers 5 scales Gemma's token embeddings inside the embedding module, and takes `inputs_embeds` as given;
    # vLLM's and SGLang's Gemma-2 multiply `inputs_embeds` by sqrt(hidden size) in the model (docs/serving.md). The
    # stand-in for such an engine: the base fed the sequence times the scale.
    model, engine = _prompted(family), tiny_family(family)
    embedding = engine.get_input_embeddings()
    scale = float(getattr(embedding, "embed_scale", 1.0))
    assert scale == (64**0.5 if family == "gemma2" else 1.0)  # hidden size 64
    ids, mask = _batch()
    rows = prompt_embeds(model, ids, mask, engine_scales_embeddings=True)
    default = prompt_embeds(model, ids, mask)
    with torch.no_grad():
        for b, row in enumerate(rows):
            real = ids[b][mask[b].bool()]
            assert torch.equal(row[N:], embedding.weight[real])  # the raw rows
            served = engine(inputs_embeds=row[None] * scale).logits[0, N:]
            torch.testing.assert_close(served, model(input_ids=real[None]).logits[0], atol=1e-4, rtol=0)
            assert torch.equal(row, default[b]) == (scale == 1.0)  # no scale: the same sequence


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_an_engine_that_scales_the_embeddings_reads_a_residual_adapters_encoded_prompt(family):
    # A residual adapter that was never saved and reloaded still holds its raw prompt and encoder: what the model
    # reads is the encoder's output, and the engine, once it has multiplied by its scale, must read the same.
    model, engine = _prompted(family, reparameterization="residual"), tiny_family(family)
    tuner = model.base_model
    read = tuner.prompt_for_use("default").detach()  # [N, D] what this library's forward feeds the model
    assert not torch.allclose(read, tuner.prompt("default").to(read.dtype), atol=1e-3)  # the encoder moves it
    scale = float(getattr(engine.get_input_embeddings(), "embed_scale", 1.0))
    ids, mask = _batch()
    rows = prompt_embeds(model, ids, mask, engine_scales_embeddings=True)
    with torch.no_grad():
        for b, row in enumerate(rows):
            torch.testing.assert_close(row[:N] * scale, read, atol=1e-5, rtol=1e-5)
            real = ids[b][mask[b].bool()]
            served = engine(inputs_embeds=row[None] * scale).logits[0, N:]
            torch.testing.assert_close(served, model(input_ids=real[None]).logits[0], atol=1e-4, rtol=0)


def test_one_call_many_forms(make_peft):
    model = make_peft(num_virtual_tokens=N)
    model.add_adapter("other", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=2, init_seed=9))
    ids, mask = _batch()
    rows = prompt_embeds(model, ids, mask)
    # The tuner and the PeftModel, one row as 1-D, no mask as all ones: the same tensors.
    assert all(torch.equal(a, b) for a, b in zip(rows, prompt_embeds(model.base_model, ids, mask), strict=True))
    assert torch.equal(prompt_embeds(model, ids[1], mask[1])[0], rows[1])
    assert torch.equal(prompt_embeds(model, ids[1])[0], rows[1])
    # Another adapter's prompt, by name; the active one by default.
    other = prompt_embeds(model, ids[1], adapter_name="other")[0]
    assert other.shape[0] == 2 + 7 and torch.equal(other[:2], model.base_model.prompt("other"))
    assert not rows[0].requires_grad
    # SGLang's JSON `input_embeds`: nested Python floats that come back as the same float32 values.
    listed = prompt_embeds(model, ids, mask, as_list=True)
    back = json.loads(json.dumps(listed))
    assert all(torch.equal(torch.tensor(x, dtype=torch.float32), r) for x, r in zip(back, rows, strict=True))
    # vLLM's server: `torch.save` + base64 in the Completions request's `prompt_embeds`, read back with torch.load.
    buffer = io.BytesIO()
    torch.save(rows[0].cpu(), buffer)
    sent = base64.b64encode(buffer.getvalue()).decode("utf-8")
    assert torch.equal(torch.load(io.BytesIO(base64.b64decode(sent)), weights_only=True), rows[0])


def test_a_low_precision_base_gets_its_own_dtype(make_base):
    base = make_base().to(torch.bfloat16)
    model = get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0))
    (row,) = prompt_embeds(model, random_ids(1, 5))
    assert row.dtype == torch.bfloat16 and model.base_model.prompt("default").dtype == torch.float32
    assert torch.equal(row[:N], model.base_model.prompt("default").to(torch.bfloat16))


def test_a_kv_prompt_is_refused_with_what_serves_it(make_peft):
    model = make_peft(num_virtual_tokens=N)
    model.add_adapter("kv", SoftPromptPlusConfig(num_virtual_tokens=3, prompt_level="kv"))
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"`adapter_name`='kv' is a KV prompt .*Serve it with this library"):
        prompt_embeds(model, ids, mask, adapter_name="kv")
    assert len(prompt_embeds(model, ids, mask)) == ids.shape[0]  # the input adapter beside it still serves
