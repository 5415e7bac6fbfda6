"""Mixed-adapter batches (routing.py): each row reads its own soft prompt, in training and in generate. The
reference is each row run alone with its adapter (or the base model for a `"__base__"` row)."""

import pytest
import torch
from conftest import random_ids
from peft import get_peft_model
from transformers import Trainer, TrainingArguments
from transformers.loss.loss_utils import ForCausalLMLoss

from peft_softprompt_plus import SoftPromptPlusConfig

LENGTHS = {"a": 3, "b": 6, "c": 4}  # adapters may differ in num_virtual_tokens
ROWS = ["a", "b", "__base__", "c", "a"]


@pytest.fixture
def model(make_base):
    # A wider init gives the random model real attention, so a wrong prompt anywhere changes the tokens.
    model = get_peft_model(
        make_base(initializer_range=0.5),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=LENGTHS["a"]),
        adapter_name="a",
    )
    for name in ("b", "c"):
        model.add_adapter(name, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=LENGTHS[name]))
    with torch.no_grad():
        for name in LENGTHS:
            model.base_model.prompt(name).normal_(0.0, 1.0).requires_grad_(True)
    return model.eval()


def left_padded(seed=0):
    ids = random_ids(len(ROWS), 7, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :2] = 0
    mask[4, :1] = 0
    return ids.masked_fill(mask == 0, 1), mask


def right_padded(seed=0):
    ids, mask = left_padded(seed)
    return ids.flip(1), mask.flip(1)


def alone(model, name, **inputs):
    """Row(s) run with one adapter, or the base model for `__base__`."""
    if name == "__base__":
        with model.disable_adapter():
            return model(**inputs)
    model.base_model.set_adapter(name)
    for other in model.peft_config:
        model.base_model.prompt(other).requires_grad_(True)  # set_adapter freezes the inactive ones
    return model(**inputs)


def test_mixed_logits_equal_each_row_alone(model):
    ids, mask = left_padded()
    mixed = model(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    assert mixed.shape == (5, 7, model.config.vocab_size)  # base-shaped, whatever the prompts' lengths
    for row, name in enumerate(ROWS):
        real = mask[row].bool()
        single = alone(model, name, input_ids=ids[row : row + 1, real]).logits[0]
        torch.testing.assert_close(mixed[row, real], single, atol=1e-4, rtol=1e-4)


def test_a_base_row_equals_the_base_model(model, make_base):
    ids, mask = left_padded()
    mixed = model(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    base = make_base(initializer_range=0.5)
    real = mask[2].bool()
    torch.testing.assert_close(mixed[2, real], base(input_ids=ids[2:3, real]).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt_in_text", [False, True])
def test_loss_and_gradients_are_the_sums_over_rows(model, prompt_in_text):
    if prompt_in_text:
        # Any loss but transformers' own runs the last prompt position in the text pass.
        model.get_base_model().loss_function = lambda *a, **k: ForCausalLMLoss(*a, **k)
    model.train()
    # Right padding: under left padding a row's first token is predicted from the pad before it, as in PEFT.
    ids, mask = right_padded(seed=1)
    labels = ids.masked_fill(mask == 0, -100)
    items = torch.tensor(23)
    mixed = model(input_ids=ids, attention_mask=mask, labels=labels, adapter_names=ROWS, num_items_in_batch=items)
    grads = torch.autograd.grad(mixed.loss, [model.base_model.prompt(n) for n in LENGTHS])
    total, want = 0.0, {n: torch.zeros_like(model.base_model.prompt(n)) for n in LENGTHS}
    for row, name in enumerate(ROWS):
        real = mask[row].bool()
        one = alone(
            model,
            name,
            input_ids=ids[row : row + 1, real],
            labels=labels[row : row + 1, real],
            num_items_in_batch=items,
        )
        total = total + one.loss.detach()
        if name != "__base__":
            want[name] += torch.autograd.grad(one.loss, model.base_model.prompt(name))[0]
    torch.testing.assert_close(mixed.loss.detach(), total, atol=1e-5, rtol=1e-5)
    for name, got in zip(LENGTHS, grads, strict=True):
        torch.testing.assert_close(got, want[name], atol=1e-5, rtol=1e-4)


def test_without_num_items_the_loss_averages_over_every_target(model):
    # A prompted row's label 0 is a target (its last prompt position predicts it); a base row's is not.
    ids, mask = right_padded(seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    targets = int((labels != -100).sum()) - int(labels[2, 0] != -100)
    plain = model(input_ids=ids, attention_mask=mask, labels=labels, adapter_names=ROWS).loss
    counted = model(
        input_ids=ids, attention_mask=mask, labels=labels, adapter_names=ROWS, num_items_in_batch=torch.tensor(targets)
    ).loss
    torch.testing.assert_close(plain, counted)


def test_greedy_generate_equals_each_row_alone(model):
    ids, mask = left_padded(seed=3)
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=ROWS, max_new_tokens=6, do_sample=False)
    for row, name in enumerate(ROWS):
        real = mask[row].bool()
        if name == "__base__":
            with model.disable_adapter():
                single = model.generate(input_ids=ids[row : row + 1, real], max_new_tokens=6, do_sample=False)
        else:
            model.base_model.set_adapter(name)
            single = model.generate(input_ids=ids[row : row + 1, real], max_new_tokens=6, do_sample=False)
        assert torch.equal(out[row, 7:], single[0, real.sum() :]), f"row {row} ({name})"


def test_one_name_for_every_row_is_the_one_prompt_path(model):
    ids = random_ids(3, 5)
    model.base_model.set_adapter("a")
    routed = model(input_ids=ids, adapter_names=["b", "b", "b"]).logits
    model.base_model.set_adapter("b")
    torch.testing.assert_close(routed, model(input_ids=ids).logits)


@pytest.mark.parametrize(
    ("names", "words"),
    [
        (["a", "nope", "b"], ["'nope'", "adapters: ['a', 'b', 'c']"]),
        (["a", "b"], ["`adapter_names` has 2 entries", "3 rows"]),
        ("a", ["must be a list", "str"]),
    ],
)
def test_bad_adapter_names_are_refused(model, names, words):
    with pytest.raises(ValueError) as err:
        model(input_ids=random_ids(3, 5), adapter_names=names)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ValueError):
        model.generate(input_ids=random_ids(3, 5), adapter_names=names, max_new_tokens=2)


def test_a_name_that_is_not_a_string_is_refused(model):
    # PeftModel.forward hashes each name before the tuner sees them; the tuner itself names the entry.
    with pytest.raises(ValueError, match=r"must hold adapter names \(str\), or lists .*got 3 \(int\)"):
        model.base_model(input_ids=random_ids(3, 5), adapter_names=[3, "a", "a"])
    # A list composes KV adapters only; these are input adapters.
    with pytest.raises(ValueError, match=r"row 0 composes \['a', 'b'\].*input adapter.*only KV adapters"):
        model(input_ids=random_ids(3, 5), adapter_names=[["a", "b"], "a", "a"])


def test_mixed_rows_on_the_concat_path_are_refused(model):
    model.base_model.peft_config["b"].forward_path = "concat"
    with pytest.raises(ValueError, match="needs the prompt at the attention"):
        model(input_ids=random_ids(2, 5), adapter_names=["a", "b"])
    with pytest.raises(ValueError, match="needs the prompt at the attention"):
        model.generate(input_ids=random_ids(2, 5), adapter_names=["b", "__base__"], max_new_tokens=2)
    model(input_ids=random_ids(2, 5), adapter_names=["b", "b"])  # one prompt for the batch: concat can run it


class _Collator:
    """Pads rows and turns each row's `task` into `adapter_names`: multi-task prompt tuning with the Trainer."""

    def __call__(self, rows):
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), 1)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r["input_ids"]) :] = torch.tensor(r["input_ids"])
            mask[i, width - len(r["input_ids"]) :] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
            "adapter_names": [r["task"] for r in rows],
        }


