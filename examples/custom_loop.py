"""A custom training loop that proves gradients reach the soft prompt before it trains, then trains it, keeping the
step with the lowest held-out loss and stopping when it stops improving (`KeepBest`).

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

from peft_softprompt_plus import KeepBest, SoftPromptPlusConfig, check_gradient_flow
from peft_softprompt_plus.apps.tiny import tiny_gpt2, tiny_tokenizer

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a soft prompt is a learned sequence of input embeddings",
    "gradients flow from the loss back to the prompt through the frozen model",
    "one two three four five six seven eight nine ten",
]
HELD_OUT = ["the lazy dog jumps over the quick brown fox", "ten nine eight seven six five four three two one"]


def load(path: str | None):
    if path is None:
        torch.set_num_threads(1)  # a model this small only loses time to thread synchronisation
        tokenizer = tiny_tokenizer()
        return tiny_gpt2(vocab_size=len(tokenizer)), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # GPT-2 ships without a pad token
    return AutoModelForCausalLM.from_pretrained(path), tokenizer


def make_batch(tokenizer, texts=TEXTS) -> dict:
    batch = dict(tokenizer(texts, return_tensors="pt", padding=True))
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # no loss on padding
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local GPT-2 checkpoint (default: the embedded tiny model)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--num-virtual-tokens", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)

    base, tokenizer = load(args.model)
    stale = torch.optim.AdamW(
        base.parameters(), lr=args.learning_rate
    )  # the mistake shown at the end: made before attaching
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=args.num_virtual_tokens, init_seed=0)
    model = get_peft_model(base, config)  # the attach-time probe already ran here
    batch = make_batch(tokenizer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)

    report = check_gradient_flow(model, batch, optimizer)
    print("before training:", report)
    report.raise_if_failed()

    held_out, keep = make_batch(tokenizer, HELD_OUT), KeepBest(patience=2, higher_is_better=False)
    for step in range(1, args.steps + 1):
        model.train()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 10 == 0:
            model.eval()
            with torch.no_grad():
                held_out_loss = model(**held_out).loss.item()
            print(f"step {step:3d}  loss {loss.item():.4f}  held-out loss {held_out_loss:.4f}")
            if keep.update(model, held_out_loss, step):
                print(f"held-out loss has not improved for {keep.patience} evaluations: stopping")
                break
    keep.restore(model)  # the prompt of the best evaluation, in place
    print(f"kept step {keep.best_step} (held-out loss {keep.best_score:.4f})")

    print("\nthe same check with the optimizer built before attaching the adapter:")
    print(check_gradient_flow(model, batch, stale))


if __name__ == "__main__":
    main()
