"""What a distilled prompt keeps of the system prompt's content (distill/content.py, and its use in distill/run.py):
the fact words, the parts and their probes, the score against hand-computed shares, turns that cover every part, the
answer-weighted loss, held-out turns without training turns, and the CLI's probe file."""

import json
import re

import pytest
import torch
from test_distill import HELD_OUT, SYSTEM, USERS, _distill, base, chat_dir, cli_args, tok  # noqa: F401  (fixtures)
from transformers import AutoTokenizer

from peft_softprompt_plus.apps.cli import main as cli_main
from peft_softprompt_plus.distill import content
from peft_softprompt_plus.distill import data as distill_data
from peft_softprompt_plus.distill import score as distill_score
from peft_softprompt_plus.distill.score import scored_batch, token_kl
from peft_softprompt_plus.distill.teacher import TEACHER

PROMPT = (
    "You are Nora, the desk assistant of Harbor Bikes. Facts: the shop opens at 8 am; a city bike costs 1,400 cents "
    "for a day; the trail ends at the Saltmarsh lighthouse."
)


def test_fact_words_drop_function_words_and_normalize_numbers():
    assert content.words("The bike costs 1,400 cents, and it's FREE!") == {"bike", "costs", "1400", "cents", "free"}
    assert content.words("email care@lumio.example today") == {"email", "care@lumio.example", "today"}


def test_each_part_is_probed_in_a_form_no_training_turn_uses():
    parts = content.parts(PROMPT)
    phrases = ["you are Nora the desk", "the shop opens", "a city bike costs", "the trail ends"]
    assert [p.phrase for p in parts] == phrases
    shop = parts[1]
    assert shop.facts == ("8",) and shop.probe().facts == ("8",)  # "am" is a function word
    assert shop.probe().question == "What do you know about the shop opens?"
    assert shop.probe().question not in shop.questions(len(content.TRAIN_FORMS))
    assert shop.questions(2) == ["Can you tell me about the shop opens?", "I have a question about the shop opens."]


def test_the_score_is_each_reader_s_share_of_the_facts():
    probes = [content.Probe("When does it open?", ("8 am", "Tuesday")), content.Probe("Where does the trail end?")]
    replies = {
        "teacher": ["We open at 8 am, closed on Tuesday.", "At the Saltmarsh lighthouse."],
        "student": ["We open at 8.", "It ends at the lighthouse."],
        "none": ["We open at 9.", "I don't know."],
    }
    score = content.score(replies, probes, PROMPT)
    # Probe 2 has no given facts: the prompt's words the teacher states beyond the question's ("saltmarsh",
    # "lighthouse"); the student states one of them.
    assert score.replies[1]["facts"] == ["lighthouse", "saltmarsh"]
    assert score.teacher == 1.0 and score.student == pytest.approx((0.5 + 0.5) / 2) and score.none == 0.0
    assert score.kept == pytest.approx(0.5) and score.probes == 2
    empty = content.score({r: ["nothing", "nothing"] for r in replies}, [content.Probe("hi?")] * 2, PROMPT)
    assert empty.probes == 0 and empty.kept != empty.kept  # NaN: no probe to judge by


@pytest.mark.parametrize(
    "line, message",
    [('{"question": 3}', "non-empty string"), ('{"question": "x?", "facts": "8 am"}', "list of strings"),
     ("{not json", "not valid JSON")],
)  # fmt: skip
def test_bad_probe_lines_are_named(line, message):
    with pytest.raises(ValueError, match=message):
        content.read_probes(["fine?", line])


