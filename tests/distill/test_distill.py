"""Prompt distillation (distill/run.py, data.py, teacher.py, score.py) on tiny seeded models with a hand-written
chat template that, like SmolLM2's, inserts a default system prompt when none is given. References: the
template's own rendering, the base model fed the hard token ids, a KL computed by hand, the saved keys as a set."""

import json
import os

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import DistillOptions, distill_prompt, student_inputs, student_text
from peft_softprompt_plus._names import SAVED_KEY
from peft_softprompt_plus.apps.cli import main as cli_main
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_tokenizer
from peft_softprompt_plus.distill.data import prepare
from peft_softprompt_plus.distill.score import scored_batch, teacher_logits, token_kl
from peft_softprompt_plus.distill.teacher import TEACHER, Sample, attach_teacher

DEFAULT_SYSTEM = "the default helper"
TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n" + DEFAULT_SYSTEM
    + "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # fmt: skip
SYSTEM = "a soft prompt is a learned sequence of input embeddings. answer with red green blue and the quick brown fox"
USERS = ["hello world", "one two three", "cat dog bird", "the lazy dog", "red blue", "fish horse cow", "good bad"]
HELD_OUT = ["answer question", "white black orange"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny tokenizer with ChatML-like special tokens and TEMPLATE, and a tiny Llama, saved to one folder."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template, tok.eos_token = TEMPLATE, "<|im_end|>"
    path = str(tmp_path_factory.mktemp("tiny-chat"))
    tok.save_pretrained(path)
    tiny_llama(len(tok), tok.eos_token_id).save_pretrained(path)
    return path


def tiny_llama(vocab: int, eos: int):
    # A wider init than the default gives the random model real attention, so the system prompt changes its outputs.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, initializer_range=0.2, **{**FAMILIES["llama"][1], "eos_token_id": eos}
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def tok(chat_dir):
    return AutoTokenizer.from_pretrained(chat_dir)


@pytest.fixture
def base(chat_dir):
    return AutoModelForCausalLM.from_pretrained(chat_dir).eval()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _render(tok, messages):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------- formatting


def test_the_teacher_reads_the_template_cut_where_the_system_turn_ends(tok):
    prepared = prepare(tok, SYSTEM, chat=True, num_virtual_tokens=4)
    user = [{"role": "user", "content": "hello world"}]
    whole = _render(tok, [{"role": "system", "content": SYSTEM}] + user)
    assert prepared.prefix_ids + prepared.suffix_ids(tok, "hello world") == _ids(tok, whole)
    # The student's text is what follows the system turn: the template's default system prompt is never in it.
    text = student_text(tok, user)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert DEFAULT_SYSTEM in _render(tok, user) and DEFAULT_SYSTEM not in text
    assert _ids(tok, text) == prepared.suffix_ids(tok, "hello world")
    assert prepared.stop_ids == [tok.eos_token_id]


def test_student_inputs_are_left_padded_student_texts(tok):
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "the quick brown fox jumps"}]]
    batch = student_inputs(tok, convs)
    for row, conv in enumerate(convs):
        ids = _ids(tok, student_text(tok, conv))
        assert batch["input_ids"][row, -len(ids) :].tolist() == ids
        assert batch["attention_mask"][row].sum() == len(ids) and batch["attention_mask"][row, -1] == 1
    one = student_inputs(tok, convs[1])  # one conversation is a batch of one
    assert one["input_ids"].tolist() == [_ids(tok, student_text(tok, convs[1]))]
    assert student_inputs(tok, ["red blue"], chat=False)["input_ids"].tolist() == [_ids(tok, "red blue")]


# ---------------------------------------------------------------------------------------------- the teacher


@pytest.mark.parametrize("chat", [True, False])
def test_the_teacher_adapter_equals_the_base_fed_the_hard_tokens(tok, base, chat):
    from peft import get_peft_model

    from peft_softprompt_plus import SoftPromptPlusConfig

    prepared = prepare(tok, SYSTEM, chat=chat, num_virtual_tokens=4)
    reference = AutoModelForCausalLM.from_pretrained(tok.name_or_path).eval()
    model = get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0))
    attach_teacher(model, prepared.prefix_ids)
    turns = ["hello world", "the lazy dog jumps over the quick brown fox"]
    suffixes = [prepared.suffix_ids(tok, t) for t in turns]
    batch = scored_batch([Sample(s, 0) for s in suffixes], tok.pad_token_id, "cpu")  # left-padded
    logits = teacher_logits(model, batch)  # [B, K, V]
    with torch.no_grad():
        for row, suffix in enumerate(suffixes):
            hard = reference(input_ids=torch.tensor([prepared.prefix_ids + suffix])).logits[0, -len(suffix) :]
            torch.testing.assert_close(logits[row, -len(suffix) :], hard, atol=1e-4, rtol=1e-4)


