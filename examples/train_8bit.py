"""Train a soft prompt on an 8-bit (bitsandbytes LLM.int8) base, save the float32 adapter, use it on an fp32 base.

Runs offline on the embedded tiny GPT-2 by default, on a GPU or on the CPU (recent bitsandbytes runs LLM.int8 there):

    python examples/train_8bit.py

On a real checkpoint (a local folder or a Hub id):

    python examples/train_8bit.py --model gpt2 --steps 200 --num-virtual-tokens 20

No `prepare_model_for_kbit_training` is needed: only the prompt trains, and it is float32 by construction (see
docs/precision.md).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from typing import Optional

import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

import peft_softprompt_plus  # noqa: F401  (registers SOFTPROMPT_PLUS with PEFT; import it before any PEFT call)
from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import SAMPLE_TEXTS, save_tiny

TEXTS = SAMPLE_TEXTS[:4]  # replace with your own texts


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Causal LM folder or Hub id; default: the tiny GPT-2.")
    parser.add_argument("--output-dir", default=None, help="Where to save the adapter; default: a temp folder.")
    parser.add_argument("--num-virtual-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=5e-2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_8bit(path: str, device: str):
    # `device_map` is required: bitsandbytes quantizes while the checkpoint streams onto the device.
    quant = BitsAndBytesConfig(load_in_8bit=True)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map={"": device})


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its "inputs will be cast to float16" note, per call
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    workdir = tempfile.mkdtemp(prefix="softprompt-8bit-")
    path = args.model or save_tiny(f"{workdir}/tiny-gpt2", seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=args.num_virtual_tokens, init_seed=args.seed
    )
    model = get_peft_model(load_8bit(path, device), config)
    prompt = model.base_model.prompt("default")  # [N, D], float32 on an int8 base
    print(f"base: {sorted({str(p.dtype) for p in model.base_model.model.parameters()})}; prompt: {prompt.dtype}")

    batch = tokenizer(TEXTS, return_tensors="pt", padding=True).to(device)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # [B, L]: no loss on padding
    optimizer = torch.optim.AdamW([prompt], lr=args.learning_rate)
    model.train()
    losses = []
    for step in range(args.steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:>4}  loss {loss.item():.4f}")

    out_dir = args.output_dir or f"{workdir}/adapter"
    model.save_pretrained(out_dir)  # only the float32 prompt: a few KB

    # The same adapter on a full-precision base: the prompt is precision-independent.
    fp32 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path).to(device), out_dir).eval()
    model.eval()
    with torch.no_grad():
        diff = (fp32(**batch).logits.float() - model(**batch).logits.float()).abs().max().item()
        generated = fp32.generate(**tokenizer(["red green"], return_tensors="pt").to(device), max_new_tokens=6)
    print(f"saved to {out_dir}; max |logit diff| int8 vs fp32 base: {diff:.2e}")
    print("fp32 generate:", tokenizer.decode(generated[0], skip_special_tokens=True))
    return {"losses": losses, "adapter_dir": out_dir, "logit_diff": diff}


if __name__ == "__main__":
    main()
