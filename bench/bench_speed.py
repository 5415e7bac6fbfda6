"""Train-step speed and memory against PEFT PROMPT_TUNING and the frozen-model floor, with gradient checkpointing off
and on, and `generate` against the base model. Method, targets and commands: bench/README.md.

    python bench/bench_speed.py            # tiny and GPT-2-small shapes, B=16 (about 40 minutes on 2 cores)
    python bench/bench_speed.py --quick    # tiny shape, 2 rounds (about 2 minutes)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Optional

import _common as c
import _memory as mem
import torch
from _stats import Row, print_table

NEW_TOKENS = 32
GEN_PROMPTS = 8
# Targets: train PEFT/ours and ours/floor per (checkpointing, N); step peak memory ours/PEFT at N=100;
# generate ours/base at N=100.
SPEEDUP = {(False, 20): ">= 1.15", (True, 100): ">= 1.8"}
OVER_FLOOR = {(False, 100): "<= 1.12", (True, 100): "<= 1.15"}
MEMORY = "<= 0.6"
GENERATE = "<= 1.10"
EXACT = "<= 1e-05"


@dataclass(frozen=True)
class Targets:
    """Per (checkpointing, N): PEFT/ours and ours/floor; step memory ours/PEFT at N=100; generate ours/base, N=100."""

    speedup: dict = field(default_factory=lambda: SPEEDUP)
    over_floor: dict = field(default_factory=lambda: OVER_FLOOR)
    memory: Optional[str] = MEMORY
    generate: Optional[str] = GENERATE
    exact: str = EXACT  # |loss ours - PEFT|
    exact_grad: str = EXACT  # prompt-gradient relative difference


def bench_train(
    shape: c.Shape, n: int, checkpointing: bool, reps: int, warmup: int, rows: list[Row], targets=Targets()
) -> None:
    tag = f"{shape.name} N={n} ckpt={'on' if checkpointing else 'off'}"
    ids = shape.ids()
    model = c.ours(shape.base(checkpointing), n).train()
    prompt = model.base_model.prompt("default")
    ref = c.peft_prompt_tuning(shape.base(checkpointing), prompt.detach()).train()
    floor = shape.base(checkpointing).train()

    loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    grad_rel = ((prompt.grad - c.peft_prompt(ref).grad).norm() / c.peft_prompt(ref).grad.norm()).item()
    loss_diff = abs(loss.item() - ref_loss.item())
    print(f"  [{tag}] ours vs PEFT: |loss diff| {loss_diff:.1e}, prompt-grad rel diff {grad_rel:.1e}", flush=True)
    rows.append(Row(f"{tag}: |loss ours - PEFT|", loss_diff, target=targets.exact, fmt="{:.1e}"))
    rows.append(Row(f"{tag}: prompt grad rel diff ours vs PEFT", grad_rel, target=targets.exact_grad, fmt="{:.1e}"))

    steps = {
        "ours": c.train_step(model, ids, [prompt]),
        "peft": c.train_step(ref, ids, [c.peft_prompt(ref)]),
        "floor": c.floor_step(floor, ids),
    }
    times = c.interleaved(steps, reps, warmup)
    for name, t in times.items():
        print(f"  [{tag}] {name:<6} {t.line()}", flush=True)
    rows.append(
        Row(f"{tag}: train step PEFT / ours", *c.ratio(times, "peft", "ours"), targets.speedup.get((checkpointing, n)))
    )
    rows.append(
        Row(
            f"{tag}: train step ours / floor",
            *c.ratio(times, "ours", "floor"),
            targets.over_floor.get((checkpointing, n)),
        )
    )
    rows.append(Row(f"{tag}: train step ours, ms (context)", 1e3 * times["ours"].med(), fmt="{:.0f}"))
    if n == 100:
        peaks = {
            name: mem.step_peak(step, m) for (name, step), m in zip(steps.items(), (model, ref, floor), strict=True)
        }
        print("  [" + tag + "] step peak MB: " + ", ".join(f"{k} {v / c.MB:.1f}" for k, v in peaks.items()))
        rows.append(Row(f"{tag}: step peak memory ours / PEFT", peaks["ours"] / peaks["peft"], target=targets.memory))
        rows.append(Row(f"{tag}: step peak memory floor / PEFT (context)", peaks["floor"] / peaks["peft"]))


# KV prompts (N=100, the tiny shape's targets): ours KV / floor; PEFT CARTRIDGE / ours KV; step peak memory ours KV
# against ours input and against CARTRIDGE; generate ours KV / base.
KV_OVER_FLOOR = "<= 1.10"
KV_AGAINST_CARTRIDGE = ">= 0.95"
KV_MEMORY = "< 1"


def bench_kv_train(shape: c.Shape, n: int, checkpointing: bool, reps: int, warmup: int, rows: list[Row]) -> None:
    """A KV prompt's step in one run with ours input, PEFT CARTRIDGE and PREFIX_TUNING (checkpointing off: PEFT
    refuses it for both) and the floor; exactness against CARTRIDGE holding the same keys/values."""
    tag = f"{shape.name} N={n} ckpt={'on' if checkpointing else 'off'} KV"
    ids = shape.ids()
    # The first position frozen, as CARTRIDGE's `num_frozen_tokens=1`: both train the same positions, so their
    # gradients compare (the default since 7261830 trains every position).
    kv = c.ours(shape.base(checkpointing), n, prompt_level="kv", kv_frozen_positions=1).train()
    leaf = kv.base_model.prompt("default")
    models = {"kv": kv, "input": c.ours(shape.base(checkpointing), n).train()}
    params = {"kv": [leaf], "input": [models["input"].base_model.prompt("default")]}
    if not checkpointing:
        models["cartridge"] = c.peft_cartridge(shape.base(), kv.base_model.prompt_bank.values("default")).train()
        models["prefix"] = c.peft_prefix_tuning(shape.base(), n).train()
        params["cartridge"] = [models["cartridge"].prompt_encoder["default"].trainable_embedding]
        params["prefix"] = [p for p in models["prefix"].parameters() if p.requires_grad]
        loss, ref_loss = kv(input_ids=ids, labels=ids).loss, models["cartridge"](input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss.backward()
        want = params["cartridge"][0].grad
        grad_rel = ((leaf.grad.permute(3, 0, 1, 2, 4).reshape(want.shape) - want).norm() / want.norm()).item()
        rows.append(
            Row(f"{tag}: |loss ours - CARTRIDGE|", abs(loss.item() - ref_loss.item()), target=EXACT, fmt="{:.1e}")
        )
        rows.append(Row(f"{tag}: grad rel diff ours vs CARTRIDGE", grad_rel, target=EXACT, fmt="{:.1e}"))
    floor = shape.base(checkpointing).train()
    steps = {name: c.train_step(model, ids, params[name]) for name, model in models.items()}
    steps["floor"] = c.floor_step(floor, ids)
    times = c.interleaved(steps, reps, warmup)
    for name, t in times.items():
        print(f"  [{tag}] {name:<9} {t.line()}", flush=True)
    at_target = n == 100 and shape.name == "tiny"
    rows.append(
        Row(f"{tag}: train step ours KV / floor", *c.ratio(times, "kv", "floor"), KV_OVER_FLOOR if at_target else None)
    )
    rows.append(Row(f"{tag}: train step ours input / ours KV (context)", *c.ratio(times, "input", "kv")))
    for peft_arm in ("cartridge", "prefix"):
        if peft_arm in times:
            target = KV_AGAINST_CARTRIDGE if peft_arm == "cartridge" else None
            rows.append(Row(f"{tag}: train step PEFT {peft_arm} / ours KV", *c.ratio(times, peft_arm, "kv"), target))
    models["floor"] = floor
    peaks = {name: mem.step_peak(steps[name], models[name]) for name in steps}
    print("  [" + tag + "] step peak MB: " + ", ".join(f"{k} {v / c.MB:.1f}" for k, v in peaks.items()))
    for other in ("input", "cartridge", "prefix"):
        if other in peaks:
            target = KV_MEMORY if other != "prefix" else None
            ratio = peaks["kv"] / peaks[other]
            rows.append(Row(f"{tag}: step peak memory ours KV / {other}", ratio, target=target, fmt="{:.4f}"))


def bench_kv_generate(shape: c.Shape, reps: int, warmup: int, rows: list[Row], target: Optional[str] = GENERATE):
    """`generate` with a KV prompt (N=100) against the base model, and against its lifted input prompt's tokens."""
    ids, mask = _gen_inputs(shape)
    base = shape.base().eval()
    tag = f"{shape.name} N=100 KV generate {GEN_PROMPTS}x{NEW_TOKENS}"
    model = c.ours(shape.base(), 100, prompt_level="kv").eval()
    with torch.no_grad():
        times = c.interleaved(
            {"base": lambda: _greedy(base, ids, mask), "kv": lambda: _greedy(model, ids, mask)}, reps, warmup
        )
    for name, t in times.items():
        print(f"  [{tag}] {name:<6} {t.line()}", flush=True)
    rows.append(Row(f"{tag}: ours KV / base model", *c.ratio(times, "kv", "base"), target))