def test_the_teacher_prompt_pass_runs_once_and_never_trains(tok, base, monkeypatch):
    from peft import get_peft_model

    from peft_softprompt_plus import SoftPromptPlusConfig
    from peft_softprompt_plus.forward import paths as forward_paths

    prepared = prepare(tok, SYSTEM, chat=True, num_virtual_tokens=4)
    model = get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0))
    attach_teacher(model, prepared.prefix_ids)
    teacher = model.base_model.prompt(TEACHER)
    assert not teacher.requires_grad and model.active_adapters == ["default"]
    passes = []
    original = forward_paths.prompt_pass

    def counted(model, rows, *args, **kwargs):
        passes.append(tuple(rows.prompts[0].shape))
        return original(model, rows, *args, **kwargs)

    monkeypatch.setattr(forward_paths, "prompt_pass", counted)
    samples = [Sample(prepared.suffix_ids(tok, t) + [5, 6], 3) for t in USERS[:4]]
    before = teacher.detach().clone()
    for _ in range(3):
        batch = scored_batch(samples, tok.pad_token_id, "cpu")
        target = teacher_logits(model, batch)
        student = model(**batch.kwargs).logits
        token_kl(target, student, batch.scored).mean().backward()
    S = len(prepared.prefix_ids)
    assert passes.count((S, 64)) == 1 and passes.count((4, 64)) == 3  # the hard prefix once, the student every step
    assert teacher.grad is None and torch.equal(teacher, before)
    assert model.base_model.prompt("default").grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- the loss


def test_the_loss_is_the_kl_computed_by_hand():
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    scored = torch.tensor([[False, True, True], [True, True, True]])
    by_hand = []
    for b in range(2):
        for k in range(3):
            if scored[b, k]:
                p = teacher[b, k].double().softmax(-1)
                q = student[b, k].double().softmax(-1)
                by_hand.append(sum(p[v] * (p[v].log() - q[v].log()) for v in range(7)))
    torch.testing.assert_close(token_kl(teacher, student, scored).double(), torch.stack(by_hand), atol=1e-6, rtol=0)
    assert token_kl(teacher, teacher, scored).abs().max() < 1e-6


def test_scored_positions_are_the_last_suffix_token_and_the_continuation(tok, base):
    samples = [Sample([7, 8, 9, 10, 11], 2), Sample([20, 21, 22], 1)]  # row 0: 3 scored positions, row 1: 2
    batch = scored_batch(samples, tok.pad_token_id, "cpu")
    assert batch.kwargs["logits_to_keep"] == 3
    assert batch.scored.tolist() == [[True, True, True], [False, True, True]]
    with torch.no_grad():
        full = base(input_ids=batch.kwargs["input_ids"], attention_mask=batch.kwargs["attention_mask"]).logits
        kept = base(**batch.kwargs).logits
    torch.testing.assert_close(kept, full[:, -3:])
    # Row 0's scored logits sit at its positions 2, 3, 4: the suffix's last token, then each continuation token.
    torch.testing.assert_close(kept[0], full[0, 2:5])


# ---------------------------------------------------------------------------------------------- end to end


DATA = ("user_turns", "held_out_turns", "probes", "samples", "progress")  # distill_prompt's own keywords


def distill(base, tok, system, **kwargs):
    """`distill_prompt` with `kwargs` split into its data keywords and a DistillOptions of the rest."""
    data = {k: kwargs.pop(k) for k in DATA if k in kwargs}
    return distill_prompt(base, tok, system, DistillOptions(**kwargs), **data)


def _distill(base, tok, **kwargs):
    kwargs = {"num_virtual_tokens": 4, "steps": 12, "batch_size": 4, "max_new_tokens": 6, "lr": 5e-2, **kwargs}
    return distill(base, tok, SYSTEM, **kwargs)


