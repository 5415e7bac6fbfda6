"""Prompt-tune a frozen GPT-2, push the adapter (config, float32 prompt, model card) to a Hub endpoint, and load it
back from there.

Offline by default: with no --endpoint it starts the loopback fake Hub from tests/_hub_server.py (in memory, on
127.0.0.1) and uses the embedded tiny GPT-2:

    python examples/push_to_hub.py

Any Hub-compatible endpoint, e.g. one started with `python tests/_hub_server.py`, or the real Hub (HF_TOKEN set):

    python examples/push_to_hub.py --endpoint http://127.0.0.1:PORT
    python examples/push_to_hub.py --endpoint https://huggingface.co --repo you/gpt2-softprompt --model gpt2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

# Inline rather than from peft_softprompt_plus.apps.tiny: nothing that imports huggingface_hub may load before the
# endpoint is set. Replace with your own texts.
TEXTS = [
    "red green blue yellow black white orange purple",
    "cat dog bird fish horse cow sheep goat",
    "red blue green cat dog bird",
    "white black orange horse cow sheep",
]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default=None, help="Hub URL; default: start the loopback fake Hub.")
    parser.add_argument("--repo", default="user/softprompt-plus-demo", help="Repo id to push to (namespace/name).")
    parser.add_argument("--model", default=None, help="Base causal LM (folder or Hub id); default: the tiny GPT-2.")
    parser.add_argument("--num-virtual-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="Prompt-tuning steps before pushing (default 30).")
    parser.add_argument("--private", action="store_true", help="Create the repo as private.")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@contextlib.contextmanager
def hub_endpoint(endpoint: Optional[str]):
    """Point huggingface_hub at `endpoint`, or at a fake Hub started here; must run before it is imported."""
    if endpoint is not None:
        os.environ["HF_ENDPOINT"] = endpoint.rstrip("/")
        os.environ["HF_HUB_OFFLINE"] = "0"  # an explicit endpoint means: use the network
        yield endpoint
        return
    tests = Path(__file__).resolve().parents[1] / "tests"
    if not (tests / "_hub_server.py").is_file():
        sys.exit("No --endpoint given and tests/_hub_server.py is not here to start a fake Hub: pass --endpoint URL.")
    sys.path.insert(0, str(tests))
    from _hub_server import FakeHub

    with FakeHub() as hub, tempfile.TemporaryDirectory(prefix="fake-hub-cache-") as cache:
        # A fake token and a throwaway cache: neither a real token nor the user's HF cache meets the fake Hub.
        os.environ.update(HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_TOKEN="hf_loopback_fake", HF_HOME=cache)
        yield hub.url


def load_base(name: Optional[str], seed: int, workdir: str) -> str:
    """A local folder or Hub id holding the base model and tokenizer; the tiny default is written to `workdir`."""
    if name is not None:
        return name
    from peft_softprompt_plus.apps.tiny import save_tiny

    return save_tiny(os.path.join(workdir, "tiny-gpt2"), seed=seed)


def train_prompt(model, tokenizer, steps: int) -> float:
    import torch

    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    model.train()
    loss = float("nan")
    for _ in range(steps):
        out = model(**batch, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = out.loss.item()
    return loss


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    with hub_endpoint(args.endpoint) as endpoint, tempfile.TemporaryDirectory() as workdir:
        import torch
        from peft import PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import peft_softprompt_plus  # noqa: F401  (registers SOFTPROMPT_PLUS with PEFT before any PEFT call)
        from peft_softprompt_plus import SoftPromptPlusConfig
        from peft_softprompt_plus.files.hub import push_to_hub

        torch.manual_seed(args.seed)
        base_path = load_base(args.model, args.seed, workdir)
        tokenizer = AutoTokenizer.from_pretrained(base_path)
        if tokenizer.pad_token is None:  # GPT-2 ships without one
            tokenizer.pad_token = tokenizer.eos_token
        config = SoftPromptPlusConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=args.num_virtual_tokens, prompt_init="vocab", init_seed=args.seed
        )
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path), config)
        loss = train_prompt(model, tokenizer, args.steps)
        model.eval()
        # Recorded in the model card's "training metrics".
        model.softprompt_plus_metrics = {"train_loss": round(loss, 4), "train_steps": args.steps}

        commit = push_to_hub(model, args.repo, private=args.private or None)
        print(f"pushed to {endpoint}: {commit.commit_url}")

        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), args.repo).eval()
        ids = tokenizer(TEXTS[:2], return_tensors="pt", padding=True)
        with torch.no_grad():
            same = torch.equal(model(**ids).logits, reloaded(**ids).logits)
        print(f"reloaded from the Hub: logits {'identical' if same else 'DIFFERENT'}")
        prompt = tokenizer("red green", return_tensors="pt")
        out = reloaded.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        print(f"generate('red green') -> {tokenizer.decode(out[0, prompt['input_ids'].shape[1] :])!r}")
        return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
