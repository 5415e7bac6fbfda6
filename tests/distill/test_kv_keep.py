"""A KV student that keeps a passage of the system prompt (`keep_text` with prompt_level='kv'): its positions are the
teacher's own keys/values, never trained, beside the selected ones; and the `selected` start on a sliding-window
base. On the tiny chat Llama of test_distill.py and a tiny Mistral (window 40) with the same tokenizer. References:
the teacher's cache of the system turn, the teacher itself, the prompt before and after training."""

import pytest
import torch
import transformers
from test_distill import HELD_OUT, SYSTEM, USERS, chat_dir, cli_args, distill  # noqa: F401 (the fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus.apps.cli import main as cli_main
from peft_softprompt_plus.apps.tiny import FAMILIES
from peft_softprompt_plus.distill import kv_start
from peft_softprompt_plus.distill.data import kept_positions, prepare

KW = {"steps": 4, "batch_size": 4, "max_new_tokens": 6, "samples_per_turn": 2, "held_out_samples_per_turn": 1}
KV = {"prompt_level": "kv", "prompt_init": "selected", "user_turns": USERS, "held_out_turns": HELD_OUT}
FACTS = "answer with red green blue"


@pytest.fixture
def tok(chat_dir):  # noqa: F811
    return AutoTokenizer.from_pretrained(chat_dir)


def _base(chat_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(chat_dir).eval()


@pytest.fixture(scope="module")
def window_dir(chat_dir, tmp_path_factory):  # noqa: F811
    """The chat tokenizer beside a tiny Mistral whose sliding window (40) holds the 37-position system turn but not
    the turn and its reply: the later queries read only its last keys."""
    tok = AutoTokenizer.from_pretrained(chat_dir)
    path = str(tmp_path_factory.mktemp("tiny-window"))
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=len(tok),
        initializer_range=0.2,
        **{**FAMILIES["mistral"][1], "eos_token_id": tok.eos_token_id, "sliding_window": 40},
    )
    transformers.MistralForCausalLM(config).eval().save_pretrained(path)
    return path


def _kept(tok, keep_text, chat=True):
    """The kept positions of SYSTEM's turn: all of them, and the passage's."""
    facts, frame = kept_positions(tok, prepare(tok, SYSTEM, chat, 4), keep_text)
    return sorted(set(facts) | set(frame)), facts


@pytest.mark.parametrize("chat, template", [(True, "<|im_start|>system\n<|im_end|>\n"), (False, "\n")])
def test_the_kept_positions_are_the_passage_s_tokens_and_the_template_s(tok, chat, template):
    prepared = prepare(tok, SYSTEM, chat, 4)
    facts, frame = kept_positions(tok, prepared, FACTS)
    assert facts == list(range(facts[0], facts[-1] + 1))  # one passage: one contiguous span
    assert tok.decode([prepared.prefix_ids[i] for i in facts]).strip() == FACTS
    assert tok.decode([prepared.prefix_ids[i] for i in frame]) == template  # the turn's own text around the prompt
    two, _ = kept_positions(tok, prepared, ["a soft prompt", "  quick   brown fox "])  # spacing aside
    assert tok.decode([prepared.prefix_ids[i] for i in two]).split() == "a soft prompt quick brown fox".split()


def test_kept_positions_are_the_teacher_s_keys_values_and_training_leaves_them(tok, chat_dir):  # noqa: F811
    prefix = prepare(tok, SYSTEM, True, 4).prefix_ids
    kept, facts = _kept(tok, FACTS)
    n = len(kept) + 4
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=n, keep_text=FACTS, lr=5e-2, **KV, **KW)
    cache = kv_start.prompt_cache(model, prefix)  # [layers, 2, Hkv, P, hd]: what the teacher reads
    values = model.base_model.prompt_bank.values("default").detach()  # [layers, 2, Hkv, N, hd]
    layers, _, heads, _, _ = cache.shape
    moved = 0
    for layer in range(layers):
        for head in range(heads):
            rows = values[layer, :, head]  # [2, N, hd]
            # Every kept position is still exactly the teacher's, in position order after the sink.
            found = [next(j for j in range(n) if torch.equal(rows[:, j], cache[layer, :, head, p])) for p in kept]
            assert found == sorted(found)
            others = [j for j in range(n) if j not in found]
            moved += sum(not any(torch.equal(rows[:, j], cache[layer, :, head, p]) for p in range(len(prefix)))
                         for j in others)  # fmt: skip
    assert moved == layers * heads * (n - len(kept))  # every selected position trained (the check can tell)
    report = model.distill_report
    assert (report.kept_positions, report.facts) == (len(kept), len(facts)) and "kept" in report.init
    words = f"KV positions: {n} = {len(facts)} kept facts + {len(kept) - len(facts)} of the template's system turn"
    assert words in "\n".join(report.lines())
    assert report.metrics()["kv_kept_fact_positions"] == len(facts)
    assert report.metrics()["kv_selected_positions"] == n - len(kept)
    # The hook is gone with the loop: a further step trains every position of the leaf.
    prompt = model.base_model.prompt("default")
    model.base_model.prompt_bank.values("default").sum().backward()
    assert bool((prompt.grad != 0).all())


