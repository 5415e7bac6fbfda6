"""Train a soft prompt with the Hugging Face `Trainer`, save only the adapter, reload it and generate.

Runs offline on the embedded tiny GPT-2 by default (seconds on a laptop CPU):

    python examples/train_with_trainer.py

On a real checkpoint (a local folder or a Hub id):

    python examples/train_with_trainer.py --model gpt2 --steps 200 --num-virtual-tokens 20
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Optional

import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

import peft_softprompt_plus  # noqa: F401  (registers SOFTPROMPT_PLUS with PEFT; import it before any PEFT call)
from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import SAMPLE_TEXTS, tiny_gpt2, tiny_tokenizer

TEXTS = SAMPLE_TEXTS  # replace with your own texts


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Base causal LM (folder or Hub id); default: the tiny GPT-2.")
    parser.add_argument("--output-dir", default=None, help="Checkpoints and the adapter; default: a temp folder.")
    parser.add_argument("--num-virtual-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_base(name: Optional[str]):
    """The model and tokenizer to prompt; the tiny default needs no network."""
    if name is None:
        tokenizer = tiny_tokenizer()
        return tiny_gpt2(vocab_size=len(tokenizer)), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:  # GPT-2 ships without one; the collator needs it to pad batches
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(name), tokenizer


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    base, tokenizer = load_base(args.model)
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=args.num_virtual_tokens, init_seed=args.seed
    )
    model = get_peft_model(base, config)
    model.print_trainable_parameters()

    data = Dataset.from_dict({"text": TEXTS}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=args.max_length), remove_columns=["text"]
    )
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="softprompt-trainer-")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            logging_steps=max(1, args.steps // 5),
            save_strategy="no",
            report_to=[],
            seed=args.seed,
            dataloader_pin_memory=torch.cuda.is_available(),  # pinning without a GPU only warns
        ),
        train_dataset=data,
        eval_dataset=data,
        # Pads each batch and copies input_ids to labels, with -100 on the padding.
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    initial_loss = trainer.evaluate()["eval_loss"]
    trainer.train()
    final_loss = trainer.evaluate()["eval_loss"]

    # Only the prompt is written (a few KB), never the base weights.
    adapter_dir = os.path.join(output_dir, "adapter")
    model.save_pretrained(adapter_dir)

    fresh_base, _ = load_base(args.model)
    reloaded = PeftModel.from_pretrained(fresh_base, adapter_dir).eval()
    inputs = tokenizer("red green", return_tensors="pt")
    with torch.no_grad():
        out = reloaded.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    sample = tokenizer.decode(out[0], skip_special_tokens=True)
    return {"initial_loss": initial_loss, "final_loss": final_loss, "adapter_dir": adapter_dir, "sample": sample}


if __name__ == "__main__":
    report = main()
    print(f"eval loss {report['initial_loss']:.4f} -> {report['final_loss']:.4f}")
    print(f"adapter saved to {report['adapter_dir']}")
    print(f"sample: {report['sample']!r}")
