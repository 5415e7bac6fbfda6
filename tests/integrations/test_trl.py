"""TRL's `SFTTrainer` as a user drives it: `peft_config=SoftPromptPlusConfig(...)` on a plain GPT-2.

SFTTrainer wraps the inner model's forward with a fused LM head and computes the loss and its metrics itself from
the labels that reach that forward, so those labels must arrive, and the loss, entropy and token accuracy it logs
must equal the ones PEFT PROMPT_TUNING gives for the same prompt values (which include predicting text token 0).
"""

import pytest
import torch
from _versions import checkpointing_arg, is_checkpointing
from conftest import prompt_tuning_reference
from datasets import Dataset
from peft import PeftModel, get_peft_model
from test_trainer import tiny_gpt_neo
from trl import SFTConfig, SFTTrainer

import peft_softprompt_plus  # noqa: F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig, SoftPromptPlusModel
from peft_softprompt_plus.apps.tiny import tiny_gpt2

N = 4  # virtual tokens
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white orange purple",
    "cat dog bird fish horse cow sheep goat",
    "hello world this is a tiny model for tests",
    "a soft prompt is a learned sequence of input embeddings",
]
PAIRS = [
    ("answer question color", "red green blue"),
    ("answer question animal", "cat dog bird fish"),
    ("answer question number", "one two three"),
    ("label sentiment", "positive review good film"),
]


BASES = {"gpt2": lambda vocab: tiny_gpt2(vocab_size=vocab), "gpt_neo": lambda vocab: tiny_gpt_neo(vocab_size=vocab)}


def soft_prompt_config() -> SoftPromptPlusConfig:
    return SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0)


def sft_args(tmp_path, **overrides) -> SFTConfig:
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, per_device_train_batch_size=4)
    kwargs.update(save_strategy="no", logging_steps=1)
    kwargs.update(overrides)
    return SFTConfig(**kwargs)