def test_the_kept_entries_get_no_gradient_in_training(tok, chat_dir, monkeypatch):  # noqa: F811
    from peft_softprompt_plus.distill import train as distill_train

    seen, hooks = [], []

    def recording(model, batch, adapter, weight, top_k):
        if not hooks:  # after the kept mask's hook, so it records the gradient AdamW reads
            hooks.append(model.base_model.prompt(adapter).register_hook(lambda grad: seen.append(grad.clone())))
        return original(model, batch, adapter, weight, top_k)

    original = distill_train.distill_score.weighted_kl
    monkeypatch.setattr(distill_train.distill_score, "weighted_kl", recording)
    kept, _ = _kept(tok, FACTS)
    model = distill(_base(chat_dir), tok, SYSTEM, num_virtual_tokens=len(kept) + 3, keep_text=FACTS, **KV,
                    **{**KW, "steps": 2})  # fmt: skip
    assert len(seen) == 2
    prefix = prepare(tok, SYSTEM, True, 4).prefix_ids
    values = model.base_model.prompt("default").detach()  # [layers, 2, Hkv, N - 1, hd]: after the sink
    cache = kv_start.prompt_cache(model, prefix)
    for grad in seen:
        for layer in range(values.shape[0]):
            for head in range(values.shape[2]):
                for j in range(values.shape[3]):
                    is_kept = any(torch.equal(values[layer, :, head, j], cache[layer, :, head, p]) for p in kept)
                    assert bool((grad[layer, :, head, j] == 0).all()) == is_kept


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_student_of_the_whole_turn_with_the_whole_prompt_kept_is_the_teacher(tok, chat_dir, window_dir, family):  # noqa: F811
    folder = {"llama": chat_dir, "mistral": window_dir}[family]
    p = len(prepare(tok, SYSTEM, True, 4).prefix_ids)
    model = distill(_base(folder), tok, SYSTEM, num_virtual_tokens=p, keep_text=SYSTEM, **KV, **KW)
    report = model.distill_report
    assert report.kept_positions == p and report.facts == len(_kept(tok, SYSTEM)[1])  # every position kept
    assert report.student.kl < 1e-9 and report.student.first_16 == 1.0 and report.none.kl > 1e-3


def test_a_kept_passage_longer_than_n_is_refused_before_the_model_changes(tok, chat_dir, tmp_path, capsys):  # noqa: F811
    every, facts = _kept(tok, FACTS)
    kept = len(every)
    base = _base(chat_dir)
    words = f"`keep_text` covers {len(facts)} of the system turn's"
    with pytest.raises(ValueError, match=words + f".*more than `num_virtual_tokens`={kept - 1}, .* >= {kept} "):
        distill(base, tok, SYSTEM, num_virtual_tokens=kept - 1, keep_text=FACTS, **KV, **KW)
    plain = len(_kept(tok, FACTS, chat=False)[0])  # the sink (position 0) is not the passage's: one more
    with pytest.raises(ValueError, match=f"{plain + 1} with the template's own \\(1\\) and the 1 frozen first"):
        distill(base, tok, SYSTEM, num_virtual_tokens=plain, keep_text=FACTS, chat=False, **KV, **KW)
    with pytest.raises(ValueError, match="only the 'selected' start holds, got prompt_init='random'"):
        distill(base, tok, SYSTEM, num_virtual_tokens=kept + 2, keep_text=FACTS, **{**KV, "prompt_init": "random"})
    with pytest.raises(ValueError, match="`keep_text` must be a passage .* or a non-empty list of them, got list"):
        distill(base, tok, SYSTEM, num_virtual_tokens=kept + 2, keep_text=[], **KV, **KW)
    assert not hasattr(base, "peft_config")
    (tmp_path / "system.txt").write_text(SYSTEM + "\n")
    (tmp_path / "users.txt").write_text("\n".join(USERS) + "\n")
    (tmp_path / "facts.txt").write_text(FACTS + "\n")
    argv = cli_args(chat_dir, tmp_path, tmp_path / "out")
    argv += ["--steps", "1", "--user-file", str(tmp_path / "users.txt"), "--prompt-level", "kv",
            "--keep-file", str(tmp_path / "facts.txt")]  # fmt: skip
    assert cli_main(argv + ["--num-virtual-tokens", str(kept - 1)]) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert cli_main(argv + ["--num-virtual-tokens", "8", "--prompt-init", "random"]) == 2
    assert "`--keep-file` with prompt_level='kv'" in capsys.readouterr().err


