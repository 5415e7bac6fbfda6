"""The HF `Trainer` as a user drives it: default arguments, adapter-only checkpoints, bit-identical resume,
`load_best_model_at_end`, `evaluate`/`predict` with base-shaped logits, gradient checkpointing, and the example."""

import importlib.util
import json
import os
from typing import Optional

import pytest
import torch
from _versions import checkpointing_arg
from conftest import prompt_tuning_reference
from datasets import Dataset
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import EarlyStoppingCallback, GPTNeoConfig, GPTNeoForCausalLM, Trainer, TrainingArguments

import peft_softprompt_plus  # noqa: F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import tiny_family, tiny_gpt2, tiny_tokenizer
from peft_softprompt_plus.forward import paths as forward_paths

N = 4  # virtual tokens
LENGTH = 12  # every row is right-padded to this many tokens
SAVED_KEY = "base_model.softprompt_plus.prompt"
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_with_trainer.py")

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a soft prompt is a learned sequence of input embeddings",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white orange purple",
    "cat dog bird fish horse cow sheep goat",
    "hello world this is a tiny model for tests",
    "positive negative review movie film great terrible good bad",
    "answer question label sentiment topic color animal number",
]


def lm_dataset(tokenizer, sentences=SENTENCES) -> Dataset:
    """Right-padded rows with labels (-100 on padding) plus a `text` column the Trainer must drop by itself."""
    rows = {"text": [], "input_ids": [], "attention_mask": [], "labels": []}
    for text in sentences:
        ids = tokenizer(text)["input_ids"][:LENGTH]
        pad = LENGTH - len(ids)
        rows["text"].append(text)
        rows["input_ids"].append(ids + [tokenizer.pad_token_id] * pad)
        rows["attention_mask"].append([1] * len(ids) + [0] * pad)
        rows["labels"].append(ids + [-100] * pad)
    return Dataset.from_dict(rows)


def tiny_gpt_neo(seed: int = 0, vocab_size: Optional[int] = None) -> GPTNeoForCausalLM:
    """A tiny `*ForCausalLM` class: transformers gives it `loss_type='ForCausalLM'` (GPT-2's is None)."""
    config = GPTNeoConfig(
        vocab_size=vocab_size if vocab_size is not None else len(tiny_tokenizer()),
        max_position_embeddings=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global"], 2]],
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
    )
    torch.manual_seed(seed)
    return GPTNeoForCausalLM(config).eval()


def tiny_llama(seed: int = 0, vocab_size: Optional[int] = None):
    """A `*ForCausalLM` class whose attention runs through the registry (GPT-Neo's doesn't: no KV prompt there)."""
    return tiny_family("llama", vocab_size if vocab_size is not None else len(tiny_tokenizer()), seed=seed)


BASES = {"gpt2": tiny_gpt2, "gpt_neo": tiny_gpt_neo, "llama": tiny_llama}

# gpt_neo guards the token count: the Trainer counts `num_items_in_batch` over `labels[..., 1:]` for models whose
# `loss_type` is ForCausalLM (not GPT2LMHeadModel's), but with a prompt label 0 is a target too (tasks.py renames it).


def prompted(seed: int = 0, base: str = "gpt2", **config):
    config.setdefault("num_virtual_tokens", N)
    config.setdefault("init_seed", 0)
    return get_peft_model(BASES[base](seed=seed), SoftPromptPlusConfig(task_type="CAUSAL_LM", **config))


def prompt_of(model) -> torch.Tensor:
    return model.base_model.prompt("default").detach().clone()


def args(tmp_path, **overrides) -> TrainingArguments:
    """Everything at its default except what a CPU test needs: no logging integrations, few steps."""
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, per_device_train_batch_size=2)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def batch_of(dataset: Dataset) -> dict:
    return {k: torch.tensor(dataset[k]) for k in ("input_ids", "attention_mask", "labels")}


def test_default_training_arguments_train_only_the_prompt_and_save_only_the_adapter(tmp_path, tokenizer):
    model = prompted()
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    start = prompt_of(model)
    data = lm_dataset(tokenizer)
    defaults = TrainingArguments(output_dir=str(tmp_path))
    assert defaults.remove_unused_columns is True  # the string `text` column would break the collator if kept

    trainer = Trainer(model=model, args=args(tmp_path, learning_rate=1e-2, save_steps=2), train_dataset=data)
    result = trainer.train()

    assert result.global_step == 2
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(prompt_of(model), start)
    assert model.base_model.prompt("default").dtype == torch.float32
    for name, value in model.get_base_model().state_dict().items():
        assert torch.equal(value, base_before[name]), f"base weight {name} changed"
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in optimized] == [id(model.base_model.prompt("default"))]

    checkpoint = tmp_path / "checkpoint-2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert not {"model.safetensors", "pytorch_model.bin", "adapter_model.bin"} & files
    weights = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert set(weights) == {SAVED_KEY}
    assert weights[SAVED_KEY].dtype == torch.float32
    assert torch.equal(weights[SAVED_KEY], prompt_of(model))
    assert json.loads((checkpoint / "adapter_config.json").read_text())["peft_type"] == "SOFTPROMPT_PLUS"
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), str(checkpoint))
    assert torch.equal(prompt_of(reloaded), prompt_of(model))


