"""The flash path (forward/flash.py, attention.py's `_flash_function`) on a CPU: a pure-torch stand-in for the
flash-attn package's two kernels, written from flash-attn's documented semantics (causal aligned to the lower right,
a left window, soft-capping, GQA, varlen sequences by cumulative lengths), checks our unpadding, indices and alignment
against the concatenation reference. The real kernels are checked on a device (bench/cuda_check.py)."""

import sys
import types

import pytest
import torch
from _versions import checkpointing_on
from peft import get_peft_model
from test_families import CONCAT_ONLY, VOCAB, N, assert_equals_reference
from transformers.modeling_utils import PreTrainedModel

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_family
from peft_softprompt_plus.forward import flash


def _one(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, dropout_p=0.0):
    """One sequence: `q` `[Sq, H, hd]`, `k`/`v` `[Sk, Hkv, hd]` -> `[Sq, H, hd]`."""
    assert dropout_p == 0.0
    heads, length_q, length_k = q.shape[1], q.shape[0], k.shape[0]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * (softmax_scale or q.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(length_q)[:, None] + (length_k - length_q)  # each query's index among the keys (lower right)
    j = torch.arange(length_k)[None]
    allowed = (j <= i) if causal else torch.ones(length_q, length_k, dtype=torch.bool)
    if window_size[0] >= 0:
        allowed = allowed & (i - j <= window_size[0])
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v.double()).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    options = (softmax_scale, causal, window_size, softcap, dropout_p)
    return torch.stack([_one(*rows, *options) for rows in zip(q, k, v, strict=True)])


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0,
):  # fmt: skip
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    out = []
    for b in range(len(cu_seqlens_q) - 1):
        qs, ks = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1]), slice(cu_seqlens_k[b], cu_seqlens_k[b + 1])
        assert qs.stop - qs.start <= max_seqlen_q and ks.stop - ks.start <= max_seqlen_k
        out.append(_one(q[qs], k[ks], v[ks], softmax_scale, causal, window_size, softcap, dropout_p))
    return torch.cat(out)


