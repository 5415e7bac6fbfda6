"""Placement (placement.py): a hard prefix and suffix around the soft tokens, exact in every path that reads a
prompt, against the reference of the same `[prefix; soft; suffix]` rows placed by hand."""

import os

import pytest
import torch
from conftest import random_ids
from peft import PeftModel, get_peft_model
from test_families import reference_logits
from test_generation import manual_greedy

from peft_softprompt_plus import SoftPromptPlusConfig, prompt_embeds

PREFIX, SUFFIX, N = [0, 7], [9, 11, 13], 4  # 0 is the tiny GPT-2's BOS
GREEDY = dict(do_sample=False, pad_token_id=1)


def _placed(make_base, make_peft, **config):
    config = {"prompt_prefix_ids": PREFIX, "prompt_suffix_ids": SUFFIX, "num_virtual_tokens": N, **config}
    model = make_peft(base=make_base(initializer_range=0.5), **config)
    with torch.no_grad():  # a loud prompt, so a misplaced row changes the tokens
        model.base_model.prompt("default").normal_(0.0, 1.0)
    return model


def _rows(model, adapter="default"):
    """The hand-made reference prompt: the embedding of the hard ids around the soft rows `[P+N+S, D]`."""
    embedding = model.get_base_model().get_input_embeddings()
    config = model.peft_config[adapter]
    hard = [embedding(torch.tensor(ids)) for ids in (config.prompt_prefix_ids or [], config.prompt_suffix_ids or [])]
    return torch.cat([hard[0], model.base_model.prompt(adapter), hard[1]]).detach()


def _batch():
    ids = random_ids(3, 6, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 1), mask


@pytest.mark.parametrize("path", ["auto", "concat"])
def test_logits_equal_the_prompt_placed_by_hand(make_base, make_peft, path):
    model = _placed(make_base, make_peft, forward_path=path).eval()
    ids, mask = _batch()
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
        reference = reference_logits(make_base(initializer_range=0.5), _rows(model), ids, mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], reference[real], atol=1e-4, rtol=1e-4)
    assert model.base_model.prompt_for_use("default").shape[0] == len(PREFIX) + N + len(SUFFIX)


def test_generate_equals_the_manual_greedy_loop_and_each_row_alone(make_base, make_peft):
    model = _placed(make_base, make_peft).eval()
    ids = random_ids(2, 5, seed=3)
    ours = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert ours.tolist() == manual_greedy(model, ids, 6).tolist()
    alone = model.generate(input_ids=ids[1:], max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert alone.tolist() == ours[1:].tolist()


def test_only_the_soft_rows_learn_and_the_base_is_untouched(make_base, make_peft):
    model = _placed(make_base, make_peft)
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    ids = random_ids(2, 5)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    prompt = model.base_model.prompt("default")
    assert prompt.grad is not None and prompt.grad.abs().sum() > 0 and prompt.grad.dtype == torch.float32
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "base_model.prompt_bank.softprompt_plus_prompt.default"
    ]
    for key, value in model.get_base_model().state_dict().items():
        assert torch.equal(value, base_before[key]), key


def test_adapters_with_different_prefixes_share_a_batch_exactly(make_base, make_peft):
    model = _placed(make_base, make_peft).eval()
    other = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=2, prompt_prefix_ids=[5], init_seed=1, validate_gradients="off"
    )
    model.add_adapter("other", other)
    ids, mask = _batch()
    names = ["default", "other", "__base__"]
    with torch.no_grad():
        mixed = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        for b, name in enumerate(names):
            real = mask[b].bool()
            alone = model(input_ids=ids[b : b + 1, real], adapter_names=[name]).logits[0]
            torch.testing.assert_close(mixed[b, real], alone, atol=1e-4, rtol=1e-4)
        mixed_tokens = model.generate(
            input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=4, **GREEDY
        )
        for b, name in enumerate(names):
            real = ids[b : b + 1, mask[b].bool()]
            alone = model.generate(input_ids=real, adapter_names=[name], max_new_tokens=4, **GREEDY)
            assert alone[0, real.shape[1] :].tolist() == mixed_tokens[b, ids.shape[1] :].tolist()


