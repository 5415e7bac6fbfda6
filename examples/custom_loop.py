"""A custom training loop that proves gradients reach the soft prompt before it trains, then trains it.

Offline by default (the package's tiny seeded GPT-2); `--model PATH` runs it on a real GPT-2 checkpoint.

    python examples/custom_loop.py [--model PATH] [--steps 30]

It ends by running the same check on a classic mistake (an optimizer built before attaching the adapter), to show
what a failing report looks like.
"""

from __future__ import annotations

import argparse

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import SoftPromptPlusConfig, check_gradient_flow
from peft_softprompt_plus.apps.tiny import tiny_gpt2, tiny_tokenizer

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a soft prompt is a learned sequence of input embeddings",
    "gradients flow from the loss back to the prompt through the frozen model",
    "one two three four five six seven eight nine ten",
]


def load(path: str | None):
    if path is None:
        torch.set_num_threads(1)  # a model this small only loses time to thread synchronisation
        tokenizer = tiny_tokenizer()
        return tiny_gpt2(vocab_size=len(tokenizer)), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # GPT-2 ships without a pad token
    return AutoModelForCausalLM.from_pretrained(path), tokenizer


def make_batch(tokenizer) -> dict:
    batch = dict(tokenizer(TEXTS, return_tensors="pt", padding=True))
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # no loss on padding
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local GPT-2 checkpoint (default: the embedded tiny model)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--virtual-tokens", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)

    base, tokenizer = load(args.model)
    stale = torch.optim.AdamW(base.parameters(), lr=args.lr)  # the mistake shown at the end: made before attaching
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=args.virtual_tokens, init_seed=0)
    model = get_peft_model(base, config)  # the attach-time probe already ran here
    batch = make_batch(tokenizer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    report = check_gradient_flow(model, batch, optimizer)
    print("before training:", report)
    report.raise_if_failed()

    model.train()
    for step in range(1, args.steps + 1):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    print("\nthe same check with the optimizer built before attaching the adapter:")
    print(check_gradient_flow(model, batch, stale))


if __name__ == "__main__":
    main()
