"""The demonstrations start of a KV prompt (method/demonstrations.py). References: the base model reading the
demonstrations as text before a row (an untrained start with every position kept is exact), the saved config (spans
and ids come back with no tokenizer), and every bad input refused before the base changes."""

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig, pick_demonstrations
from peft_softprompt_plus.apps.tiny import tiny_family
from peft_softprompt_plus.files.inspect_adapter import inspect_adapter
from peft_softprompt_plus.method import demonstrations

DEMOS = ["red green blue", "cat dog bird fish", "one two three"]
ROW = "white black horse"


@pytest.fixture
def tok_dir(tiny_model_dir):  # conftest's tiny model folder holds the tiny tokenizer
    return tiny_model_dir


@pytest.fixture
def tok(tokenizer):
    return tokenizer


def _config(tok_dir, **kw):
    kw = {"num_virtual_tokens": None, "prompt_init_texts": DEMOS, "tokenizer_name_or_path": tok_dir, **kw}
    level, init = kw.pop("prompt_level", "kv"), kw.pop("prompt_init", "demonstrations")
    return SoftPromptPlusConfig(prompt_level=level, prompt_init=init, **kw)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", ["gpt2", "llama", "phi3", "gpt_neox"])  # llama and phi3: grouped KV heads
def test_an_untrained_start_with_every_position_kept_is_the_base_reading_the_demonstrations(tok, tok_dir, family):
    model = get_peft_model(tiny_family(family, len(tok)), _config(tok_dir))
    reference = tiny_family(family, len(tok))
    context = [t for d in DEMOS for t in _ids(tok, d) + _ids(tok, "\n")]
    config = model.peft_config["default"]
    assert config.num_virtual_tokens == config.kv_text_start == len(context)
    starts = [len([t for d in DEMOS[:i] for t in _ids(tok, d) + _ids(tok, "\n")]) for i in range(len(DEMOS))]
    assert config.demonstration_spans == [[s, s + len(_ids(tok, d))] for s, d in zip(starts, DEMOS, strict=True)]
    assert config.demonstration_ids == [_ids(tok, d) for d in DEMOS]
    row = torch.tensor([_ids(tok, ROW)])
    with torch.no_grad():
        got = model(input_ids=row).logits
        want = reference(input_ids=torch.cat([torch.tensor([context]), row], 1))
    torch.testing.assert_close(got, want.logits[:, len(context) :], atol=1e-5, rtol=1e-5)


def test_a_smaller_n_keeps_whole_positions_by_attention_and_maps_the_spans(tok, tok_dir):
    model = get_peft_model(tiny_family("llama", len(tok)), _config(tok_dir, num_virtual_tokens=6))
    config = model.peft_config["default"]
    full = len([t for d in DEMOS for t in _ids(tok, d) + _ids(tok, "\n")])
    assert config.num_virtual_tokens == 6 and config.kv_text_start == full  # kept keys keep their positions
    spans = config.demonstration_spans
    assert all(0 <= s <= e <= 6 for s, e in spans) and all(
        a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)
    )
    every = get_peft_model(tiny_family("llama", len(tok)), _config(tok_dir))
    values, all_values = model.base_model.prompt("default"), every.base_model.prompt("default")
    kept = [j for j in range(full) if any(torch.equal(all_values[..., j, :], values[..., i, :]) for i in range(6))]
    assert len(kept) == 6  # each kept position is one of the context's, as computed