def test_cli_keeps_several_passages_as_kv_positions(tok, chat_dir, tmp_path, capsys):  # noqa: F811
    from peft import PeftModel

    passages = ["a soft prompt", FACTS]
    kept, facts = _kept(tok, passages)
    (tmp_path / "system.txt").write_text(SYSTEM + "\n")
    (tmp_path / "users.txt").write_text("\n".join(USERS) + "\n")
    argv = cli_args(chat_dir, tmp_path, tmp_path / "out")
    argv += ["--steps", "1", "--batch-size", "4", "--user-file", str(tmp_path / "users.txt"),
            "--prompt-level", "kv", "--num-virtual-tokens", str(len(kept) + 2)]  # fmt: skip
    for i, passage in enumerate(passages):
        (tmp_path / f"keep{i}.txt").write_text(passage + "\n")
        argv += ["--keep-file", str(tmp_path / f"keep{i}.txt")]
    assert cli_main(argv) == 0
    assert f"{len(facts)} kept facts" in capsys.readouterr().out
    reloaded = PeftModel.from_pretrained(_base(chat_dir), tmp_path / "out")
    assert reloaded.peft_config["default"].prompt_suffix_ids is None  # kept as keys/values, not as hard text


def test_selected_on_a_sliding_window_base_is_refused_before_the_model_changes(tok, window_dir, tmp_path, capsys):
    p = len(prepare(tok, SYSTEM, True, 4).prefix_ids)
    base = _base(window_dir)
    words = f"prompt_init='selected' keeps 6 of the system turn's {p} positions"
    with pytest.raises(ValueError, match=words + r".*sliding window \(40\)"):
        distill(base, tok, SYSTEM, num_virtual_tokens=6, **KV, **KW)
    assert not hasattr(base, "peft_config")
    (tmp_path / "system.txt").write_text(SYSTEM + "\n")
    (tmp_path / "users.txt").write_text("\n".join(USERS) + "\n")
    argv = cli_args(window_dir, tmp_path, tmp_path / "out")
    argv += ["--steps", "1", "--user-file", str(tmp_path / "users.txt"), "--prompt-level", "kv",
            "--num-virtual-tokens", "6"]  # fmt: skip
    assert cli_main(argv) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_n_left_to_the_default_is_32_selected_plus_the_kept_positions_at_most_the_turn(tok, chat_dir, tmp_path):  # noqa: F811
    from peft import PeftModel

    one = {**KW, "steps": 1}
    plain = distill(_base(chat_dir), tok, SYSTEM, user_turns=USERS, **one)
    assert plain.distill_report.options.num_virtual_tokens == 16
    turn = len(prepare(tok, SYSTEM, True, 4).prefix_ids)
    assert turn > 32  # so that 32 selected positions fit, and 32 plus the kept ones don't
    assert distill(_base(chat_dir), tok, SYSTEM, **KV, **one).distill_report.options.num_virtual_tokens == 32
    capped = distill(_base(chat_dir), tok, SYSTEM, keep_text=FACTS, **KV, **one).distill_report
    assert capped.options.num_virtual_tokens == turn  # every position: the teacher
    longer = SYSTEM + " then " + SYSTEM.replace(FACTS, "")
    facts, frame = kept_positions(tok, prepare(tok, longer, True, 4), FACTS)
    kept = len(set(facts) | set(frame) | {0})
    assert kept + 32 < len(prepare(tok, longer, True, 4).prefix_ids)
    report = distill(_base(chat_dir), tok, longer, keep_text=FACTS, **KV, **one).distill_report
    assert report.options.num_virtual_tokens == kept + 32 and report.metrics()["kv_selected_positions"] == 32
    (tmp_path / "system.txt").write_text(longer + "\n")
    (tmp_path / "users.txt").write_text("\n".join(USERS) + "\n")
    (tmp_path / "facts.txt").write_text(FACTS + "\n")
    argv = cli_args(chat_dir, tmp_path, tmp_path / "out")
    argv += ["--steps", "1", "--batch-size", "4", "--user-file", str(tmp_path / "users.txt"),
            "--prompt-level", "kv", "--keep-file", str(tmp_path / "facts.txt")]  # fmt: skip
    assert cli_main(argv) == 0
    assert PeftModel.from_pretrained(_base(chat_dir), tmp_path / "out").peft_config["default"].num_virtual_tokens == (
        kept + 32
    )
