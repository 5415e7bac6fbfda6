"""The distillation recipe's options (`self_study`, `kl_top_k`, `kv_frozen_positions`, and each form's defaults for
`lr` and `prompt_init`) on the tiny chat Llama of test_distill.py. References: a hand-written top-k KL, the seed
instructions found in what the teacher was asked to continue, spies on what the training loop receives (the optimizer,
each trained KL, who writes the turns, the `selected` start) and the saved adapter's config."""

import inspect
import sys

import pytest
import torch
from test_distill import HELD_OUT, SYSTEM, USERS, chat_dir, cli_args, distill  # noqa: F401 (the fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus.distill import score, teacher
from peft_softprompt_plus.distill.data import prepare
from peft_softprompt_plus.distill.refusals import LEVEL_DEFAULTS
from peft_softprompt_plus.distill.score import token_kl
from peft_softprompt_plus.method import kv_select

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


def _replace(monkeypatch, real, stand_in) -> None:
    """`real` replaced by `stand_in` in every distill module (and the shared selection) that holds it, through the
    module or a name it imported, so a spy sees what the training loop passes wherever the loop's stages live."""
    homes = ("peft_softprompt_plus.distill", "peft_softprompt_plus.method.kv_select")  # the selection is shared
    for loaded in [m for n, m in list(sys.modules.items()) if n.startswith(homes)]:
        for attr, value in list(vars(loaded).items()):
            if value is real:
                monkeypatch.setattr(loaded, attr, stand_in)


def _spy(monkeypatch, module, name: str) -> list[dict]:
    """The arguments of every call of `module.name`, by name."""
    real, calls = getattr(module, name), []
    signature = inspect.signature(real)

    def spy(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs).arguments)
        return real(*args, **kwargs)

    _replace(monkeypatch, real, spy)
    return calls


def _spy_optimizers(monkeypatch) -> list[torch.optim.Optimizer]:
    """Every AdamW made (the loop reaches it as `torch.optim.AdamW`, or by a name it imported)."""
    made, real = [], torch.optim.AdamW

    class Recorded(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    _replace(monkeypatch, real, Recorded)
    return made


@pytest.mark.parametrize(
    "level, given",
    [
        ("input", {}),
        ("kv", {}),
        ("kv", {"lr": 0.5, "prompt_init": "text", "kv_frozen_positions": 0, "kl_top_k": 5, "self_study": False}),
    ],
)
def test_each_option_reaches_the_training_loop(tok, chat_dir, monkeypatch, level, given):  # noqa: F811
    """What the loop receives: the optimizer's lr and tensor, the top-k cut in every trained KL, who writes the
    turns, whether the `selected` start runs and with which sink."""
    want = {**LEVEL_DEFAULTS[level], "kl_top_k": 0, **given}
    optimizers = _spy_optimizers(monkeypatch)
    trained_kl, kls = _spy(monkeypatch, score, "weighted_kl"), _spy(monkeypatch, score, "token_kl")
    written = {how: _spy(monkeypatch, teacher, how) for how in ("self_study_turns", "sample_turns")}
    chosen = _spy(monkeypatch, kv_select, "per_head_positions")
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=4, prompt_level=level, sampled_turns=6, **KW,
                    **given)  # fmt: skip
    (optimizer,) = optimizers
    (group,) = optimizer.param_groups
    (prompt,) = group["params"]
    assert group["lr"] == want["lr"] and prompt is model.base_model.prompt("default")
    sink = want["kv_frozen_positions"] or 0  # the trained tensor holds the N positions past the frozen sink
    assert prompt.shape[-2 if level == "kv" else 0] == 4 - sink
    assert len(trained_kl) == KW["steps"] and {c["top_k"] for c in trained_kl} == {want["kl_top_k"]}
    with_grad = [c["top_k"] for c in kls if c["student_logits"].requires_grad]
    assert with_grad == [want["kl_top_k"]] * KW["steps"]  # the loss itself is cut, the held-out KL never
    assert {c.get("top_k", 0) for c in kls if not c["student_logits"].requires_grad} == {0}
    config = model.peft_config["default"]
    by_self_study = "self_study_turns" if want["self_study"] else "sample_turns"
    assert len(written[by_self_study]) == 1 and sum(map(len, written.values())) == 1
    assert model.distill_report.samples.self_study is want["self_study"]
    if want["prompt_init"] == "selected":
        (call,) = chosen
        assert call["n"] == 4 and call["forced"] == list(range(sink))  # the sink, and no kept passage
    else:
        assert chosen == [] and config.kv_text_start == (4 if level == "kv" else None)
    assert config.prompt_level == level and config.kv_frozen_positions == want["kv_frozen_positions"]
    assert model.distill_report.options.lr == want["lr"] and model.distill_report.options.kl_top_k == want["kl_top_k"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"self_study": "yes"}, "`self_study` must be True or False, got 'yes'"),
        ({"kl_top_k": -1}, "`kl_top_k` must be an int >= 0 (0: the teacher's full distribution), got -1"),
        ({"kl_top_k": 2.5}, "`kl_top_k` must be an int >= 0"),
        ({"kv_frozen_positions": 1}, "`kv_frozen_positions`=1 sets a KV student's frozen first positions"),
        ({"prompt_level": "kv", "kv_frozen_positions": -2}, "`kv_frozen_positions` must be None or an int >= 0"),
        ({"prompt_text_weight": -0.5}, "`prompt_text_weight` must be a finite number >= 0 (0: off), got -0.5"),
        ({"prompt_text_weight": float("nan")}, "`prompt_text_weight` must be a finite number >= 0"),
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
    argv = cli_args(chat_dir, tmp_path, out)
    argv += ["--num-virtual-tokens", "5", "--steps", "1", "--user-file", str(tmp_path / "users.txt")]
    flags = ["--batch-size", "4", "--prompt-level", "kv", "--kv-frozen-positions", "2", "--kl-top-k", "8"]
    assert cli_main(argv + flags) == 0
    printed = capsys.readouterr().out
    assert f"lr {LEVEL_DEFAULTS['kv']['lr']:g}" in printed.replace("lr=", "lr ")
    assert PeftModel.from_pretrained(_base(chat_dir), out).peft_config["default"].kv_frozen_positions == 2
    assert cli_main(argv + ["--kl-top-k", "-1"]) == 2
    assert "`--kl-top-k` must be an int >= 0" in capsys.readouterr().err
    assert cli_main(argv + ["--prompt-text-weight", "-1"]) == 2
    assert "`--prompt-text-weight` must be a finite number >= 0 (0: off), got -1.0" in capsys.readouterr().err