def test_turns_per_part_train_on_every_part_and_the_probes_stay_held_out(tok, base):  # noqa: F811
    model = _distill(base, tok, user_turns=USERS, held_out_turns=HELD_OUT, steps=2, turns_per_part=2)
    report = model.distill_report
    parts = content.parts(SYSTEM)
    drafted = [q for part in parts for q in part.questions(2)]
    assert set(drafted) <= set(report.samples.train_turns)
    assert [p.question for p in report.samples.probes] == [part.probe().question for part in parts]
    assert not {p.question for p in report.samples.probes} & set(report.samples.train_turns)
    assert report.content is not None and report.content.probes >= 1
    assert set(report.samples.probe_replies) == {"teacher", "none"}
    assert any(line.startswith("content (") for line in report.lines())
    assert report.samples.drafted_probes and "built from the prompt's own words" in "\n".join(report.lines())
    assert report.metrics()["content_probes"] == report.content.probes


def test_greedy_part_replies_add_the_teacher_s_greedy_reply_to_each_part_question(tok, base):  # noqa: F811
    model = _distill(
        base, tok, user_turns=USERS, held_out_turns=HELD_OUT, steps=1, turns_per_part=1, greedy_part_replies=True
    )
    samples = model.distill_report.samples
    asked = [part.questions(1)[0] for part in content.parts(SYSTEM)]
    assert model.distill_report.options.greedy_part_replies and set(asked) <= set(samples.train_turns)
    sampled, greedy_rows = samples.train[: 4 * len(samples.train_turns)], samples.train[4 * len(samples.train_turns) :]
    assert len(greedy_rows) == len(asked)
    prepared = distill_data.prepare(tok, SYSTEM, True, 4)
    for question, row in zip(asked, greedy_rows, strict=True):
        suffix = prepared.suffix_ids(tok, question)
        assert row.ids[: len(suffix)] == suffix and row.first == len(suffix) - 1
        # Reference: a manual greedy loop of the base reading the hard system prompt's ids.
        ids = prepared.prefix_ids + suffix
        with torch.no_grad():
            for _ in range(6):  # _distill's max_new_tokens
                nxt = int(model(input_ids=torch.tensor([ids]), adapter_names=["__base__"]).logits[0, -1].argmax())
                ids.append(nxt)
                if nxt in prepared.stop_ids:
                    break
        assert row.ids[len(suffix) :] == ids[len(prepared.prefix_ids) + len(suffix) :]
    for turn, row in zip(samples.train_turns, sampled[::4], strict=True):  # the sampled rows come first, as before
        assert row.ids[: row.first + 1] == prepared.suffix_ids(tok, turn)


def test_quote_parts_train_on_each_part_s_own_text_after_a_question_asking_for_it(tok, base):  # noqa: F811
    model = _distill(base, tok, user_turns=USERS, held_out_turns=HELD_OUT, steps=1, quote_parts=2)
    samples = model.distill_report.samples
    parts = content.parts(SYSTEM)
    quoted = samples.train[4 * len(samples.train_turns) :]
    assert len(quoted) == 2 * len(parts) and model.distill_report.options.quote_parts == 2
    prepared = distill_data.prepare(tok, SYSTEM, True, 4)
    for row, (part, question) in zip(quoted, [(p, q) for p in parts for q in p.quotes(2)], strict=True):
        suffix = prepared.suffix_ids(tok, question)
        assert row.ids[: row.first + 1] == suffix and tok.decode(row.ids[len(suffix) :]).strip() == part.text
    assert not {q for p in parts for q in p.quotes(2)} & set(samples.train_turns)  # rows, not sampled turns


def test_keep_text_is_read_as_hard_tokens_after_the_soft_ones_and_saved(tok, base, tmp_path):  # noqa: F811
    kept = "answer with red green blue"
    model = _distill(base, tok, user_turns=USERS, held_out_turns=HELD_OUT, steps=1, keep_text=kept)
    config = model.peft_config["default"]
    assert tok.decode(config.prompt_suffix_ids) == distill_data.FORMATS["chat"].prefix(tok, kept)  # its own turn
    assert config.prompt_prefix_ids is None and model.distill_report.student.kl < model.distill_report.none.kl
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["prompt_suffix_ids"] == config.prompt_suffix_ids
    inside = _distill(base, tok, user_turns=USERS, steps=1, keep_text=kept, in_system_turn=True)
    head, tail = distill_data.system_turn(tok, distill_data.prepare(tok, SYSTEM, True, 4))
    assert (
        inside.peft_config["default"].prompt_suffix_ids
        == tok("\n\n" + kept, add_special_tokens=False)["input_ids"] + tail
    )


