"""The train step, step memory and `generate` on a real pretrained checkpoint (SmolLM2-135M-Instruct from the package
index, `peft_softprompt_plus.apps.fetch`), against PEFT PROMPT_TUNING and the frozen-model floor in the same run, with
gradient checkpointing off and on. Method and targets: bench/README.md.

    python bench/bench_real.py            # B=8, L=64, N=20 and 100, 5 rounds (about 25 minutes on 2 cores)
    python bench/bench_real.py --quick    # 2 rounds, N=100 only, no generate (about 6 minutes)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import _common as c
import bench_speed as speed
import torch
from _stats import Row, print_table
from transformers import AutoModelForCausalLM

from peft_softprompt_plus.apps.fetch import CHECKPOINTS, fetch_checkpoint

TARGETS = speed.Targets(
    speedup={(False, 100): ">= 2.0", (True, 100): ">= 2.0", (False, 20): ">= 1.15", (True, 20): ">= 1.15"},
    over_floor={(False, 100): "<= 1.25", (True, 100): "<= 1.25"},
    memory=None,
    generate=None,
    exact="<= 1e-05",
    # 30 float32 layers: the two orders of summation differ by ~2e-4 relative (with a float64 base they agree within
    # 6.3e-7, the float32 loss's own rounding: tests/test_real_checkpoint.py)
    exact_grad="<= 5e-04",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RealShape(c.Shape):
    """A real checkpoint in place of a random GPT-2: `base()` loads it from its converted folder."""

    path: str = ""
    dtype: str = "fp32"

    def base(self, checkpointing: bool = False):
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=DTYPES[self.dtype])
        if checkpointing:
            c.checkpointing_on(model)
        return model

    def describe(self) -> str:
        return f"{self.name}: {CHECKPOINTS[self.name].about}; {self.dtype} weights"


def real_shape(name: str, dtype: str, batch: int, length: int) -> RealShape:
    path = fetch_checkpoint(name)
    config = AutoModelForCausalLM.from_pretrained(path).config
    special = max(i for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id) if i is not None)
    return RealShape(
        name,
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.vocab_size,
        batch=batch,
        length=length,
        pad_id=config.pad_token_id,
        first_id=max(special + 1, 17),  # SmolLM2's ids 0..16 are its special tokens
        path=path,
        dtype=dtype,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.timing_flags(parser, quick="N=100 only, 2 rounds after 1 warm-up, no generate", threads=2, reps=5)
    parser.add_argument("--model", choices=sorted(CHECKPOINTS), default="smollm2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the base's weights")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--kv-only", action="store_true", help="the KV arms only (KV, input, CARTRIDGE, prefix)")
    args = parser.parse_args()
    with c.timed_run(args):
        run(args)


def run(args) -> None:
    shape = real_shape(args.model, args.dtype, args.batch, args.length)
    print(f"\n{shape.describe()}; B={shape.batch}, L={shape.length}", flush=True)
    reps, warmup = (2, 1) if args.quick else (args.reps, 1)
    rows: list[Row] = []
    for checkpointing in (False, True):
        for n in (100,) if args.quick else (20, 100):
            if not args.kv_only:
                speed.bench_train(shape, n, checkpointing, reps, warmup, rows, TARGETS)
            speed.bench_kv_train(shape, n, checkpointing, reps, warmup, rows)
    if not args.quick:
        print(f"\n{shape.name}: generate, {speed.GEN_PROMPTS} left-padded prompts x {speed.NEW_TOKENS} new tokens")
        if not args.kv_only:
            speed.bench_generate(shape, reps, warmup, rows, TARGETS)
        speed.bench_kv_generate(shape, reps, warmup, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