def test_distill_closes_part_of_the_gap_and_saves_the_student_alone(tok, base, chat_dir, tmp_path):
    rng = torch.random.get_rng_state()
    model = _distill(base, tok, user_turns=USERS, held_out_turns=HELD_OUT, evaluate_at=(0, 12))
    report = model.distill_report
    assert torch.equal(torch.random.get_rng_state(), rng)  # the teacher sampled under its own seed
    assert list(model.peft_config) == ["default"]
    assert report.samples.held_out_turns == HELD_OUT and not set(HELD_OUT) & set(report.samples.train_turns)
    assert len(report.samples.train) == 4 * len(USERS) and len(report.samples.held_out) == 2 * len(HELD_OUT)
    assert report.teacher_gap <= 1e-5
    assert report.curve[0].held_out.kl > report.student.kl  # training moved the student towards the teacher
    assert report.student.kl < report.none.kl and 0 < report.gap_closed <= 1
    assert report.curve[-1].held_out == report.student
    model.save_pretrained(tmp_path / "adapter")
    assert sorted(os.listdir(tmp_path / "adapter")) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(saved) == {SAVED_KEY} and saved[SAVED_KEY].shape == (4, 64)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["num_virtual_tokens"] == 4 and config["peft_type"] == "SOFTPROMPT_PLUS"
    assert config["prompt_init"] == "text" and config["prompt_init_text"] == tok.decode(_ids(tok, SYSTEM)[:4])
    assert "held_out_gap_closed" in (tmp_path / "adapter" / "README.md").read_text()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_dir).eval(), tmp_path / "adapter")
    batch = student_inputs(tok, [[{"role": "user", "content": t}] for t in HELD_OUT])
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, model(**batch).logits)


def test_the_teacher_writes_the_user_turns_when_none_are_given(tok, base):
    model = _distill(base, tok, steps=2, sampled_turns=10, samples_per_turn=1, held_out_fraction=0.3)
    samples = model.distill_report.samples
    assert samples.sampled_turns and len(samples.train_turns) + len(samples.held_out_turns) == 10
    normal = lambda turns: {" ".join(t.split()).casefold() for t in turns}  # noqa: E731
    assert not normal(samples.train_turns) & normal(samples.held_out_turns) and len(samples.held_out_turns) == 3


def test_plain_mode_needs_no_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model = _distill(base, tok, user_turns=USERS, chat=False, steps=3)
    assert model.distill_report.mode == "plain" and model.distill_report.teacher_gap <= 1e-5
    samples = model.distill_report.samples
    first = _ids(tok, samples.train_turns[0])  # plain mode: the student reads the turn's own tokens
    assert samples.train[0].ids[: len(first)] == first and samples.train[0].first == len(first) - 1


def test_in_system_turn_puts_the_soft_tokens_inside_the_template_s_system_turn(tok, base, chat_dir):
    # The student reads the teacher's very text with the system prompt's content alone replaced by soft tokens: with
    # the soft rows set to the content's own embeddings it is the teacher, token for token.
    model = _distill(base, tok, user_turns=USERS, steps=2, in_system_turn=True)
    config = model.peft_config["default"]
    assert config.prompt_prefix_ids == _ids(tok, "<|im_start|>system\n")
    assert config.prompt_suffix_ids == _ids(tok, "<|im_end|>\n")
    content = _ids(tok, SYSTEM)
    exact = _distill(
        AutoModelForCausalLM.from_pretrained(chat_dir).eval(), tok, user_turns=USERS, steps=1, in_system_turn=True,
        num_virtual_tokens=len(content),
    )  # fmt: skip
    embedding = exact.get_base_model().get_input_embeddings()
    with torch.no_grad():
        exact.base_model.prompt("default").copy_(embedding(torch.tensor(content)))
        batch = student_inputs(tok, [[{"role": "user", "content": t}] for t in HELD_OUT])
        teacher = AutoModelForCausalLM.from_pretrained(chat_dir).eval()
        for row in range(len(HELD_OUT)):
            real = batch["input_ids"][row][batch["attention_mask"][row].bool()]
            system_turn = tok.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
            hard = torch.tensor(_ids(tok, system_turn))
            want = teacher(input_ids=torch.cat([hard, real])[None]).logits[0, len(hard) :]
            got = exact(input_ids=real[None]).logits[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="`in_system_turn` must be True or False, got 'yes'"):
        _distill(base, tok, user_turns=USERS, steps=1, in_system_turn="yes")


