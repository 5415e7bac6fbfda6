"""Context tuning with the Trainer: a KV prompt started from k of the training rows (their keys/values, positions
chosen per layer and KV head), trained on every row with leave-one-out told by a `demonstration_index` column.

Many-shot: the k demonstrations are among the training rows. The collator below pads each batch and adds
`demonstration_index`, the demonstration a row is (-1: none), so a row that is demonstration i reads no entry
whose origin lies in i's span, in any layer and head; the Trainer keeps the column with
`remove_unused_columns=False`. Runs offline on the embedded tiny GPT-2 by default (seconds on a CPU):

    python examples/context_tuning_trainer.py

On a real local checkpoint with your own rows, one per line (numbers from bench/RESULTS.md, "Task suite: context
tuning"):

    python examples/context_tuning_trainer.py --model PATH --rows rows.txt --k 16 --num-virtual-tokens 20 \\
        --steps 120 --learning-rate 1e-3
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Optional

import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import peft_softprompt_plus  # noqa: F401  (registers SOFTPROMPT_PLUS with PEFT; import it before any PEFT call)
from peft_softprompt_plus import LeaveOneOutLogCallback, SoftPromptPlusConfig, pick_demonstrations
from peft_softprompt_plus.apps.tiny import SAMPLE_TEXTS, save_tiny


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="A local causal LM folder; default: a tiny GPT-2 made here.")
    parser.add_argument("--rows", default=None, help="A text file, one training row per line (default: tiny texts).")
    parser.add_argument("--output-dir", default=None, help="Checkpoints and the adapter; default: a temp folder.")
    parser.add_argument("--k", type=int, default=4, help="Demonstrations, picked from the rows.")
    parser.add_argument("--num-virtual-tokens", type=int, default=6, help="Entries kept per layer and KV head.")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class DemonstrationCollator:
    """Right-pads `input_ids`, copies them to `labels` (-100 on the padding) and passes `demonstration_index`."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
            mask[b, : len(row["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        index = torch.tensor([r["demonstration_index"] for r in rows])  # [B], -1: not a demonstration
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "demonstration_index": index}


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    path = args.model or save_tiny(tempfile.mkdtemp())
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [r for r in (open(args.rows).read().split("\n") if args.rows else SAMPLE_TEXTS) if r.strip()]
    picked = pick_demonstrations(rows, args.k, seed=args.seed)
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", prompt_level="kv", prompt_init="demonstrations",
        prompt_init_texts=[rows[i] for i in picked], num_virtual_tokens=args.num_virtual_tokens,
        kv_selection="per_head", tokenizer_name_or_path=path,
    )  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)
    which = {row: i for i, row in enumerate(picked)}  # row index -> the demonstration it is
    data = Dataset.from_dict(
        {
            "input_ids": [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rows],
            "demonstration_index": [which.get(i, -1) for i in range(len(rows))],
        }
    )
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="softprompt-context-")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            weight_decay=0.0,
            logging_steps=max(1, args.steps // 4),
            save_strategy="no",
            report_to=[],
            seed=args.seed,
            remove_unused_columns=False,  # else the Trainer drops `demonstration_index` (the base forward lacks it)
            dataloader_pin_memory=torch.cuda.is_available(),
        ),
        train_dataset=data,
        data_collator=DemonstrationCollator(tokenizer.pad_token_id or 0),
        callbacks=[LeaveOneOutLogCallback()],  # each log entry: the rows that were, and weren't, a demonstration
    )
    trainer.train()
    counts = dict(model.base_model.forward_state.leave_one_out)  # rows that were a demonstration, and not
    logged = [e for e in trainer.state.log_history if "leave_one_out_matched" in e]
    print(f"leave-one-out rows: {counts}; in the Trainer's log at step {logged[-1]['step']}")
    adapter_dir = os.path.join(output_dir, "adapter")
    model.save_pretrained(adapter_dir)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapter_dir).eval()
    print(f"saved to {adapter_dir}: {reloaded.peft_config['default'].num_virtual_tokens} entries per layer and head")
    return {"counts": counts, "logged": logged, "adapter_dir": adapter_dir, "demonstrations": picked}


if __name__ == "__main__":
    result = main()
