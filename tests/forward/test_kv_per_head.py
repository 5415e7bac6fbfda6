"""Context tuning with positions chosen per layer and KV head (`kv_selection='per_head'`): leave-one-out and dropout
act per entry (forward/kv_regularize.py, the per-layer masks of forward/prompt_kv.py). The reference is an attention
written here, independent of the package's masks: per layer and query head, the prompt entries the row may read
(the others removed), then the text's own causal keys, at the text's real positions."""

import json

import pytest
import torch
from _versions import checkpointing_on
from peft import get_peft_model
from transformers import AttentionInterface

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import tiny_family
from peft_softprompt_plus.forward import kv_regularize

DEMOS = ["red green blue", "cat dog bird fish", "one two three", "white black horse sheep"]
REFERENCE = "softprompt_plus_test_per_head_reference"


@pytest.fixture
def tok_dir(tiny_model_dir):
    return tiny_model_dir


def _model(tokenizer, tok_dir, n=9, **kw):
    kw = {"kv_selection": "per_head", "kv_frozen_positions": 1, **kw}
    config = SoftPromptPlusConfig(
        prompt_level="kv", prompt_init="demonstrations", prompt_init_texts=DEMOS, num_virtual_tokens=n,
        tokenizer_name_or_path=tok_dir, validate_gradients="off", **kw,
    )  # fmt: skip
    model = get_peft_model(tiny_family("llama", len(tokenizer)), config, adapter_name="demo")
    model.add_adapter("input", SoftPromptPlusConfig(num_virtual_tokens=3, init_seed=1, validate_gradients="off"))
    return model


class _Reference:
    """An attention that reads, per layer and query head, the prompt entries `readable[layer][kv head]` of `values`
    (`[layers, 2, Hkv, N, hd]`) in front of the text's causal keys; one unpadded row."""

    def __init__(self, values: torch.Tensor, readable: torch.Tensor):
        self.values, self.readable = values, readable  # readable: [layers, Hkv, N] bool

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer, (_, heads, q, dim) = module.layer_idx, query.shape
        group = heads // key.shape[1]
        outs = []
        for h in range(heads):
            kv = h // group  # transformers' repeat_kv: query head h reads key/value head h // group
            keep = self.readable[layer, kv]
            keys = torch.cat([self.values[layer, 0, kv][keep], key[0, kv]])  # [n_h + q, hd]
            vals = torch.cat([self.values[layer, 1, kv][keep], value[0, kv]])
            scores = query[0, h] @ keys.T * (scaling if scaling is not None else dim**-0.5)  # [q, n_h + q]
            text = torch.ones(q, q, dtype=torch.bool).tril()
            allowed = torch.cat([torch.ones(q, int(keep.sum()), dtype=torch.bool), text], dim=1)
            outs.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vals)  # [q, hd]
        return torch.stack(outs, dim=1)[None], None  # [1, q, H, hd]


def _reference_logits(model, values, readable, ids, start):
    reference = tiny_family("llama", model.get_base_model().config.vocab_size)
    reference.load_state_dict(model.get_base_model().state_dict(), strict=False)
    AttentionInterface.register(REFERENCE, _Reference(values, readable))
    reference.config._attn_implementation = REFERENCE
    positions = torch.arange(start, start + len(ids))[None]
    return reference(input_ids=torch.tensor([ids]), position_ids=positions).logits[0]  # [T, V]