def test_the_report_measures_the_kept_text_alone_against_the_base_reading_it(tok, base, tmp_path):  # noqa: F811
    kept = "answer with red green blue"
    probes = [content.Probe("which colors?", ("red", "green", "blue")), content.Probe("and the fox?", ("brown",))]
    model = _distill(base, tok, user_turns=USERS, held_out_turns=HELD_OUT, steps=2, keep_text=kept, probes=probes)
    report = model.distill_report
    # Reference: per-token KL of the base reading the kept text as its system turn, against the base reading the
    # whole system turn, over every held-out continuation, each row alone (no padding).
    prepared = distill_data.prepare(tok, SYSTEM, True, 4)
    heads = (prepared.prefix_ids, distill_data.kept_ids(tok, prepared, kept, False))
    total, count = 0.0, 0
    for sample in report.samples.held_out:
        with torch.no_grad():
            logits = [
                model(input_ids=torch.tensor([head + sample.ids]), adapter_names=["__base__"]).logits[0, len(head) :]
                for head in heads
            ]  # 2 x [L, V]
        scored = torch.arange(len(sample.ids)) >= sample.first  # [L]
        kl = token_kl(logits[0].unsqueeze(0), logits[1].unsqueeze(0), scored.unsqueeze(0))  # [P]
        total, count = total + kl.sum().item(), count + kl.numel()
    assert report.kept_text.kl == pytest.approx(total / count, rel=1e-4, abs=1e-6)
    assert report.kept_text.kl != pytest.approx(report.student.kl)  # another reader, not the student again
    assert report.kept_text_content is not None and report.kept_text_content.teacher == report.content.teacher
    assert [r["question"] for r in report.kept_text_content.replies] == [p.question for p in probes]
    assert any("the kept text alone as the system prompt (no soft tokens)" in line for line in report.lines())
    assert report.metrics()["held_out_kl_kept_text_alone"] == round(report.kept_text.kl, 4)
    assert report.kept_text_gap_closed == pytest.approx(1 - report.kept_text.kl / report.none.kl)
    assert list(model.peft_config) == ["default"]  # the baseline reader is never saved
    model.save_pretrained(tmp_path)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    plain = _distill(base, tok, user_turns=USERS, steps=1).distill_report
    assert plain.kept_text is None and plain.kept_text_content is None and plain.kept_text_gap_closed is None
    assert not any("kept text alone" in line for line in plain.lines())


def test_the_answer_weight_counts_the_tokens_the_system_prompt_decides(tok, base):  # noqa: F811
    model = _distill(base, tok, user_turns=USERS, steps=1)
    model.add_adapter(TEACHER, model.peft_config["default"])  # a stand-in teacher: the same path, another prompt
    with torch.no_grad():
        model.base_model.prompt(TEACHER).normal_(generator=torch.Generator().manual_seed(0))
    batch = scored_batch(model.distill_report.samples.train[:4], 0, "cpu")
    plain = distill_score.weighted_kl(model, batch, "default", 0.0)
    with torch.no_grad():
        teacher = model(**batch.kwargs, adapter_names=[TEACHER] * 4).logits
        student = model(**batch.kwargs, adapter_names=["default"] * 4).logits
        none = model(**batch.kwargs, adapter_names=["__base__"] * 4).logits
    kl, decided = token_kl(teacher, student, batch.scored), token_kl(teacher, none, batch.scored)
    torch.testing.assert_close(plain, kl.mean())
    weights = 0.5 + 0.5 * decided / decided.mean()
    weighted = distill_score.weighted_kl(model, batch, "default", 0.5)
    torch.testing.assert_close(weighted, (kl * weights).sum() / weights.sum())