def test_a_kv_student_writes_its_turns_by_self_study_unless_told_not_to(tok, chat_dir):  # noqa: F811
    kw = {**KW, "num_virtual_tokens": 4, "sampled_turns": 6}
    for level, given, expected in (("kv", None, True), ("kv", False, False), ("input", None, False)):
        model = distill(_base(chat_dir), tok, SYSTEM, prompt_level=level, self_study=given, **kw)
        assert model.distill_report.samples.self_study is expected, (level, given)
        assert ("by self-study" in model.distill_report.lines()[0]) is expected


def test_the_prompt_text_loss_is_the_student_s_next_token_loss_on_the_system_turn(tok, chat_dir, monkeypatch):  # noqa: F811
    calls = _spy(monkeypatch, score, "text_nll")
    plain = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=4, user_turns=USERS, **KW)
    assert calls == []  # off by default
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=4, user_turns=USERS, prompt_text_weight=0.5, **KW)
    prefix = prepare(tok, SYSTEM, True, 4).prefix_ids
    assert len(calls) == KW["steps"] and all(list(c["ids"]) == prefix for c in calls)
    assert "the system turn's text at weight 0.5" in model.distill_report.lines()[0]
    trained = model.base_model.prompt("default").detach()
    assert not torch.equal(trained, plain.base_model.prompt("default").detach())  # the loss moved the prompt
    # The reference: the base reading the trained input prompt's vectors, then the system turn's embeddings.
    base = model.get_base_model()
    ids = torch.tensor([prefix])  # [1, S]
    with torch.no_grad():
        embeds = torch.cat([trained.unsqueeze(0), base.get_input_embeddings()(ids)], 1)  # [1, N+S, D]
        logits = base(inputs_embeds=embeds).logits[0, 4:-1]  # [S-1, V]
        expected = torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:])
        torch.testing.assert_close(score.text_nll(model, prefix, "default"), expected, rtol=1e-5, atol=1e-5)