def test_resume_from_checkpoint_is_bit_identical(tmp_path, tokenizer):
    data = lm_dataset(tokenizer)
    common = dict(max_steps=4, save_steps=2, learning_rate=1e-2, seed=7, data_seed=7)
    straight = prompted()
    Trainer(model=straight, args=args(tmp_path / "straight", **common), train_dataset=data).train()
    # The uninterrupted run's step-2 checkpoint is exactly what a run stopped after step 2 would have left behind.
    checkpoint = str(tmp_path / "straight" / "checkpoint-2")

    # A fresh process starts from a fresh model: a different prompt proves the checkpoint is what's restored.
    resumed = prompted(init_seed=123)
    second = Trainer(model=resumed, args=args(tmp_path / "resumed", **common), train_dataset=data)
    second.train(resume_from_checkpoint=checkpoint)

    assert second.state.global_step == 4
    assert torch.equal(prompt_of(resumed), prompt_of(straight))
    at_two = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))[SAVED_KEY]
    assert not torch.equal(at_two, prompt_of(straight))  # steps 3 and 4 really ran after the resume


def _highest_loss_trainer(tmp_path, tokenizer, model, max_steps: int, callbacks=()) -> Trainer:
    """A Trainer that evaluates and saves every step and keeps the checkpoint with the *highest* eval loss. Training
    lowers the eval loss, so the best checkpoint is an early one: the final prompt can only match it if the Trainer
    really reloaded the adapter."""
    data = lm_dataset(tokenizer)
    settings = dict(eval_strategy="steps", eval_steps=1, save_steps=1, load_best_model_at_end=True)
    best = dict(metric_for_best_model="eval_loss", greater_is_better=True)
    return Trainer(
        model=model,
        args=args(tmp_path, max_steps=max_steps, learning_rate=5e-2, **settings, **best),
        train_dataset=data,
        eval_dataset=data,
        callbacks=list(callbacks),
    )


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path, tokenizer):
    model = prompted()
    trainer = _highest_loss_trainer(tmp_path, tokenizer, model, max_steps=3)
    trainer.train()

    eval_losses = [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log]
    assert eval_losses[0] > eval_losses[-1], "training did not lower the eval loss; the test premise fails"
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-3")
    best_prompt = load_file(os.path.join(best, "adapter_model.safetensors"))[SAVED_KEY]
    last_prompt = load_file(str(tmp_path / "checkpoint-3" / "adapter_model.safetensors"))[SAVED_KEY]
    assert torch.equal(prompt_of(model), best_prompt)
    assert not torch.equal(best_prompt, last_prompt)
    # Loaded in place: still the trainable leaf the optimizer holds, so training can go on from here.
    param = model.base_model.prompt("default")
    assert param.requires_grad
    assert any(p is param for group in trainer.optimizer.param_groups for p in group["params"])


def test_early_stopping_stops_and_keeps_the_best_prompt(tmp_path, tokenizer):
    # The first evaluation is the best; the second runs out the patience.
    model = prompted()
    stop = EarlyStoppingCallback(early_stopping_patience=1)
    trainer = _highest_loss_trainer(tmp_path, tokenizer, model, max_steps=10, callbacks=[stop])
    trainer.train()
    assert trainer.state.global_step == 2  # stopped, not 10
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    best = load_file(str(tmp_path / "checkpoint-1" / "adapter_model.safetensors"))[SAVED_KEY]
    last = load_file(str(tmp_path / "checkpoint-2" / "adapter_model.safetensors"))[SAVED_KEY]
    assert torch.equal(prompt_of(model), best) and not torch.equal(best, last)


def reference_prompt_tuning(prompt: torch.Tensor, base: str = "gpt2"):
    """PEFT PROMPT_TUNING on the same base with the same prompt values: the loss oracle."""
    return prompt_tuning_reference(BASES[base](), prompt)


