"""KV students (distill/kv_start.py and `distill(prompt_level="kv")`) on the tiny chat Llama of
test_distill.py. References: the teacher itself (a student that keeps every system-turn position is the teacher), the
attention weights of the base model, and the PEFT reload of the saved student."""

import pytest
import torch
from peft import PeftModel
from test_distill import HELD_OUT, SYSTEM, USERS, chat_dir, cli_args, distill  # noqa: F401 (the fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import student_inputs
from peft_softprompt_plus.distill import kv_start
from peft_softprompt_plus.distill.data import prepare

KW = {"steps": 6, "batch_size": 4, "max_new_tokens": 6, "samples_per_turn": 2, "held_out_samples_per_turn": 1}


@pytest.fixture
def tok(chat_dir):  # noqa: F811
    return AutoTokenizer.from_pretrained(chat_dir)


def _base(chat_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(chat_dir).eval()


def test_a_selected_student_that_keeps_every_position_is_the_teacher(tok, chat_dir):  # noqa: F811
    p = len(prepare(tok, SYSTEM, True, 4).prefix_ids)
    # At the teacher the KL's gradient is zero, so a step leaves it there.
    kw = {**KW, "steps": 1, "evaluate_at": (0,), "prompt_level": "kv", "prompt_init": "selected"}
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=p, user_turns=USERS,
                           held_out_turns=HELD_OUT, **kw)  # fmt: skip
    report = model.distill_report
    assert model.peft_config["default"].kv_text_start == p and report.curve[0].held_out.kl < 1e-9
    assert report.curve[0].held_out.first_16 == 1.0 and report.none.kl > 1e-3  # the check can tell


def test_attention_scores_are_the_base_model_s_own_weights(tok, chat_dir):  # noqa: F811
    base = _base(chat_dir)
    own = base.config._attn_implementation
    model = distill(base, tok, SYSTEM, num_virtual_tokens=4, prompt_level="kv", user_turns=USERS,
                           held_out_turns=HELD_OUT, **{**KW, "steps": 1})  # fmt: skip
    attached = model.get_base_model().config._attn_implementation
    prefix, text = [5, 6, 7, 8, 9], [10, 11, 12]
    scores = kv_start.attention_scores(model, prefix, [(text, 1)], kv_heads=2)  # [layers, Hkv, P], queries 1..
    reference = AutoModelForCausalLM.from_pretrained(chat_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        weights = reference(input_ids=torch.tensor([prefix + text]), output_attentions=True).attentions
    heads, kv_heads = reference.config.num_attention_heads, reference.config.num_key_value_heads
    # transformers' `repeat_kv`: query head q reads key/value head q // (heads / kv_heads)
    expected = torch.zeros(len(weights), kv_heads, 5)
    for layer, w in enumerate(weights):
        for q in range(heads):
            expected[layer, q // (heads // kv_heads)] += w[0, q, 6:, :5].sum(0)
    torch.testing.assert_close(scores, expected)
    assert model.get_base_model().config._attn_implementation == attached  # nothing switched
    assert model.unload().config._attn_implementation == own


def test_a_kv_student_trains_saves_and_reloads_as_a_kv_adapter(tok, chat_dir, tmp_path):  # noqa: F811
    kw = {**KW, "evaluate_at": (0, 6), "prompt_level": "kv", "prompt_init": "selected"}
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=6, user_turns=USERS,
                           held_out_turns=HELD_OUT, **kw)  # fmt: skip
    report = model.distill_report
    assert report.curve[0].held_out.kl > report.student.kl  # training moved the selected start on
    assert "selected" in report.init and "KV" in report.init
    model.save_pretrained(tmp_path / "kv")
    reloaded = PeftModel.from_pretrained(_base(chat_dir), tmp_path / "kv")
    assert reloaded.peft_config["default"].prompt_level == "kv"
    batch = student_inputs(tok, [[{"role": "user", "content": t}] for t in HELD_OUT])
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, model(**batch).logits)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"prompt_level": "kv", "keep_text": "red green blue", "prompt_init": "text"}, "only the 'selected' start"),
        ({"prompt_level": "kv", "in_system_turn": True}, "a KV student takes the whole system turn's place"),
        ({"prompt_init": "selected"}, "`prompt_init` for prompt_level='input' must be one of"),
        ({"prompt_level": "prefix"}, "`prompt_level` must be 'input' or 'kv', got 'prefix'"),
    ],
)
def test_kv_student_arguments_are_refused_before_the_model_changes(tok, chat_dir, kwargs, words):  # noqa: F811
    base = _base(chat_dir)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        distill(base, tok, SYSTEM, num_virtual_tokens=4, user_turns=USERS, **KW, **kwargs)
    assert not hasattr(base, "peft_config")


def test_cli_distill_trains_a_kv_student_and_refuses_kv_with_placement(chat_dir, tmp_path, capsys):  # noqa: F811
    from peft_softprompt_plus.apps.cli import main as cli_main

    (tmp_path / "system.txt").write_text(SYSTEM + "\n")
    (tmp_path / "users.txt").write_text("\n".join(USERS) + "\n")
    (tmp_path / "keep.txt").write_text("red green blue\n")
    out = tmp_path / "adapter"
    argv = cli_args(chat_dir, tmp_path, out)
    argv += ["--num-virtual-tokens", "5", "--steps", "2", "--user-file", str(tmp_path / "users.txt")]
    assert cli_main(argv + ["--batch-size", "4", "--prompt-level", "kv", "--prompt-init", "selected"]) == 0
    assert "adapter saved to" in capsys.readouterr().out
    reloaded = PeftModel.from_pretrained(_base(chat_dir), out)
    config = reloaded.peft_config["default"]
    assert config.prompt_level == "kv" and config.kv_text_start == len(
        prepare(AutoTokenizer.from_pretrained(chat_dir), SYSTEM, True, 5).prefix_ids
    )
    assert cli_main(argv + ["--prompt-level", "kv", "--in-system-turn"]) == 2
    assert "`--in-system-turn` places hard tokens" in capsys.readouterr().err
    assert cli_main(argv + ["--prompt-init", "selected"]) == 2
    assert "`--prompt-init` for prompt_level='input' must be one of" in capsys.readouterr().err