def test_prompt_embeds_for_serving_carry_the_hard_rows(make_base, make_peft):
    model = _placed(make_base, make_peft).eval()
    engine = make_base(initializer_range=0.5)
    ids, mask = _batch()
    rows = prompt_embeds(model, ids, mask)
    length = len(PREFIX) + N + len(SUFFIX)
    with torch.no_grad():
        for b, row in enumerate(rows):
            real = ids[b][mask[b].bool()]
            torch.testing.assert_close(row[:length], _rows(model))
            served = engine(inputs_embeds=row[None]).logits[0, length:]
            torch.testing.assert_close(served, model(input_ids=real[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_text_is_tokenized_once_saved_as_ids_and_loads_without_the_tokenizer(make_base, tiny_model_dir, tmp_path):
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=N,
        init_seed=0,
        prompt_prefix="<|endoftext|>hello",
        prompt_suffix=" there",
        tokenizer_name_or_path=tiny_model_dir,
    )
    model = get_peft_model(make_base(), config).eval()
    prefix = model.peft_config["default"].prompt_prefix_ids
    assert prefix[0] == 0 and len(prefix) >= 2 and model.peft_config["default"].prompt_suffix_ids
    ids = random_ids(2, 5)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    gone = SoftPromptPlusConfig.from_pretrained(str(tmp_path / "adapter"))
    assert gone.prompt_prefix_ids == prefix
    gone_dir = tmp_path / "adapter"
    config_json = (gone_dir / "adapter_config.json").read_text()
    (gone_dir / "adapter_config.json").write_text(config_json.replace(tiny_model_dir, str(tmp_path / "nowhere")))
    loaded = PeftModel.from_pretrained(make_base(), str(gone_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, before, atol=0, rtol=0)
    assert not os.path.exists(tmp_path / "nowhere")


def test_a_text_that_carries_its_own_bos_is_refused_not_read_twice(make_base, make_peft):
    model = _placed(make_base, make_peft).eval()
    ids, mask = _batch()
    ids[1, 3] = 0  # row 1's first real token is BOS (left padded)
    with pytest.raises(ValueError, match=r"row 1 starts with the BOS token .*add_special_tokens=False"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="row 1 starts with the BOS"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=1)
    with pytest.raises(ValueError, match="row 1 starts with the BOS"):
        prompt_embeds(model, ids, mask)  # the embeddings an engine would be sent: the same refusal
    turns = ids.clone()
    turns[1, 5] = 0  # BOS again later in the row: it opens turns (ChatML's <|im_start|> as BOS), not the document
    model(input_ids=turns, attention_mask=mask)
    plain = _placed(make_base, make_peft, prompt_prefix_ids=[7]).eval()  # no BOS in its prefix: BOS text is fine
    plain(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(prompt_prefix_ids=[]), r"`prompt_prefix_ids` must be a non-empty list of token ids .* got \[\]"),
        (dict(prompt_suffix_ids=[1, -2]), r"`prompt_suffix_ids` must be .* got \[1, -2\]"),
        (dict(prompt_prefix=""), r"`prompt_prefix` must be a non-empty string or None, got ''"),
        (dict(prompt_suffix="end"), r"`prompt_suffix`='end' needs `tokenizer_name_or_path`"),
    ],
)
def test_bad_placement_config_is_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        SoftPromptPlusConfig(task_type="CAUSAL_LM", **config)


def _word_level_tokenizer(folder) -> str:
    """A tokenizer that can't spell every text: words it doesn't know become [UNK], spaces are not kept."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 2, "there": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(folder))
    return str(folder)


def test_prefixes_the_model_cant_read_are_refused_and_the_base_handed_back(make_base, tmp_path):
    base = make_base()
    flags = {n: p.requires_grad for n, p in base.named_parameters()}
    with pytest.raises(ValueError, match=r"`prompt_prefix_ids`=\[5, 100000\] holds ids \[100000\] outside"):
        get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", prompt_prefix_ids=[5, 100000]))
    assert {n: p.requires_grad for n, p in base.named_parameters()} == flags
    words = _word_level_tokenizer(tmp_path / "words")
    for text in ("hello stranger", "hello  there"):  # an unknown word; a space the tokenizer drops
        unreadable = SoftPromptPlusConfig(task_type="CAUSAL_LM", prompt_suffix=text, tokenizer_name_or_path=words)
        with pytest.raises(ValueError, match=rf"`prompt_suffix`='{text}' can't be reproduced by the tokenizer"):
            get_peft_model(make_base(), unreadable)
    readable = SoftPromptPlusConfig(task_type="CAUSAL_LM", prompt_suffix="hello there", tokenizer_name_or_path=words)
    assert get_peft_model(make_base(), readable).peft_config["default"].prompt_suffix_ids == [2, 3]


@pytest.mark.parametrize("family", ["llama", "gemma2", "bloom"])  # rotary, scaled embeddings + window, concat-only
@pytest.mark.parametrize("task", ["CAUSAL_LM", "SEQ_CLS"])
def test_every_family_and_task_reads_the_placed_prompt_exactly(family, task):
    from peft_softprompt_plus.apps.tiny import tiny_family

    config = SoftPromptPlusConfig(
        task_type=task, num_virtual_tokens=3, init_seed=2, prompt_prefix_ids=[5, 6], prompt_suffix_ids=[8]
    )
    model = get_peft_model(tiny_family(family, task=task), config).eval()
    ids, mask = _batch()
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        reference = reference_logits(tiny_family(family, task=task), _rows(model), ids, mask)
    if task == "CAUSAL_LM":
        torch.testing.assert_close(ours[mask.bool()], reference[mask.bool()], atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