def test_evaluate_and_predict_give_base_shaped_logits_and_the_exact_loss(tmp_path, tokenizer):
    data = lm_dataset(tokenizer)
    model = prompted()
    seen = {}

    def compute_metrics(pred):
        seen["shapes"] = (pred.predictions.shape, pred.label_ids.shape)
        return {}

    trainer = Trainer(
        model=model,
        args=args(tmp_path, per_device_eval_batch_size=len(data)),
        eval_dataset=data,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    out = trainer.predict(data)

    vocab = model.config.vocab_size
    assert seen["shapes"] == ((len(data), LENGTH, vocab), (len(data), LENGTH))
    assert out.predictions.shape == (len(data), LENGTH, vocab)
    batch = batch_of(data)
    with torch.no_grad():
        ref_out = reference_prompt_tuning(prompt_of(model))(**batch)
        own = model.eval()(**batch)
    assert metrics["eval_loss"] == pytest.approx(ref_out.loss.item(), abs=1e-5)
    assert out.metrics["test_loss"] == pytest.approx(ref_out.loss.item(), abs=1e-5)
    real = batch["attention_mask"].bool()
    # PEFT's logits carry the N virtual positions; ours are the base shape, aligned with the text.
    torch.testing.assert_close(torch.from_numpy(out.predictions)[real], ref_out.logits[:, N:][real], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.from_numpy(out.predictions), own.logits, atol=1e-5, rtol=0)


class SpyingTrainer(Trainer):
    """Records each batch `compute_loss` receives, so the test can recompute the loss on exactly that batch."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.batches = getattr(self, "batches", [])
        self.batches.append({k: v.detach().clone() for k, v in inputs.items()})
        return super().compute_loss(model, inputs, *args, **kwargs)


@pytest.mark.parametrize("base", ["gpt2", "gpt_neo"])
def test_logged_training_loss_is_the_prompt_tuning_loss(tmp_path, tokenizer, base):
    data = lm_dataset(tokenizer)
    model = prompted(base=base)
    # lr=0 and one step: the logged loss is the initial prompt's, on the one batch the spy recorded.
    trainer = SpyingTrainer(
        model=model,
        args=args(tmp_path, max_steps=1, learning_rate=0.0, logging_steps=1, per_device_train_batch_size=len(data)),
        train_dataset=data,
    )
    trainer.train()

    (batch,) = trainer.batches
    with torch.no_grad():
        expected = reference_prompt_tuning(prompt_of(model), base)(**batch).loss.item()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected, abs=1e-5)


def test_gradient_checkpointing_keeps_the_attention_path(tmp_path, tokenizer, monkeypatch):
    data = lm_dataset(tokenizer)
    paths = []
    for name in ("attention_inputs", "concat_inputs"):
        original = getattr(forward_paths, name)
        monkeypatch.setattr(
            forward_paths, name, lambda *a, _name=name, _fn=original, **k: paths.append(_name) or _fn(*a, **k)
        )
    common = dict(max_steps=2, learning_rate=1e-2, seed=3, data_seed=3)

    plain = prompted()
    paths.clear()  # drop the attach-time gradient probe, which runs outside the Trainer
    Trainer(model=plain, args=args(tmp_path / "plain", **common), train_dataset=data).train()
    assert paths and set(paths) == {"attention_inputs"}

    checkpointed = prompted()
    paths.clear()
    Trainer(
        model=checkpointed, args=args(tmp_path / "ckpt", **checkpointing_arg(True), **common), train_dataset=data
    ).train()
    assert paths and set(paths) == {"attention_inputs"}  # the prompt still enters at the attention
    # Same data, same semantics: the two runs train the same prompt up to float rounding.
    torch.testing.assert_close(prompt_of(checkpointed), prompt_of(plain), atol=1e-5, rtol=0)
    assert not torch.equal(prompt_of(checkpointed), prompt_of(prompted()))


def test_example_trains_saves_and_reloads(tmp_path):
    spec = importlib.util.spec_from_file_location("train_with_trainer", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    report = example.main(["--output-dir", str(tmp_path), "--steps", "3", "--num-virtual-tokens", "4"])

    assert report["final_loss"] < report["initial_loss"]
    assert set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))) == {SAVED_KEY}
    assert isinstance(report["sample"], str)


@pytest.mark.parametrize("base", ["gpt2", "llama"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_kv_prompt_trains_with_the_loss_over_labels_one_on(tmp_path, tokenizer, base, accumulation):
    """A KV prompt predicts no label 0, so the Trainer must count labels 1.. (`num_items_in_batch`): the logged loss of
    a step is the mean cross-entropy over labels 1.. of its batches, gradient accumulation included."""
    data = lm_dataset(tokenizer)
    model = prompted(base=base, prompt_level="kv")
    assert model.get_base_model().loss_type == "ForCausalLM"  # how the Trainer knows to count labels 1..
    trainer = SpyingTrainer(
        model=model,
        args=args(
            tmp_path,
            max_steps=1,
            learning_rate=0.0,
            logging_steps=1,
            per_device_train_batch_size=len(data) // accumulation,
            gradient_accumulation_steps=accumulation,
        ),
        train_dataset=data,
    )
    trainer.train()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in trainer.batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            total += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            ).item()
            count += int((targets != -100).sum())
    assert len(trainer.batches) == accumulation
    assert trainer.state.log_history[0]["loss"] == pytest.approx(total / count, abs=1e-5)
    model.set_adapter("default")
    model.add_adapter("input", SoftPromptPlusConfig(num_virtual_tokens=N))
    model.set_adapter("input")
    assert model.get_base_model().loss_type == "ForSoftPromptedCausalLM"  # an input prompt predicts label 0