def test_samples_are_reused_across_students(tok, base, chat_dir):
    # A student given another's samples trains and is scored on exactly those: with the same seed it is the student
    # that drew them. No `user_turns` this time, so samples drawn afresh would be the teacher's own turns.
    first = _distill(base, tok, user_turns=USERS, steps=2)
    samples = first.distill_report.samples
    second = _distill(AutoModelForCausalLM.from_pretrained(chat_dir).eval(), tok, steps=2, samples=samples)
    assert torch.equal(second.base_model.prompt("default"), first.base_model.prompt("default"))
    assert second.distill_report.student == first.distill_report.student
    assert second.distill_report.none == first.distill_report.none


# ---------------------------------------------------------------------------------------------- refusals


GLUED = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no separator: tokens merge across the boundary
SYSTEM_LAST = (  # the system prompt alone is rendered first, but after the other turns once they come
    "{% if messages | length == 1 %}{{ messages[0]['content'] }}\n{% else %}{% for m in messages[1:] %}"
    "{{ m['content'] }}\n{% endfor %}{{ messages[0]['content'] }}{% endif %}"
)
ECHO = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} ({{ messages[0]['content'] | length }})\n{% endfor %}"
)


@pytest.mark.parametrize(
    ("system", "template", "turns", "n", "words"),
    [
        ("   ", TEMPLATE, USERS, 4, ["`system_prompt`", "non-empty", "'   '"]),
        ("red blue", TEMPLATE, USERS, 16, ["`system_prompt` is 12 tokens", "`num_virtual_tokens`=16", "<= 12"]),
        (SYSTEM, None, USERS, 4, ["`tokenizer`", "no chat template", "chat=False", "--plain"]),
        ("the quick bro", GLUED, ["wn fox", "wn dog"], 2, ["The user turn 'wn ", "tokenizes differently", "newline"]),
        (SYSTEM, SYSTEM_LAST, USERS, 4, ["renders the system turn differently", "chat=False"]),
        (SYSTEM, ECHO, USERS, 4, ["differently depending on the system prompt", "student_inputs"]),
        (SYSTEM, TEMPLATE, "hello", 4, ["`user_turns`", "list of str", "str"]),
        (SYSTEM, TEMPLATE, ["only one"], 4, ["`user_turns` leave 0 turn(s)", "two distinct"]),
    ],
)
def test_bad_distillation_inputs_are_refused_before_the_model_changes(tok, base, system, template, turns, n, words):
    tok.chat_template = template
    state = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(ValueError) as raised:
        distill(base, tok, system, num_virtual_tokens=n, steps=1, user_turns=turns)
    for word in words:
        assert word in str(raised.value), f"{word!r} not in: {raised.value}"
    assert not hasattr(base, "peft_config") and all(torch.equal(state[k], v) for k, v in base.state_dict().items())


def test_student_text_refuses_a_system_message(tok):
    with pytest.raises(ValueError, match="holds a system message"):
        student_text(tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------- command line


def cli_args(model_dir, tmp_path, out) -> list[str]:
    """`softprompt-plus distill`'s required arguments: the model, `tmp_path`'s system.txt, the output folder."""
    return ["distill", "--model", str(model_dir), "--system-prompt-file", str(tmp_path / "system.txt"),
            "--output-dir", str(out)]  # fmt: skip


def test_cli_distill_end_to_end_writes_a_loadable_adapter(chat_dir, tmp_path, capsys):
    (tmp_path / "system.txt").write_text(SYSTEM + "\n")
    (tmp_path / "users.txt").write_text("\n".join(USERS + ["", "  "]) + "\n")
    out = tmp_path / "adapter"
    argv = cli_args(chat_dir, tmp_path, out)
    argv += ["--num-virtual-tokens", "3", "--steps", "4", "--user-file", str(tmp_path / "users.txt")]
    assert cli_main(argv + ["--batch-size", "4", "--in-system-turn"]) == 0
    printed = capsys.readouterr().out
    assert "step 4/4: training KL" in printed and "gap closed" in printed and "first 16 tokens" in printed
    assert "adapter saved to" in printed
    assert set(load_file(out / "adapter_model.safetensors")) == {SAVED_KEY}
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_dir), out)
    assert list(reloaded.peft_config) == ["default"] and reloaded.peft_config["default"].num_virtual_tokens == 3
    assert reloaded.peft_config["default"].prompt_prefix_ids == _ids(
        AutoTokenizer.from_pretrained(chat_dir), "<|im_start|>system\n"
    )
    saved = json.loads((out / "distill_report.json").read_text())  # the options it ran with, beside the adapter
    assert saved["options"]["num_virtual_tokens"] == 3 and saved["options"]["in_system_turn"] is True
    assert saved["options"]["lr"] == 3e-2 and saved["metrics"]["held_out_gap_closed"] is not None  # the default
    assert "options: num_virtual_tokens=3, prompt_level='input', prompt_init='text'" in printed


