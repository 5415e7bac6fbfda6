"""Context tuning: a KV prompt started from k demonstrations and trained with leave-one-out (few-shot: the training
rows are the demonstrations themselves, and each row reads the prompt without its own positions).

Untrained, the prompt is exactly hard k-shot (docs/concepts.md, "Context tuning"); the loop below trains it on the
same k rows. Runs offline on the embedded tiny GPT-2 by default (seconds on a CPU):

    python examples/context_tuning.py

On a real local checkpoint (e.g. `--model $(softprompt-plus fetch smollm2)`) with your own rows, one per line:

    python examples/context_tuning.py --model PATH --rows rows.txt --k 16 --steps 120 --learning-rate 1e-3
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import peft_softprompt_plus  # noqa: F401  (registers SOFTPROMPT_PLUS with PEFT; import it before any PEFT call)
from peft_softprompt_plus import SoftPromptPlusConfig, pick_demonstrations
from peft_softprompt_plus.apps.tiny import SAMPLE_TEXTS, save_tiny


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local causal LM folder (default: a tiny GPT-2 made here)")
    parser.add_argument("--rows", help="a text file, one training row per line (default: the tiny model's texts)")
    parser.add_argument("--k", type=int, default=4, help="demonstrations")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--output-dir", default=None, help="where the adapter is saved (default: a temporary folder)")
    args = parser.parse_args(argv)
    path = args.model or save_tiny(tempfile.mkdtemp())
    rows = open(args.rows).read().split("\n") if args.rows else list(SAMPLE_TEXTS)
    rows = [r for r in rows if r.strip()]
    demos = [rows[i] for i in pick_demonstrations(rows, args.k, seed=0)]
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = SoftPromptPlusConfig(
        prompt_level="kv", prompt_init="demonstrations", prompt_init_texts=demos, num_virtual_tokens=None,
        tokenizer_name_or_path=path,
    )  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)
    spans = model.peft_config["default"].demonstration_spans
    print(f"{len(demos)} demonstrations, {model.peft_config['default'].num_virtual_tokens} positions; spans {spans}")
    optimizer = torch.optim.AdamW([model.base_model.prompt()], lr=args.learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(args.steps):  # each demonstration row reads the prompt without its own span (leave-one-out)
        demo = demos[step % len(demos)]
        ids = torch.tensor([tokenizer(demo, add_special_tokens=False)["input_ids"]])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1}: loss {loss.item():.4f}")
    out = args.output_dir or tempfile.mkdtemp()
    model.save_pretrained(out)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), out).eval()
    print(f"saved to {out}; its spans: {reloaded.peft_config['default'].demonstration_spans}")
    return {"demonstrations": demos, "losses": losses, "folder": out, "spans": spans}


if __name__ == "__main__":
    result = main()