@pytest.fixture
def flash_attn(monkeypatch):
    """flash-attn as if installed: the stand-in module, and transformers accepting `flash_attention_2` on a CPU."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_func, module.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    check = PreTrainedModel._check_and_adjust_attn_implementation

    def accept(self, implementation, *args, **kwargs):
        return implementation if implementation in flash.LIBRARIES else check(self, implementation, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "_check_and_adjust_attn_implementation", accept)
    return module


FLASH_FAMILIES = sorted(f for f in FAMILIES if f not in CONCAT_ONLY and tiny_family(f, VOCAB)._supports_flash_attn)


def _flash_model(family, adapters=("default",)):
    base = tiny_family(family, VOCAB)
    base.set_attn_implementation("flash_attention_2")
    model = get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0))
    for name in adapters[1:]:
        model.add_adapter(name, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N - 2, init_seed=1))
    return model


def _batch(padded: bool, seed=0):
    ids = torch.randint(2, VOCAB, (3, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        mask[2, :1] = 0
    return ids, mask


def test_the_stand_in_is_the_documented_kernel():
    # Lower-right causal alignment, checked on numbers small enough to read: 1 query over 3 keys sees all 3.
    q, k = torch.zeros(1, 1, 1, 2), torch.zeros(1, 3, 1, 2)
    v = torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1).expand(1, 3, 1, 2)
    assert flash_attn_func(q, k, v, causal=True)[0, 0, 0, 0].item() == pytest.approx(2.0)
    assert flash_attn_func(q, k, v, causal=True, window_size=(0, 0))[0, 0, 0, 0].item() == pytest.approx(3.0)


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", FLASH_FAMILIES)
def test_flash_equals_the_concatenation(flash_attn, family, padded, checkpointing):
    model = _flash_model(family)
    assert model.config._attn_implementation == "softprompt_plus_fa2"  # the model keeps flash while attached
    prompt = model.base_model.prompt("default")
    ids, mask = _batch(padded)
    if checkpointing:
        checkpointing_on(model.get_base_model(), reentrant=False)
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert model.base_model.forward_state.last_kernels == {"flash_varlen" if padded else "flash"}
    assert_equals_reference(logits, prompt, tiny_family(family, VOCAB), ids, mask)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_per_row_prompts_run_varlen_and_equal_each_row_alone(flash_attn, family):
    model = _flash_model(family, adapters=("default", "short"))
    ids, mask = _batch(padded=True, seed=1)
    names = ["short", "__base__", "default"]
    with torch.no_grad():
        mixed = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        assert model.base_model.forward_state.last_kernels == {"flash_varlen"}
        for row, name in enumerate(names):
            one = dict(input_ids=ids[row : row + 1], attention_mask=mask[row : row + 1])
            if name == "__base__":  # the base model itself (transformers' own flash needs the real package)
                positions = (one["attention_mask"].cumsum(1) - 1).clamp(min=0)  # real tokens counted, as ours
                alone = tiny_family(family, VOCAB)(**one, position_ids=positions).logits
            else:
                model.set_adapter(name)
                alone = model(**one).logits
            real = mask[row].bool()
            torch.testing.assert_close(mixed[row][real], alone[0][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_generate_with_flash_equals_generate_with_sdpa(flash_attn, family):
    model = _flash_model(family)
    reference = get_peft_model(
        tiny_family(family, VOCAB), SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0)
    )
    ids, mask = _batch(padded=True, seed=2)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, **options)
        want = reference.generate(input_ids=ids, attention_mask=mask, **options)
    assert got.tolist() == want.tolist()


def test_unload_and_disable_hand_flash_back(flash_attn):
    model = _flash_model("llama")
    with model.disable_adapter():
        assert model.config._attn_implementation == "flash_attention_2"
    assert model.config._attn_implementation == "softprompt_plus_fa2"
    assert model.unload().config._attn_implementation == "flash_attention_2"


def test_without_the_package_flash_models_run_sdpa(monkeypatch, flash_attn, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    assert flash.library_for("flash_attention_2") is None
    model = _flash_model("llama")
    assert model.config._attn_implementation == "softprompt_plus_sdpa"
    with torch.no_grad():
        model(input_ids=_batch(False)[0])
    assert model.base_model.forward_state.last_kernels == {"sdpa_lower_right"}


def test_a_kernel_without_an_option_it_needs_is_refused_by_name():
    def fa3_style(q, k, v, softmax_scale=None, causal=False):  # FA3 takes no dropout_p and returns (out, lse)
        return q, None

    q = torch.zeros(1, 2, 1, 4)
    assert flash._call(fa3_style, q, q, q, causal=True, softmax_scale=None) is q
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash._call(fa3_style, q, q, q, causal=True, dropout_p=0.1)


def test_a_concatenated_forward_runs_flash_without_switching_the_model(flash_attn, monkeypatch):
    """`forward_path='concat'` (and `auto`'s GPU training step) runs `[prompt; text]` through the flash package's dense
    kernel, with the prompt as ordinary positions, and never switches the model's implementation (which every thread
    calling the model reads): it names our kernel throughout the call."""
    base = tiny_family("llama", VOCAB)
    base.set_attn_implementation("flash_attention_2")
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0, forward_path="concat")
    model = get_peft_model(base, config)
    seen = []

    def dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        seen.append((q.shape[1], base.config._attn_implementation))
        return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap)

    monkeypatch.setattr(flash_attn, "flash_attn_func", dense)
    ids = _batch(False)[0]
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert seen and set(seen) == {(N + ids.shape[1], "softprompt_plus_fa2")}  # every query of [prompt; text]
    reference = get_peft_model(tiny_family("llama", VOCAB), SoftPromptPlusConfig(num_virtual_tokens=N, init_seed=0))
    with torch.no_grad():
        torch.testing.assert_close(got, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_kv_prompt_on_a_flash_model_reads_through_our_sdpa(flash_attn, caplog):
    """A KV prompt can't concatenate (transformers' own flash), and our flash path is checked on this stand-in only:
    from the first KV adapter on, the model reads every prompt through our sdpa, and says so once."""
    from peft_softprompt_plus.forward import attention

    model = _flash_model("llama")
    assert model.config._attn_implementation == "softprompt_plus_fa2"
    attention.log_once.cache_clear()  # it logs once per process
    with caplog.at_level("WARNING"):
        model.add_adapter("kv", SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv", init_seed=0))
    assert model.config._attn_implementation == "softprompt_plus_sdpa"
    assert "reads its keys/values through our sdpa" in caplog.text
    reference = get_peft_model(tiny_family("llama", VOCAB), SoftPromptPlusConfig(num_virtual_tokens=N, init_seed=0))
    reference.add_adapter("kv", SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv", init_seed=0))
    ids, mask = _batch(True)
    with torch.no_grad():
        for name in ("default", "kv"):
            got = model(input_ids=ids, attention_mask=mask, adapter_names=[name] * ids.shape[0]).logits
            want = reference(input_ids=ids, attention_mask=mask, adapter_names=[name] * ids.shape[0]).logits
            torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    assert model.unload().config._attn_implementation == "flash_attention_2"
