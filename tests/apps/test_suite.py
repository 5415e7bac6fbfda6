"""suite.py: three tasks from data wheels, each split once, the same on every machine, big enough to tell 3 points."""

import pytest

from peft_softprompt_plus.apps import suite


@pytest.mark.parametrize("name", sorted(suite.TASKS))
def test_each_task_is_fixed_disjoint_and_large(name):
    split = suite.load_task(name)
    assert (len(split.held_out), len(split.validation)) == (400, 100) and len(split.train) >= 400
    keys = [k for k, _ in split.train + split.validation + split.held_out]
    assert len(set(keys)) == len(keys)  # one answer per key, and no key in two parts
    assert all(k.strip() and a.strip() and "\n" not in k + a for k, a in split.train + split.held_out)
    assert suite.load_task(name) == split


def _all(split) -> dict:
    return dict(split.train + split.validation + split.held_out)


def test_known_items_and_bad_names():
    cities = _all(suite.load_task("cities"))
    assert cities.get("Osaka") == "Japan" and "Paris" not in cities  # Paris, Texas makes the name ambiguous
    assert _all(suite.load_task("emoji")).get("\U0001f693") == "police car"
    subdivisions = _all(suite.load_task("subdivisions"))
    assert subdivisions.get("Rhône") == "France" and subdivisions.get("Wales") == "United Kingdom"
    assert _all(suite.load_task("counties")).get("Los Angeles County") == "California"
    with pytest.raises(ValueError, match=r"`name` must be one of \['cities', 'counties', 'emoji', 'subdivisions'\]"):
        suite.load_task("x")


def test_the_chat_form_is_the_template_s_own_rendering_without_a_system_turn():
    from peft_softprompt_plus.apps import capitals
    from peft_softprompt_plus.apps.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = (  # like SmolLM2's: a default system turn when none is given, which the form must avoid
        "{% if messages[0]['role'] != 'system' %}<|system|>default\n{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    form = suite.form_of("chat", tok)
    assert form.question("Osaka") == "<|user|>Osaka\n<|assistant|>" and form.answer("Japan") == "Japan\n"
    turns = [{"role": "user", "content": "Osaka"}, {"role": "assistant", "content": "Japan"}]
    whole = tok.apply_chat_template(turns, tokenize=False)
    assert "<|system|>default\n" + capitals.few_shot_prefix([("Osaka", "Japan")], form) == whole
    ids, labels = capitals.encode(tok, "Osaka", "Japan", form=form)
    answer = tok("Japan\n", add_special_tokens=False)["input_ids"]
    assert labels[-len(answer) :] == answer and set(labels[: -len(answer)]) == {-100}
    assert suite.form_of("plain", tok) is capitals.PLAIN
    with pytest.raises(ValueError, match=r"`form` must be one of \['chat', 'plain'\], got 'json'"):
        suite.form_of("json", tok)