def test_held_out_turns_without_training_turns_let_the_teacher_write_them(tok, base):  # noqa: F811
    model = _distill(base, tok, held_out_turns=HELD_OUT, steps=1, sampled_turns=8, samples_per_turn=1)
    samples = model.distill_report.samples
    assert samples.sampled_turns and samples.held_out_turns == HELD_OUT
    assert not set(HELD_OUT) & set(samples.train_turns)


@pytest.mark.parametrize(
    "options, message",
    [({"turns_per_part": -1}, "`turns_per_part` must be an int >= 0, got -1"),
     ({"answer_weight": 2.0}, "`answer_weight` must be a number in [0, 1], got 2.0"),
     ({"probes": "what?"}, "`probes` must be a list of str or Probe"),
     ({"greedy_part_replies": 1}, "`greedy_part_replies` must be True or False, got 1"),
     ({"greedy_part_replies": True}, "pass `turns_per_part` >= 1 too, got 0"),
     ({"quote_parts": 4}, "`quote_parts` must be an int in [0, 3] (quoting questions per part), got 4"),
     ({"keep_text": "purple"}, "`keep_text` must be a non-empty passage of `system_prompt` (spacing aside)")],
)  # fmt: skip
def test_bad_content_options_are_named(tok, base, options, message):  # noqa: F811
    with pytest.raises(ValueError, match=re.escape(message)):
        _distill(base, tok, user_turns=USERS, **options)


def test_cli_takes_a_probe_file_and_held_out_turns_alone(chat_dir, tmp_path, capsys):  # noqa: F811
    (tmp_path / "system.txt").write_text(SYSTEM + "\n")
    (tmp_path / "held.txt").write_text("\n".join(HELD_OUT) + "\n")
    (tmp_path / "probes.txt").write_text(json.dumps({"question": "what colours?", "facts": ["red", "blue"]}) + "\n")
    out = tmp_path / "adapter"
    argv = cli_args(chat_dir, tmp_path, out)
    argv += ["--num-virtual-tokens", "3", "--steps", "2", "--batch-size", "4", "--turns-per-part", "1"]
    argv += ["--held-out-file", str(tmp_path / "held.txt"), "--probe-file", str(tmp_path / "probes.txt")]
    assert cli_main(argv + ["--greedy-part-replies", "--quote-parts", "1"]) == 0
    printed = capsys.readouterr().out
    assert "content (1 probe questions never trained on" in printed
    assert "the teacher's greedy reply to each question about a part" in printed
    assert "(and 1 quoting each part's own text)" in printed
    assert "built from the prompt's own words" not in printed  # the user's own probes
    assert cli_main(argv[:-6] + ["--greedy-part-replies"]) == 2  # without --turns-per-part
    assert "`--greedy-part-replies` trains on the replies" in capsys.readouterr().err
    (tmp_path / "keep.txt").write_text("purple\n")
    assert cli_main(argv + ["--keep-file", str(tmp_path / "keep.txt")]) == 2
    assert "`--keep-file`=" in capsys.readouterr().err
    (tmp_path / "keep.txt").write_text(SYSTEM.split(".")[1] + "\n")
    assert cli_main(argv + ["--keep-file", str(tmp_path / "keep.txt")]) == 0
    suffix = json.loads((out / "adapter_config.json").read_text())["prompt_suffix_ids"]
    assert SYSTEM.split(".")[1].strip() in AutoTokenizer.from_pretrained(chat_dir).decode(suffix)
    assert "the kept text alone as the system prompt (no soft tokens): KL" in capsys.readouterr().out
    assert cli_main(argv + ["--quote-parts", "5"]) == 2
    assert "`--quote-parts` must be 0 to 3 (quoting questions per part), got 5" in capsys.readouterr().err
    (tmp_path / "probes.txt").write_text('{"question": ""}\n')
    assert cli_main(argv) == 2
    assert "`--probe-file`=" in capsys.readouterr().err