def test_the_trainer_trains_several_prompts_in_one_batch(model, tmp_path):
    from datasets import Dataset

    start = {n: model.base_model.prompt(n).detach().clone() for n in LENGTHS}
    base = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    rows = [{"input_ids": random_ids(1, 4 + i % 3, seed=i)[0].tolist(), "task": ["a", "b"][i % 2]} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        use_cpu=True,
        remove_unused_columns=False,
        report_to=[],
        save_strategy="no",
    )
    Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=_Collator()).train()
    assert not torch.equal(model.base_model.prompt("a"), start["a"])
    assert not torch.equal(model.base_model.prompt("b"), start["b"])
    assert torch.equal(model.base_model.prompt("c"), start["c"])  # no row read it
    for key, value in model.get_base_model().state_dict().items():
        assert torch.equal(value, base[key]), key


def test_sequence_classification_pools_and_scores_each_row_with_its_adapter(make_base):
    base = make_base(task="SEQ_CLS", num_labels=3, initializer_range=0.5)
    config = dict(task_type="SEQ_CLS", init_seed=0)
    model = get_peft_model(base, SoftPromptPlusConfig(num_virtual_tokens=3, **config), adapter_name="a")
    model.add_adapter("b", SoftPromptPlusConfig(num_virtual_tokens=5, **config))
    with torch.no_grad():  # distinct heads, so a row scored by the wrong copy shows
        model.base_model.model.score.modules_to_save["b"].weight.normal_()
    model.eval()
    ids = random_ids(3, 6)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # right padding: pooling must take the last real token
    mask[2, :2] = 0
    names = ["b", "__base__", "a"]
    mixed = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    assert mixed.shape == (3, 3)
    for row, name in enumerate(names):
        real = mask[row].bool()
        single = alone(model, name, input_ids=ids[row : row + 1, real]).logits
        torch.testing.assert_close(mixed[row : row + 1], single, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_serving_example_answers_each_task_from_one_batch(tmp_path):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "many_tasks_one_batch.py"
    spec = importlib.util.spec_from_file_location("many_tasks_one_batch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    result = example.main(["--steps", "60", "--out", str(tmp_path)])

    assert result["correct"] == {"up": 2, "down": 2}  # held-out words, both tasks, in one mixed batch
    by_task = {}
    for (task, _), answer in zip(result["requests"], result["answers"], strict=True):
        by_task.setdefault(task, []).append(answer)
    assert by_task["down"] != by_task["__base__"]  # the prompt, not the base, gives the answer
    assert {p.name for p in tmp_path.iterdir()} >= {"up", "down"}