def _gen_inputs(shape: c.Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """8 prompts of 8-32 tokens, left-padded: `[8, T]` ids and mask."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(8, 33, (GEN_PROMPTS,), generator=gen).tolist()
    ids = torch.full((GEN_PROMPTS, max(lengths)), shape.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        ids[i, -length:] = torch.randint(shape.first_id, shape.vocab, (length,), generator=gen)
        mask[i, -length:] = 1
    return ids, mask


def _greedy(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def _cache_bytes_per_row(model, ids, mask) -> float:
    out = _greedy(model, ids, mask, return_dict_in_generate=True)
    layers = out.cache.layers
    return sum(x.keys.nbytes + x.values.nbytes for x in layers) / ids.shape[0]


def bench_generate(shape: c.Shape, reps: int, warmup: int, rows: list[Row], targets=Targets()) -> None:
    ids, mask = _gen_inputs(shape)
    base = shape.base().eval()
    cache_bytes = {}
    for n in (20, 100):
        tag = f"{shape.name} N={n} generate {GEN_PROMPTS}x{NEW_TOKENS}"
        model = c.ours(shape.base(), n).eval()
        # The slow, plainly right way: the base model fed `[prompt; wte(text)]` as embeddings.
        ref = c.ours(shape.base(), n, forward_path="concat").eval()
        with torch.no_grad():
            same = torch.equal(_greedy(model, ids, mask), _greedy(ref, ids, mask))
            cache_bytes[n] = _cache_bytes_per_row(model, ids, mask)
            times = c.interleaved(
                {"base": lambda: _greedy(base, ids, mask), "ours": lambda m=model: _greedy(m, ids, mask)}, reps, warmup
            )
        for name, t in times.items():
            print(f"  [{tag}] {name:<6} {t.line()}", flush=True)
        rows.append(Row(f"{tag}: tokens equal the concatenation path", float(same), target=">= 1", fmt="{:.0f}"))
        rows.append(
            Row(f"{tag}: ours / base model", *c.ratio(times, "ours", "base"), targets.generate if n == 100 else None)
        )
    with torch.no_grad():
        base_bytes = _cache_bytes_per_row(base, ids, mask)
    print(
        f"  cache KB per row: base {base_bytes / 1024:.0f}, "
        + ", ".join(f"N={n} {b / 1024:.0f}" for n, b in cache_bytes.items())
    )
    rows.append(
        Row(
            f"{shape.name} generate: cache bytes per row, N=100 / N=20",
            cache_bytes[100] / cache_bytes[20],
            target="<= 1.0",
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.timing_flags(parser, quick="tiny shape only, 2 rounds after 1 warm-up", reps=7)
    parser.add_argument("--small-reps", type=int, default=3, help="timed rounds, GPT-2-small shape")
    parser.add_argument("--only", choices=["tiny", "small"], default=None, help="one shape only")
    parser.add_argument("--kv-only", action="store_true", help="the KV arms only (KV, input, CARTRIDGE, prefix)")
    args = parser.parse_args()
    malloc = {k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ}
    with c.timed_run(args, f"allocator: {malloc or 'glibc defaults'}"):
        run(args)


def run(args) -> None:
    rows: list[Row] = []
    reps, warmup = (2, 1) if args.quick else (args.reps, 2)
    shapes = [(c.TINY, reps, warmup)] + ([] if args.quick else [(c.SMALL, args.small_reps, 1)])
    for shape, shape_reps, shape_warmup in shapes:
        if args.only not in (None, shape.name):
            continue
        print(f"\n{shape.describe()}; B={shape.batch}, L={shape.length}; median of {shape_reps} rounds", flush=True)
        for checkpointing in (False, True):
            for n in (20, 100):
                if not args.kv_only:
                    bench_train(shape, n, checkpointing, shape_reps, shape_warmup, rows)
                bench_kv_train(shape, n, checkpointing, shape_reps, shape_warmup, rows)
    if args.only in (None, "tiny"):
        print(f"\n{c.TINY.name}: generate, {GEN_PROMPTS} left-padded prompts x {NEW_TOKENS} new tokens, greedy")
        gen_reps = (3, 1) if args.quick else (15, 2)
        if not args.kv_only:
            bench_generate(c.TINY, *gen_reps, rows)
        bench_kv_generate(c.TINY, *gen_reps, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