def _owners(model) -> torch.Tensor:
    config = model.peft_config["demo"]
    origins = model.base_model.prompt_bank.origins["demo"]
    owner = torch.full_like(origins, -1)
    for i, (start, end) in enumerate(config.demonstration_spans):
        owner[(origins >= start) & (origins < end)] = i
    return owner


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_a_demonstration_row_reads_no_entry_from_its_own_span_in_any_layer_or_head(tokenizer, tok_dir, checkpointing):
    """Rows: demonstration 1 (left-padded), a plain row, an input-prompt row and a base row in one batch."""
    model = _model(tokenizer, tok_dir)
    if checkpointing:
        checkpointing_on(model.get_base_model(), reentrant=checkpointing == "reentrant")
    model.train()
    config, bank = model.peft_config["demo"], model.base_model.prompt_bank
    owner = _owners(model)  # [layers, Hkv, N]
    assert (owner == 1).any() and not (owner == 1).all(dim=-1).any()  # demonstration 1 reaches some entries only
    assert not torch.equal(bank.origins["demo"][:, 0], bank.origins["demo"][:, 1])  # the heads chose apart
    demo = tokenizer(DEMOS[1], add_special_tokens=False)["input_ids"]
    other = tokenizer("green cat three", add_special_tokens=False)["input_ids"]
    width = max(len(demo), len(other)) + 2
    ids = torch.tensor([[0] * (width - len(demo)) + demo] + [[0] * (width - len(other)) + other] * 3)
    mask = (ids != 0).long()
    out = model(input_ids=ids, attention_mask=mask, adapter_names=["demo", "demo", "input", "__base__"]).logits
    real = mask[0].bool()
    out[0, real].sum().backward()
    # [layers, 2, Hkv, N, hd]: the frozen sink takes no gradient; the trained leaf's after it
    grad = torch.cat([torch.zeros_like(bank.sinks["demo"]), model.base_model.prompt("demo").grad], dim=-2)
    values = bank.values("demo").detach().clone().requires_grad_(True)
    readable = owner != 1
    readable[..., :1] = True  # the frozen sink is read by every row
    want = _reference_logits(model, values, readable, demo, config.kv_text_start)
    torch.testing.assert_close(out[0, real], want, atol=1e-5, rtol=1e-5)
    want.sum().backward()
    torch.testing.assert_close(grad[..., 1:, :], values.grad[..., 1:, :], atol=1e-5, rtol=1e-4)
    masked = (owner == 1)[:, None, :, :, None].expand_as(grad)  # [layers, 2, Hkv, N, hd]
    assert grad[masked].abs().max() == 0 and grad[~masked].abs().max() > 0  # masked entries get nothing
    with torch.no_grad():  # the plain row reads every entry, as in eval
        model.eval()
        every = model(input_ids=ids[1:2], attention_mask=mask[1:2], adapter_names=["demo"]).logits
    torch.testing.assert_close(out[1], every[0], atol=1e-5, rtol=1e-5)


def test_the_sink_is_never_masked_and_dropout_drops_entries_per_head(tokenizer, tok_dir, monkeypatch):
    model = _model(tokenizer, tok_dir, kv_position_dropout=0.5, kv_leave_one_out=False).train()
    seen, real = [], kv_regularize.row_keep

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(kv_regularize, "row_keep", spy)
    model(input_ids=torch.tensor([tokenizer("green cat", add_special_tokens=False)["input_ids"]] * 4))
    keep = seen[0]  # [B, layers, Hkv, N]
    assert keep.shape == (4, 2, 2, 9) and keep[..., 0].all()  # the frozen sink is read by every row
    assert not keep[..., 1:].all() and keep[..., 1:].any()
    assert not torch.equal(keep[:, :, 0], keep[:, :, 1])  # heads drop apart: entries, not whole positions


def test_the_start_keeps_each_head_s_most_attended_context_entries_and_saves_their_origins(
    tokenizer, tok_dir, tmp_path
):
    from peft import PeftModel

    from peft_softprompt_plus.method.kv_init import run_once

    model = _model(tokenizer, tok_dir).eval()
    config, bank = model.peft_config["demo"], model.base_model.prompt_bank
    base = model.get_base_model()
    ids = [
        t for demo in config.demonstration_ids for t in demo + tokenizer("\n", add_special_tokens=False)["input_ids"]
    ]
    assert config.kv_text_start == len(ids) and config.demonstration_spans[0] == [0, len(config.demonstration_ids[0])]
    rows = base.get_input_embeddings()(torch.tensor(ids))
    cache = run_once(base, rows, model.base_model.forward_state.kv_layout)  # [layers, 2, Hkv, P, hd]
    origins = bank.origins["demo"]  # [layers, Hkv, N]
    assert origins.dtype == torch.long and origins.shape == (2, 2, 9) and (origins[..., 0] == 0).all()
    assert (origins.diff(dim=-1) > 0).all()  # in order, no repeats
    gathered = cache.gather(3, origins[:, None, :, :, None].expand(2, 2, 2, 9, cache.shape[-1]))
    torch.testing.assert_close(bank.values("demo"), gathered)
    model.save_pretrained(tmp_path / "a")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "a" / "demo" / "adapter_model.safetensors"))
    assert torch.equal(saved["base_model.softprompt_plus.kv_origins"], origins)
    fresh = tiny_family("llama", len(tokenizer))
    config_path = tmp_path / "a" / "demo"
    saved_config = json.loads((config_path / "adapter_config.json").read_text())
    saved_config["tokenizer_name_or_path"] = str(tmp_path / "no-such-tokenizer")  # loading must not need one
    (config_path / "adapter_config.json").write_text(json.dumps(saved_config))
    loaded = PeftModel.from_pretrained(fresh, str(config_path), adapter_name="demo")
    assert torch.equal(loaded.base_model.prompt_bank.origins["demo"], origins)
    torch.testing.assert_close(loaded.base_model.prompt_bank.values("demo"), bank.values("demo"))


