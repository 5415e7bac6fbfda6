"""capitals.py: the fixed split from the countryinfo wheel, the encoding, and the two greedy scorers agreeing."""

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import KeepBest, SoftPromptPlusConfig
from peft_softprompt_plus.apps import capitals
from peft_softprompt_plus.apps.fetch import fetch_checkpoint
from peft_softprompt_plus.apps.tiny import tiny_tokenizer


def test_the_split_is_fixed_disjoint_and_has_one_row_per_country():
    split = capitals.load_split()
    assert (len(split.train), len(split.held_out)) == (160, 88)
    countries = [c for c, _ in split.train + split.held_out]
    assert len(set(countries)) == 248  # Curaçao's two files count once
    assert ("France", "Paris") in split.train + split.held_out
    assert ("Vatican City State", "Vatican City") in split.train + split.held_out  # its capital is a list
    assert capitals.load_split() == split
    assert split.train[0] == ("Albania", "Tirana")  # the same split on every machine


def test_only_the_answer_and_its_newline_are_labelled():
    tok = tiny_tokenizer()
    ids, labels = capitals.encode(tok, "red", "blue", prefix="cat -> dog\n")
    head = tok("cat -> dog\nred ->", add_special_tokens=False)["input_ids"]
    answer = tok(" blue\n", add_special_tokens=False)["input_ids"]
    assert ids == head + answer and labels == [-100] * len(head) + answer
    batch = capitals.left_padded([(ids, labels), (ids[-3:], labels[-3:])], pad_id=1)
    assert batch["attention_mask"][1].tolist() == [0] * (len(ids) - 3) + [1, 1, 1]
    assert batch["input_ids"][1, : len(ids) - 3].eq(1).all() and batch["labels"][1, : len(ids) - 3].eq(-100).all()


@torch.no_grad()
def test_generate_and_the_uncached_loop_give_the_same_answers():
    path = fetch_checkpoint("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    split = capitals.load_split()
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path).eval(),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, prompt_init="vocab", init_seed=0),
    )
    countries = [c for c, _ in split.held_out[:6]]
    prefix = capitals.few_shot_prefix(split.train[:3])
    cached = capitals.greedy_answers(model, tok, countries, prefix)
    assert cached == capitals.greedy_answers(model, tok, countries, prefix, cached=False)
    assert all("\n" not in a for a in cached) and any(cached)


def test_tune_keeps_the_best_step_by_validation_and_stops(make_peft, tokenizer):
    model = make_peft(num_virtual_tokens=2)
    split = capitals.Split([("red", "blue")] * 4, [("red", "blue")], [("red", "blue")])
    scores = iter([0.5, 0.9, 0.3, 0.2, 0.1, 0.0])
    kept = {}

    def select(m):
        step = len(kept)
        kept[step] = m.base_model.prompt("default").detach().clone()
        return next(scores)

    keep = KeepBest(patience=2)
    curve = capitals.tune(
        model,
        tokenizer,
        split,
        steps=10,
        batch_size=2,
        lr=0.5,
        evaluate_at=(0, 1, 2, 3, 4, 5),
        score=lambda m: 0.0,
        keep_best=keep,
        select=select,
    )
    assert curve.steps == [0, 1, 2, 3] and curve.validation == [0.5, 0.9, 0.3, 0.2]  # stopped 2 evaluations after 1
    assert curve.best_step == 1 and torch.equal(model.base_model.prompt("default"), kept[1])
    assert not torch.equal(kept[1], kept[3])
    with pytest.raises(ValueError, match="`keep_best` needs `select` or a `split.validation`"):
        capitals.tune(model, tokenizer, capitals.Split(split.train, split.held_out), steps=1, keep_best=KeepBest())