class SpyingSFTTrainer(SFTTrainer):
    """Records each batch `compute_loss` receives, so the test can recompute the loss on exactly that batch."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.batches = getattr(self, "batches", [])
        self.batches.append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return super().compute_loss(model, inputs, *args, **kwargs)


def test_sft_trainer_trains_a_soft_prompt_from_peft_config(tmp_path, tokenizer):
    base = tiny_gpt2(vocab_size=len(tokenizer))
    base_before = {k: v.clone() for k, v in base.state_dict().items()}
    data = Dataset.from_dict({"text": TEXTS})
    seen = {}

    def compute_metrics(pred):
        seen["shapes"] = (pred.predictions.shape, pred.label_ids.shape)
        return {}

    trainer = SFTTrainer(
        model=base,
        args=sft_args(tmp_path, learning_rate=1e-2, per_device_eval_batch_size=len(TEXTS)),
        peft_config=soft_prompt_config(),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    model = trainer.model
    assert isinstance(model, PeftModel) and isinstance(model.base_model, SoftPromptPlusModel)
    assert model.peft_config["default"].is_prompt_learning is False
    prompt = model.base_model.prompt("default")
    start = prompt.detach().clone()

    # Wrap the forward TRL installed on the inner GPT-2 and look at what the tuner hands it.
    inner = model.get_base_model()
    fused_forward = inner.forward
    calls = []

    def spy(*args, **kwargs):
        text = kwargs.get("inputs_embeds", kwargs.get("input_ids"))
        calls.append((kwargs.get("fused_lm_head"), kwargs.get("labels"), text.shape[1], is_checkpointing(inner)))
        return fused_forward(*args, **kwargs)

    inner.forward = spy
    trainer.train()

    assert len(calls) == 2
    for fused, labels, length, checkpointing in calls:
        assert fused is True and checkpointing is True  # SFTConfig turns gradient checkpointing on by default
        assert labels is not None and labels.shape[1] == length
        # TRL's fused head reads the labels, so the last prompt position rides with the text (checkpointing on or
        # off); the other N-1 reach the attention as shared keys/values.
        assert (labels[:, :1] == -100).all() and (labels[:, 1:] != -100).any()
    logs = trainer.state.log_history
    for key in ("loss", "entropy", "mean_token_accuracy"):
        assert torch.isfinite(torch.tensor(logs[0][key])), key
    assert not torch.equal(prompt.detach(), start)
    for name, value in base.state_dict().items():
        assert torch.equal(value, base_before[name]), f"base weight {name} changed"

    calls.clear()
    metrics = trainer.evaluate()
    # trl#3812: the token accuracy and `compute_metrics` must see logits shaped like the labels, `[B, L, V]`.
    (pred_shape, label_shape) = seen["shapes"]
    assert pred_shape == (*label_shape, model.config.vocab_size)
    assert 0.0 <= metrics["eval_mean_token_accuracy"] <= 1.0


def greedy_rows(model, rows: int = 6) -> list[list[int]]:
    """Rows the prompted model itself continues greedily: most next-token predictions are then right, which makes the
    token-accuracy comparison meaningful (a random tiny model is otherwise right about 0% of the time)."""
    g = torch.Generator().manual_seed(1)
    out = []
    with torch.no_grad():
        for r in range(rows):
            start = torch.randint(2, 300, (1, 2 + r % 3), generator=g)
            seq = model.generate(input_ids=start, max_new_tokens=5 + r % 4, do_sample=False, pad_token_id=1)
            out.append(seq[0].tolist())
    return out


def dataset_for(kind: str, model) -> Dataset:
    if kind == "greedy":
        return Dataset.from_dict({"input_ids": greedy_rows(model)})  # pre-tokenized: labels == input_ids
    prompts, completions = zip(*PAIRS, strict=True)
    return Dataset.from_dict({"prompt": list(prompts), "completion": [" " + c for c in completions]})


def reference(base, prompt: torch.Tensor, batch: dict) -> dict:
    """Loss, entropy and token accuracy from PEFT PROMPT_TUNING's `[B, N+L, V]` logits for the same prompt values."""
    ref = prompt_tuning_reference(base, prompt)
    labels = batch["labels"]
    with torch.no_grad():
        out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    logits = out.logits[:, N - 1 : -1]  # [B, L, V]: position N-1+i predicts text token i
    valid = labels != -100
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return {
        "loss": out.loss.item(),
        "entropy": entropy[valid].mean().item(),
        "mean_token_accuracy": (logits.argmax(-1) == labels)[valid].float().mean().item(),
    }