def test_the_report_holds_saves_and_prints_the_options_it_ran_with(tok, base, tmp_path):
    model = _distill(base, tok, user_turns=USERS, steps=2, evaluate_at=(0, 2), prompt_level="kv")
    report = model.distill_report
    # every None replaced by what ran: a KV student's defaults (refusals.LEVEL_DEFAULTS), the sink clamped below N
    assert report.options == DistillOptions(
        num_virtual_tokens=4, steps=2, batch_size=4, max_new_tokens=6, lr=5e-2, evaluate_at=(0, 2),
        prompt_level="kv", prompt_init="selected", self_study=True, kv_frozen_positions=1,
    )  # fmt: skip
    report.save(tmp_path / "report.json")
    saved = json.loads((tmp_path / "report.json").read_text())
    rerun = {**saved["options"], "evaluate_at": tuple(saved["options"]["evaluate_at"])}
    assert DistillOptions(**rerun) == report.options
    finite = {k: None if isinstance(v, float) and v != v else v for k, v in report.metrics().items()}  # NaN: null
    assert [p["step"] for p in saved["curve"]] == [0, 2] and saved["metrics"] == finite
    assert saved["curve"][-1]["kl"] == report.curve[-1].held_out.kl
    assert any(line.startswith("options: num_virtual_tokens=4, prompt_level='kv'") for line in report.lines())


@pytest.mark.slow
def test_real_checkpoint_teacher_is_the_hard_prompt_and_the_default_system_prompt_is_avoided():
    from peft import get_peft_model

    from peft_softprompt_plus import SoftPromptPlusConfig
    from peft_softprompt_plus.apps.fetch import fetch_checkpoint

    path = fetch_checkpoint("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    prepared = prepare(tok, "You are Pip, the support assistant of a lamp. Be brief and sign off as Pip.", True, 16)
    conversation = [{"role": "user", "content": "How do I reset my lamp?"}]
    assert "SmolLM" in _render(tok, conversation) and "SmolLM" not in student_text(tok, conversation)
    suffix = prepared.suffix_ids(tok, "How do I reset my lamp?")
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        hard = base(input_ids=torch.tensor([prepared.prefix_ids + suffix])).logits[0, -len(suffix) :]
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=16, validate_gradients="off")
    model = get_peft_model(base, config)
    attach_teacher(model, prepared.prefix_ids)
    logits = teacher_logits(model, scored_batch([Sample(suffix, 0)], tok.pad_token_id, "cpu"))[0]
    torch.testing.assert_close(logits, hard, atol=1e-4, rtol=1e-4)


def test_a_distilled_hard_prompt_is_a_starting_point_for_label_training(tiny_model_dir, tmp_path):
    # The second starting point: a few-shot prompt compressed by distill_prompt, then trained on labels.
    from peft import get_peft_model

    from peft_softprompt_plus import SoftPromptPlusConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    few_shot = "red -> blue\ncat -> dog\none -> two\n"
    distilled = distill(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tok, few_shot, chat=False, user_turns=USERS,
        num_virtual_tokens=4, steps=2, batch_size=4, max_new_tokens=4,
    )  # fmt: skip
    distilled.save_pretrained(tmp_path / "few-shot")
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=6,
        prompt_init="adapter",
        prompt_init_adapter=str(tmp_path / "few-shot"),
    )
    student = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    start = student.base_model.prompt("default")
    assert torch.equal(start[:4], distilled.base_model.prompt("default")) and start.requires_grad
    ids = torch.tensor([_ids(tok, "fish -> bird\n")])
    student(input_ids=ids, labels=ids).loss.backward()
    assert start.grad is not None and start.grad[:4].abs().sum() > 0
