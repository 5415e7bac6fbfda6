"""Train a KV prompt with the Hugging Face `Trainer`, save it, reload it, generate, and convert it to PEFT CARTRIDGE.

A KV prompt (`prompt_level="kv"`) trains every attention layer's keys and values for N positions instead of N input
vectors (docs/concepts.md); this one starts from a one-line description of the task, every position trained, as on
the task suite (docs/training-recipe.md). Runs offline on the embedded tiny GPT-2 by default (seconds on a CPU):

    python examples/kv_prompt_trainer.py

On a real local checkpoint (e.g. `--model $(softprompt-plus fetch smollm2)`):

    python examples/kv_prompt_trainer.py --model PATH --output-dir out/kv --steps 120 --num-virtual-tokens 20 \
        --learning-rate 3e-3  # the task suite's KV rate (bench/RESULTS.md); 3e-2 suits the tiny model
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
from peft_softprompt_plus import SoftPromptPlusConfig, to_cartridge
from peft_softprompt_plus.apps.tiny import SAMPLE_TEXTS, save_tiny

TEXTS = SAMPLE_TEXTS  # replace with your own texts
DESCRIPTION = "red green blue cat dog bird"  # the task in a line: the KV prompt starts from its keys/values


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Base causal LM folder; default: the tiny GPT-2, built here.")
    parser.add_argument(
        "--output-dir", default=None, help="The adapter and its CARTRIDGE copy; default: a temp folder."
    )
    parser.add_argument(
        "--description", default=DESCRIPTION, help="The one-line task description the prompt starts from."
    )
    parser.add_argument("--num-virtual-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_base(path: str):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:  # GPT-2 ships without one; the collator needs it to pad batches
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="softprompt-kv-")
    # A folder, not an object: `prompt_init="text"` tokenizes the description with the base's own tokenizer.
    path = args.model or save_tiny(os.path.join(output_dir, "tiny-gpt2"))
    base, tokenizer = load_base(path)
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=args.num_virtual_tokens,
        prompt_level="kv",
        prompt_init="text",
        prompt_init_text=args.description,
        tokenizer_name_or_path=path,
    )
    model = get_peft_model(base, config)
    model.print_trainable_parameters()

    data = Dataset.from_dict({"text": TEXTS}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=args.max_length), remove_columns=["text"]
    )
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
        # A KV prompt predicts no text token 0: the loss runs over labels 1.., as PEFT's prefix methods'.
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    initial_loss = trainer.evaluate()["eval_loss"]
    trainer.train()
    final_loss = trainer.evaluate()["eval_loss"]

    adapter_dir = os.path.join(output_dir, "adapter")
    model.save_pretrained(adapter_dir)  # one tensor, [layers, 2, Hkv, N, hd]

    reloaded = PeftModel.from_pretrained(load_base(path)[0], adapter_dir).eval()
    inputs = tokenizer("red green", return_tensors="pt")
    with torch.no_grad():
        out = reloaded.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    sample = tokenizer.decode(out[0], skip_special_tokens=True)

    # The same keys/values in PEFT's CARTRIDGE layout: PEFT loads that folder without this package.
    cartridge_dir = os.path.join(output_dir, "cartridge")
    to_cartridge(reloaded, cartridge_dir)
    theirs = PeftModel.from_pretrained(load_base(path)[0], cartridge_dir).eval()
    with torch.no_grad():
        gap = (theirs(**inputs).logits - reloaded(**inputs).logits).abs().max().item()
    return {
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        "adapter_dir": adapter_dir,
        "sample": sample,
        "cartridge_dir": cartridge_dir,
        "cartridge_gap": gap,
    }


if __name__ == "__main__":
    report = main()
    print(f"eval loss {report['initial_loss']:.4f} -> {report['final_loss']:.4f}")
    print(f"KV adapter saved to {report['adapter_dir']}")
    print(f"sample: {report['sample']!r}")
    print(f"PEFT CARTRIDGE copy in {report['cartridge_dir']}: max logit difference {report['cartridge_gap']:.1e}")