@pytest.mark.parametrize(
    "base_name, kind, checkpointing",
    [
        ("gpt2", "greedy", True),
        ("gpt2", "prompt_completion", True),
        ("gpt_neo", "greedy", True),
        # Without checkpointing the shared-KV path runs, and TRL's fused head must still see token 0's prediction.
        ("gpt2", "greedy", False),
    ],
)
def test_sft_loss_and_metrics_equal_prompt_tuning(tmp_path, tokenizer, base_name, kind, checkpointing):
    vocab = len(tokenizer)
    data_model = get_peft_model(BASES[base_name](vocab), soft_prompt_config()).eval()
    data = dataset_for(kind, data_model)
    # lr=0: the logged step-1 numbers are those of the initial prompt, so the reference can be computed afterwards.
    # bf16 off: SFTConfig defaults it on, and the oracle is float32.
    trainer = SpyingSFTTrainer(
        model=BASES[base_name](vocab),
        args=sft_args(
            tmp_path,
            max_steps=1,
            learning_rate=0.0,
            bf16=False,
            per_device_train_batch_size=len(data),
            **checkpointing_arg(checkpointing),
        ),
        peft_config=soft_prompt_config(),
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()

    (batch,) = trainer.batches
    if kind == "prompt_completion":
        assert (batch["labels"][:, 0] == -100).all()  # completion-only loss masked the prompt text
    prompt = trainer.model.base_model.prompt("default").detach()
    expected = reference(BASES[base_name](vocab), prompt, batch)
    with torch.no_grad():
        own = trainer.model.eval()(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss.item()
    logged = trainer.state.log_history[0]

    assert own == pytest.approx(expected["loss"], abs=1e-5)
    assert logged["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert logged["entropy"] == pytest.approx(expected["entropy"], abs=1e-4)
    assert logged["mean_token_accuracy"] == pytest.approx(expected["mean_token_accuracy"], abs=1e-6)
    if kind == "greedy":
        assert expected["mean_token_accuracy"] > 0.4, "the greedy rows should make most predictions right"


@pytest.mark.parametrize("option", [{"padding_free": True, "max_length": None}, {"packing": True, "max_length": 16}])
def test_packing_and_padding_free_are_refused_with_a_clear_error(tmp_path, tokenizer, option):
    # Both feed position ids of several documents packed into one row; one soft prompt can't sit before each of them.
    trainer = SFTTrainer(
        model=tiny_gpt2(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, max_steps=1, **option),
        peft_config=soft_prompt_config(),
        train_dataset=Dataset.from_dict({"text": TEXTS}),
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match="`position_ids` can't be passed to a soft-prompted forward"):
        trainer.train()


def test_dpo_with_its_defaults_trains_the_prompt_and_leaves_the_base_bit_identical(tmp_path, tokenizer):
    # DPOConfig turns gradient checkpointing on by default; the reference is the same model with the adapter off.
    from trl import DPOConfig, DPOTrainer

    base = tiny_gpt2(vocab_size=len(tokenizer))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    data = Dataset.from_dict(
        {
            "prompt": [p for p, _ in PAIRS],
            "chosen": [" " + c for _, c in PAIRS],
            "rejected": [" " + c[::-1] for _, c in PAIRS],
        }
    )
    args = DPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="no",
        learning_rate=1e-2,
    )
    assert args.gradient_checkpointing  # the default this test is about
    trainer = DPOTrainer(
        model=base, args=args, train_dataset=data, processing_class=tokenizer, peft_config=soft_prompt_config()
    )
    prompt = trainer.model.base_model.prompt("default")
    start = prompt.detach().clone()
    grads = []
    prompt.register_hook(lambda g: grads.append(g.norm().item()))
    trainer.train()
    assert grads and all(g > 0 for g in grads)  # the prompt received a gradient at each step
    assert not torch.equal(prompt.detach(), start)
    for name, value in base.state_dict().items():
        assert torch.equal(value, before[name]), f"base weight {name} changed"


def test_sft_trainer_trains_a_kv_prompt_with_its_defaults(tmp_path, tokenizer):
    """TRL's defaults (checkpointing, its fused head reading the labels) with a KV prompt: the logged loss is the mean
    cross-entropy over labels 1.. (nothing predicts label 0), the prompt moves and the base doesn't."""
    base = tiny_gpt2(vocab_size=len(tokenizer))
    base_before = {k: v.clone() for k, v in base.state_dict().items()}
    data = Dataset.from_dict({"text": TEXTS})
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0, prompt_level="kv")
    trainer = SpyingSFTTrainer(
        model=base,
        args=sft_args(tmp_path, max_steps=1, learning_rate=0.0, bf16=False, per_device_train_batch_size=len(TEXTS)),
        peft_config=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    (batch,) = trainer.batches
    model = trainer.model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))
    assert trainer.state.log_history[0]["loss"] == pytest.approx(want.item(), abs=1e-5)
    for name, value in base.state_dict().items():
        assert torch.equal(value, base_before[name]), name

    moving = SFTTrainer(
        model=tiny_gpt2(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path / "moving", max_steps=2, learning_rate=1e-2),
        peft_config=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    start = moving.model.base_model.prompt("default").detach().clone()
    moving.train()
    assert not torch.equal(moving.model.base_model.prompt("default").detach(), start)