def test_save_and_load_keep_the_spans_and_need_no_tokenizer(tok, tok_dir, tmp_path):
    model = get_peft_model(tiny_family("llama", len(tok)), _config(tok_dir))
    model.save_pretrained(tmp_path / "a")
    config = model.peft_config["default"]
    loaded = PeftModel.from_pretrained(tiny_family("llama", len(tok)), tmp_path / "a")
    got = loaded.peft_config["default"]
    assert (got.demonstration_spans, got.demonstration_ids) == (config.demonstration_spans, config.demonstration_ids)
    assert got.num_virtual_tokens == config.num_virtual_tokens
    assert torch.equal(loaded.base_model.prompt("default"), model.base_model.prompt("default"))
    text = inspect_adapter(str(tmp_path / "a")).format()
    assert (
        "started from 3 demonstrations" in text
        and f"demonstration 0: positions {config.demonstration_spans[0]}" in text
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"prompt_init_texts": []}, "`prompt_init_texts` must be a non-empty list of non-empty strings"),
        ({"prompt_init_texts": ["ok", " "]}, "`prompt_init_texts` must be a non-empty list of non-empty strings"),
        ({"prompt_level": "input"}, "`prompt_init='demonstrations'` needs `prompt_level='kv'`"),
        ({"tokenizer_name_or_path": None}, "`tokenizer_name_or_path` is needed to tokenize `prompt_init_texts`"),
        ({"kv_position_dropout": 1.0}, "`kv_position_dropout` must be a number in [0, 1)"),
        ({"kv_selection": "heads"}, "`kv_selection` must be one of ['shared', 'per_head'], got 'heads'"),
        ({"kv_selection": "per_head"}, "got num_virtual_tokens=None (every position, nothing to choose)"),
        (
            {"kv_selection": "per_head", "prompt_init": "text", "prompt_init_texts": None, "num_virtual_tokens": 4},
            "needs prompt_level='kv' and prompt_init='demonstrations', got prompt_level='kv' and prompt_init='text'",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_field(tok_dir, kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _config(tok_dir, **kwargs)


@pytest.mark.parametrize(
    "family, kwargs, words",
    [
        ("llama", {"num_virtual_tokens": 99}, "`num_virtual_tokens`=99 is more than the demonstrations' 13"),
        (
            "llama",
            {"num_virtual_tokens": 13, "kv_selection": "per_head"},
            "`kv_selection='per_head'` keeps N of the demonstrations' 13 positions per layer and head, got "
            "num_virtual_tokens=13: nothing to choose",
        ),
        ("qwen2", {}, "sliding window is 8: a row after them would read none of the first demonstrations"),
        ("llama", {"prompt_init_texts": ["red", "<drop>"]}, "`prompt_init_texts`[1]='<drop>' tokenizes to no tokens"),
    ],
)
def test_bad_demonstrations_are_refused_before_the_base_changes(tok, tok_dir, family, kwargs, words, monkeypatch):
    def tokenizer(config, purpose=None):  # a tokenizer that encodes "<drop>" to nothing, as some normalisers do
        return lambda text, **kw: {"input_ids": [] if text == "<drop>" else tok(text, **kw)["input_ids"]}

    monkeypatch.setattr(demonstrations, "load_tokenizer", tokenizer)
    base = tiny_family(family, len(tok))
    before = {n: p.clone() for n, p in base.named_parameters()}
    own = base.config._attn_implementation
    config = _config(tok_dir, **kwargs)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        get_peft_model(base, config)
    assert base.config._attn_implementation == own and not hasattr(base, "peft_config")
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())


def test_too_long_for_the_model_is_refused(tok, tok_dir):
    base = tiny_family("llama", len(tok))
    base.config.max_position_embeddings = 12
    with pytest.raises(ValueError, match=r"join to 13 tokens, and LlamaForCausalLM reads 12 positions"):
        get_peft_model(base, _config(tok_dir))


def test_pick_demonstrations_is_seeded_and_takes_one_of_each_label_first():
    rows = list(range(20))
    labels = ["a"] * 10 + ["b"] * 9 + ["c"]
    picked = pick_demonstrations(rows, 4, seed=3, labels=labels)
    assert picked == pick_demonstrations(rows, 4, seed=3, labels=labels) and len(set(picked)) == 4
    assert {labels[i] for i in picked[:3]} == {"a", "b", "c"}  # the rare label is among them
    assert pick_demonstrations(rows, 4, seed=4) != pick_demonstrations(rows, 4, seed=3)
    with pytest.raises(ValueError, match=r"`k` must be an int in \[1, len\(rows\)\] = \[1, 20\], got 21"):
        pick_demonstrations(rows, 21)
    with pytest.raises(ValueError, match="`labels` must hold one label per row"):
        pick_demonstrations(rows, 2, labels=["a"])
