"""`DistillOptions` (distill/options.py): the options object `distill_prompt` takes, the 0.3 keywords it still
accepts with a FutureWarning at the caller's line, and `softprompt-plus distill`'s flags, one per field."""

import argparse
import dataclasses

import pytest
from test_distill import HELD_OUT, SYSTEM, USERS, chat_dir  # noqa: F401 (the fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import DistillOptions, distill_prompt
from peft_softprompt_plus.apps import distill_args
from peft_softprompt_plus.distill.options import CLI_ALIASES, FIELDS, from_cli

SMALL = {"num_virtual_tokens": 4, "steps": 2, "batch_size": 4, "max_new_tokens": 4, "samples_per_turn": 1}


def _base(chat_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(chat_dir).eval()


def test_the_0_3_keywords_train_the_same_student_with_a_future_warning_at_the_caller_s_line(chat_dir):  # noqa: F811
    tok = AutoTokenizer.from_pretrained(chat_dir)
    data = {"user_turns": USERS, "held_out_turns": HELD_OUT}
    new = distill_prompt(_base(chat_dir), tok, SYSTEM, DistillOptions(**SMALL), **data)
    with pytest.warns(FutureWarning, match=r"distill_prompt\(\.\.\., DistillOptions\(num_virtual_tokens=4") as w:
        old = distill_prompt(_base(chat_dir), tok, SYSTEM, **SMALL, **data)
    assert w[0].filename == __file__ and "stops working in 0.4.0" in str(w[0].message)
    assert old.distill_report.student.kl == new.distill_report.student.kl  # the same run, seed for seed
    assert old.peft_config["default"].to_dict() == new.peft_config["default"].to_dict()


@pytest.mark.parametrize(
    "call, error, words",
    [
        ({"stepz": 3}, TypeError, "unexpected keyword argument(s) ['stepz']. Its options are the fields"),
        ({"options": DistillOptions(), "steps": 3}, ValueError, "pass the options in `options` or as keywords"),
        ({"options": {"steps": 3}}, ValueError, "`options` must be a DistillOptions, got dict"),
    ],
)
def test_options_are_refused_by_name_before_the_model_changes(chat_dir, call, error, words):  # noqa: F811
    base, tok = _base(chat_dir), AutoTokenizer.from_pretrained(chat_dir)
    with pytest.raises(error) as raised:
        distill_prompt(base, tok, SYSTEM, user_turns=USERS, **call)
    assert words in str(raised.value) and not hasattr(base, "peft_config")


def test_the_cli_has_one_flag_per_option_and_maps_them_one_to_one():
    parser = argparse.ArgumentParser()
    distill_args.add_parser(parser.add_subparsers())
    distill = parser._subparsers._group_actions[0].choices["distill"]
    dests = {action.dest for action in distill._actions}
    aliases = {field: flag for flag, field in CLI_ALIASES.items()}
    assert [f for f in FIELDS if f not in dests and aliases.get(f) not in dests] == []
    args = distill.parse_args(
        ["--model", "m", "--system-prompt-file", "s", "--output-dir", "o", "--steps", "7", "--evaluate-at", "0,3",
         "--plain", "--held-out-fraction", "0.3", "--no-self-study"]
    )  # fmt: skip
    args.keep_text = "kept"  # what `--keep-file` is read into
    options = from_cli(args)
    expected = DistillOptions(steps=7, evaluate_at=(0, 3), chat=False, held_out_fraction=0.3, self_study=False,
                              keep_text="kept")  # fmt: skip
    assert dataclasses.asdict(options) == dataclasses.asdict(expected)