@pytest.mark.parametrize("selection", ["shared", "per_head"])
def test_leave_one_out_never_masks_a_frozen_sink_inside_the_demonstration(tokenizer, tok_dir, monkeypatch, selection):
    """The sink (position 0) lies in demonstration 0's span: its row still reads it, in every layer and head."""
    n = 9 if selection == "per_head" else None  # shared: every position, so the span holds more than the sink
    model = _model(tokenizer, tok_dir, n, kv_selection=selection).train()
    seen, real = [], kv_regularize.row_keep
    monkeypatch.setattr(kv_regularize, "row_keep", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    model(input_ids=torch.tensor([tokenizer(DEMOS[0], add_special_tokens=False)["input_ids"]]))
    keep = seen[0]  # [1, N] shared, [1, layers, Hkv, N] per head
    assert keep[..., 0].all() and not keep.all()  # the sink read; some of demonstration 0's positions masked


def test_inspect_summarises_the_origins_without_a_tokenizer_or_a_model(tokenizer, tok_dir, tmp_path):
    from peft_softprompt_plus.files.inspect_adapter import inspect_adapter

    model = _model(tokenizer, tok_dir)
    model.save_pretrained(tmp_path)
    report = inspect_adapter(str(tmp_path / "demo"))
    config = model.peft_config["demo"]
    assert len(report.origins) == 2 and all(sum(o["demonstrations"]) + o["neither"] == 2 * 9 for o in report.origins)
    owner = _owners(model)
    assert report.origins[0]["demonstrations"] == [int((owner[0] == i).sum()) for i in range(len(DEMOS))]
    text = report.format()
    assert f"started from 4 demonstrations of a {config.kv_text_start}-position context" in text
    assert f"layer   0: {report.origins[0]['demonstrations']} + {report.origins[0]['neither']}" in text


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda t: t.pop("base_model.softprompt_plus.kv_origins"), "holds no 'base_model.softprompt_plus.kv_origins'"),
        (
            lambda t: t.update(
                {"base_model.softprompt_plus.kv_origins": t["base_model.softprompt_plus.kv_origins"][:1]}
            ),
            "needs int64 of shape [2, 2, 9]",
        ),  # fmt: skip
        (
            lambda t: t["base_model.softprompt_plus.kv_origins"].mul_(-1),
            "is not each head's context positions in order",
        ),
    ],
)
def test_damaged_origins_are_refused_by_name_and_the_base_left_alone(tokenizer, tok_dir, tmp_path, damage, words):
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    _model(tokenizer, tok_dir).save_pretrained(tmp_path)
    path = tmp_path / "demo" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    damage(tensors)
    save_file(tensors, str(path))
    base = tiny_family("llama", len(tokenizer))
    before = {n: p.clone() for n, p in base.named_parameters()}
    with pytest.raises(Exception, match=words.replace("[", r"\[")):
        PeftModel.from_pretrained(base, str(tmp_path / "demo"), adapter_name="demo")
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())


def test_a_run_where_no_row_matches_a_demonstration_warns_once_and_counts(tokenizer, tok_dir, monkeypatch):
    from peft_softprompt_plus.forward import state

    monkeypatch.setattr(state, "UNMATCHED_WARNING_ROWS", 8)
    model = _model(tokenizer, tok_dir).train()
    other = torch.tensor([tokenizer("green cat three", add_special_tokens=False)["input_ids"]] * 4)
    model(input_ids=other)
    with pytest.warns(UserWarning, match="none of the first 8 training rows matched a demonstration"):
        model(input_ids=other)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=other)  # once only
        model(input_ids=torch.tensor([tokenizer(DEMOS[2], add_special_tokens=False)["input_ids"]]))
    assert model.base_model.forward_state.leave_one_out == {"matched": 1, "unmatched": 12}


def test_a_trained_per_head_adapter_folds_and_exports_to_a_cartridge_peft_reads_alike(tokenizer, tok_dir, tmp_path):
    """Its text starts past N (the context's length); folded to N on the rotary tiny Llama, its logits are the
    unfolded ones, and PEFT CARTRIDGE holding the folded values computes the same through its own forward."""
    from peft import PeftModel

    from peft_softprompt_plus import fold_adapter, to_cartridge

    model = _model(tokenizer, tok_dir).eval()
    with torch.no_grad():  # as if trained: every entry moved
        model.base_model.prompt("demo").add_(0.05 * torch.randn_like(model.base_model.prompt("demo")))
    ids = torch.tensor([tokenizer("green cat three white", add_special_tokens=False)["input_ids"]] * 2)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert model.peft_config["demo"].kv_text_start > 9
    fold_adapter(model, in_place=True)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    to_cartridge(model, tmp_path / "cartridge", adapter_name="demo")
    theirs = PeftModel.from_pretrained(tiny_family("llama", len(tokenizer)), tmp_path / "cartridge").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path / "folded")  # the origins stay context positions past the folded start: loads
    again = PeftModel.from_pretrained(tiny_family("llama", len(tokenizer)), tmp_path / "folded" / "demo").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(again.base_model.prompt_bank.origins["default"], model.base_model.prompt_bank.origins["demo"])
