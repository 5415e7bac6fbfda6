"""Distill a system prompt into soft tokens twice, an input student and a KV student, and print each report.

`distill_prompt` has the frozen model read the system prompt (the teacher) and trains N soft tokens to make the
same model, without it, answer the same way (docs/distillation.md). Runs offline by default on a tiny chat model built
here (seconds on a CPU; a random model, so the figures only show the report's shape):

    python examples/distill_system_prompt.py

On a real local chat checkpoint (e.g. `--model $(softprompt-plus fetch smollm2)`), the teacher writes the user turns:

    python examples/distill_system_prompt.py --model PATH --system-prompt-file prompt.txt --steps 60 \\
        --num-virtual-tokens 32 --output-dir out/distilled
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Optional

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import DistillOptions, distill_prompt
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_tokenizer

# In the tiny tokenizer's vocabulary, so the tiny teacher reads real tokens.
SYSTEM_PROMPT = "a soft prompt is a learned sequence of input embeddings. answer with red green blue and the quick fox"
USER_TURNS = ["hello world", "one two three", "cat dog bird", "the lazy dog", "red blue", "fish horse cow"]
HELD_OUT_TURNS = ["answer question", "white black orange"]
# What the tiny run samples: a few short continuations, so it takes seconds.
TINY_SAMPLING = dict(batch_size=4, max_new_tokens=6, samples_per_turn=2, held_out_samples_per_turn=1)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="A chat model folder; default: a tiny chat Llama built here.")
    parser.add_argument("--system-prompt-file", default=None, help="The system prompt; default: a tiny one.")
    parser.add_argument("--output-dir", default=None, help="The two students; default: a temp folder.")
    parser.add_argument("--num-virtual-tokens", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def tiny_chat_model():
    """A seeded tiny Llama and the tiny tokenizer with ChatML turns; a wider init than the default gives the random
    model attention that depends on the system prompt, so there is a gap to close."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template, tokenizer.eos_token = CHATML, "<|im_end|>"
    llama = {**FAMILIES["llama"][1], "eos_token_id": tokenizer.eos_token_id}
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), initializer_range=0.2, **llama)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), tokenizer


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="softprompt-distill-")
    system_prompt = SYSTEM_PROMPT
    if args.system_prompt_file is not None:
        with open(args.system_prompt_file) as handle:
            system_prompt = handle.read().strip()
    tiny = args.model is None
    # The tiny run gives its own user turns; on a real model the teacher writes them (DistillOptions.sampled_turns).
    data = dict(user_turns=USER_TURNS, held_out_turns=HELD_OUT_TURNS) if tiny else {}
    reports = {}
    for level in ("input", "kv"):
        # A fresh base each time: the student is attached to the model it is given.
        base, tokenizer = tiny_chat_model() if tiny else _load(args.model)
        options = DistillOptions(
            num_virtual_tokens=args.num_virtual_tokens,
            prompt_level=level,  # lr, start and self-study: each level's measured defaults
            steps=args.steps,
            seed=args.seed,
            evaluate_at=(0, args.steps),
            **(TINY_SAMPLING if tiny else {}),
        )
        student = distill_prompt(base, tokenizer, system_prompt, options, **data)
        student.save_pretrained(os.path.join(output_dir, level))
        reports[level] = student.distill_report
        data = {"samples": student.distill_report.samples}  # the second student learns from the same teacher rows
    return {"reports": reports, "output_dir": output_dir}


def _load(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    result = main()
    for level, report in result["reports"].items():
        print(f"--- {level} student, saved to {os.path.join(result['output_dir'], level)}")
        print("\n".join(report.lines()))
