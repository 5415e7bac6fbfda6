"""The distillation recipe's options (`self_study`, `kl_top_k`, `kv_frozen_positions`, and each form's defaults for
`lr` and `prompt_init`) on the tiny chat Llama of test_distill.py. References: a hand-written top-k KL, the seed
instructions found in what the teacher was asked to continue, and the saved adapter's config."""

import pytest
import torch
from test_distill import HELD_OUT, SYSTEM, USERS, chat_dir, distill  # noqa: F401 (the fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus.distill import teacher
from peft_softprompt_plus.distill.checks import LEVEL_DEFAULTS
from peft_softprompt_plus.distill.data import prepare
from peft_softprompt_plus.distill.score import token_kl

KW = {"steps": 2, "batch_size": 4, "max_new_tokens": 4, "samples_per_turn": 1, "held_out_samples_per_turn": 1}


@pytest.fixture
def tok(chat_dir):  # noqa: F811
    return AutoTokenizer.from_pretrained(chat_dir)


def _base(chat_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(chat_dir).eval()


def test_top_k_kl_is_the_cut_and_renormalised_teacher_against_the_student_s_full_distribution():
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 3, 11, generator=gen), torch.randn(2, 3, 11, generator=gen)  # [B, K, V]
    scored = torch.tensor([[True, False, True], [True, True, True]])  # [B, K]
    torch.testing.assert_close(token_kl(t, s, scored, top_k=11), token_kl(t, s, scored))  # k = V: the full KL
    p_t, log_s = t[scored].softmax(-1), s[scored].log_softmax(-1)  # [P, V]
    top = p_t.topk(3, dim=-1)
    q = top.values / top.values.sum(-1, keepdim=True)  # [P, 3]
    expected = (q * (q.log() - log_s.gather(-1, top.indices))).sum(-1)
    torch.testing.assert_close(token_kl(t, s, scored, top_k=3), expected)
    assert not torch.allclose(expected, token_kl(t, s, scored))  # the cut changes the loss


def test_self_study_turns_are_the_teacher_s_replies_to_each_kind_of_seed_instruction(tok, chat_dir, monkeypatch):  # noqa: F811
    asked, real = [], teacher.generate_rows

    def spy(model, rows, adapter, *args, **kwargs):
        asked.extend(rows)
        return real(model, rows, adapter, *args, **kwargs)

    monkeypatch.setattr(teacher, "generate_rows", spy)
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=4, self_study=True, sampled_turns=12,
                           **KW)  # fmt: skip
    prepared = prepare(tok, SYSTEM, True, 4)
    heads = [prepared.prefix_ids + prepared.suffix_ids(tok, seed) for seed in teacher.SELF_STUDY_SEEDS.values()]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stripped = [row[next(i for i, t in enumerate(row) if t != pad) :] for row in asked]  # prompts as given
    assert all(head in stripped for head in heads)  # every kind was asked, after the system prompt
    samples = model.distill_report.samples
    assert samples.sampled_turns and len(samples.train_turns) + len(samples.held_out_turns) >= 2


def test_each_student_form_takes_its_measured_defaults_and_a_given_value_wins(tok, chat_dir):  # noqa: F811
    for level, defaults in LEVEL_DEFAULTS.items():
        model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=4, prompt_level=level,
                               user_turns=USERS, held_out_turns=HELD_OUT, **KW)  # fmt: skip
        report, config = model.distill_report, model.peft_config["default"]
        assert report.lr == defaults["lr"] and config.prompt_level == level
        assert ("selected" in report.init) == (defaults["prompt_init"] == "selected")
        assert report.samples.self_study is False  # given turns: nothing for the teacher to write
        assert config.kv_frozen_positions == defaults["kv_frozen_positions"]  # a KV student keeps its sink frozen
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=4, prompt_level="kv", lr=0.5,
                           prompt_init="text", kv_frozen_positions=0, kl_top_k=5, user_turns=USERS,
                           held_out_turns=HELD_OUT, **KW)  # fmt: skip
    config = model.peft_config["default"]
    assert model.distill_report.lr == 0.5 and config.kv_frozen_positions == 0 and config.kv_text_start == 4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"self_study": "yes"}, "`self_study` must be True or False, got 'yes'"),
        ({"kl_top_k": -1}, "`kl_top_k` must be an int >= 0 (0: the teacher's full distribution), got -1"),
        ({"kl_top_k": 2.5}, "`kl_top_k` must be an int >= 0"),
        ({"kv_frozen_positions": 1}, "`kv_frozen_positions`=1 sets a KV student's frozen first positions"),
        ({"prompt_level": "kv", "kv_frozen_positions": -2}, "`kv_frozen_positions` must be None or an int >= 0"),
    ],
)
def test_recipe_options_are_refused_by_name_before_the_model_changes(tok, chat_dir, kwargs, words):  # noqa: F811
    base = _base(chat_dir)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        distill(base, tok, SYSTEM, num_virtual_tokens=4, user_turns=USERS, **KW, **kwargs)
    assert not hasattr(base, "peft_config")


def test_cli_maps_the_recipe_flags_and_refuses_a_negative_top_k(chat_dir, tmp_path, capsys):  # noqa: F811
    from peft import PeftModel

    from peft_softprompt_plus.apps.cli import main as cli_main

    (tmp_path / "system.txt").write_text(SYSTEM + "\n")
    (tmp_path / "users.txt").write_text("\n".join(USERS) + "\n")
    out = tmp_path / "adapter"
    argv = ["distill", "--model", chat_dir, "--system-prompt-file", str(tmp_path / "system.txt"), "--out", str(out)]
    argv += ["--num-virtual-tokens", "5", "--steps", "1", "--user-file", str(tmp_path / "users.txt")]
    flags = ["--batch-size", "4", "--prompt-level", "kv", "--kv-frozen-positions", "2", "--kl-top-k", "8"]
    assert cli_main(argv + flags) == 0
    printed = capsys.readouterr().out
    assert f"lr {LEVEL_DEFAULTS['kv']['lr']:g}" in printed.replace("lr=", "lr ")
    assert PeftModel.from_pretrained(_base(chat_dir), out).peft_config["default"].kv_frozen_positions == 2
    assert cli_main(argv + ["--kl-top-k", "-1"]) == 2
    assert "`--kl-top-k` must be an int >= 0" in capsys.readouterr().err


def test_a_kv_student_writes_its_turns_by_self_study_unless_told_not_to(tok, chat_dir):  # noqa: F811
    kw = {**KW, "num_virtual_tokens": 4, "sampled_turns": 6}
    for level, given, expected in (("kv", None, True), ("kv", False, False), ("input", None, False)):
        model = distill(_base(chat_dir), tok, SYSTEM, prompt_level=level, self_study=given, **kw)
        assert model.distill_report.samples.self_study is expected, (level, given)
        assert ("by self-study" in model.distill_report.lines()[0]) is expected
