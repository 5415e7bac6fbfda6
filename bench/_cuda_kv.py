"""The KV part of bench/cuda_check.py (`--part kv`, at most 4 minutes): a KV prompt's train step on a GPU against the
floor, our input prompt and PEFT CARTRIDGE (checkpointing off: PEFT refuses it), bf16, SmolLM2-135M's shape, at
L = 512, 2048, 8192, N = 20 and 100, activation checkpointing off and on; which kernels ran, and the bf16 loss against
CARTRIDGE holding the same keys/values. Targets: KV / floor <= 1.05 at every row, KV below the input form's."""

from __future__ import annotations

import time

import _cuda_attention as att
import torch
from _stats import markdown_header, markdown_row
from peft import CartridgeConfig, get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig

SHAPE = "smollm2-135m"
OVER_FLOOR = 1.05


def _kv(state, n: int, ckpt: bool, shape: str):
    config = SoftPromptPlusConfig(num_virtual_tokens=n, prompt_level="kv", kv_frozen_positions=1)  # as CARTRIDGE's
    model = get_peft_model(att._base(shape, state), config)
    att._checkpointing(model.get_base_model(), ckpt)
    return model


def _cartridge(state, values: torch.Tensor, shape: str):
    n = values.shape[3]
    model = get_peft_model(
        att._base(shape, state), CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, num_frozen_tokens=1)
    )
    model.prompt_encoder["default"].load_prompt_embeddings(values.detach().permute(3, 0, 1, 2, 4).reshape(n, -1))
    return model


def exactness(state, shape: str) -> str:
    """bf16: ours and CARTRIDGE on the same keys/values, one batch."""
    ids = torch.randint(2, att.VOCAB_DRAW, (2, att.LENGTHS[0]), device=att.DEV)
    ours = _kv(state, 20, False, shape)
    with torch.no_grad():
        mine = ours(input_ids=ids, labels=ids).loss.float()
        theirs = _cartridge(state, ours.base_model.prompt_bank.values("default"), shape)(input_ids=ids, labels=ids)
    diff = abs(mine - theirs.loss.float()).item()
    return (
        f"{'PASS' if diff <= 2e-2 else 'MISS'} bf16 loss ours KV {mine.item():.5f}, CARTRIDGE {theirs.loss.item():.5f}"
    )


def speed(state, deadline: float, reps: int, shape: str) -> list[dict]:
    rows = []
    for n in att.NS:
        for length in att.LENGTHS:
            for ckpt in (False, True):
                if time.time() > deadline:
                    return rows
                ids = torch.randint(
                    2, att.VOCAB_DRAW, (max(1, att.SHAPES[shape][1] // length), length), device=att.DEV
                )
                row = {"N": n, "L": length, "B": ids.shape[0], "ckpt": ckpt}
                kv = _kv(state, n, ckpt, shape)
                row["kv"] = att._time(att._step(kv, ids, [kv.base_model.prompt("default")]), reps)
                row["kernels"] = "+".join(sorted(kv.base_model.forward_state.last_kernels))
                values = kv.base_model.prompt_bank.values("default").detach()
                del kv
                inp = get_peft_model(att._base(shape, state), SoftPromptPlusConfig(num_virtual_tokens=n, init_seed=0))
                att._checkpointing(inp.get_base_model(), ckpt)
                row["input"] = att._time(att._step(inp, ids, [inp.base_model.prompt("default")]), reps)
                del inp
                if not ckpt:
                    cart = _cartridge(state, values, shape)
                    row["cartridge"] = att._time(
                        att._step(cart, ids, [cart.prompt_encoder["default"].trainable_embedding]), reps
                    )
                    del cart
                floor = att._base(shape, state)
                att._checkpointing(floor, ckpt)
                row["floor"] = att._time(att._floor(floor, ids), reps)
                del floor
                if att.DEV == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                print(_line(row), flush=True)
    return rows


HEADER = markdown_header([
    "N", "L", "B", "ckpt", "KV ms", "input ms", "CARTRIDGE ms", "floor ms", "KV / floor", "input / KV",
    "CARTRIDGE / KV", "peak MB KV / input / floor", "KV kernels",
])  # fmt: skip


def _line(r: dict) -> str:
    kv, inp, floor, cart = r["kv"], r["input"], r["floor"], r.get("cartridge")
    cart_ms = cart.ms if cart else float("nan")
    return markdown_row([
        r["N"], r["L"], r["B"], "on" if r["ckpt"] else "off", f"{kv.ms:.1f}", f"{inp.ms:.1f}", f"{cart_ms:.1f}",
        f"{floor.ms:.1f}", f"{kv.ms / floor.ms:.3f}", f"{inp.ms / kv.ms:.3f}", f"{cart_ms / kv.ms:.3f}",
        f"{kv.peak_mb:.0f} / {inp.peak_mb:.0f} / {floor.peak_mb:.0f}", r["kernels"],
    ])  # fmt: skip


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        kv, inp, floor = r["kv"].ms, r["input"].ms, r["floor"].ms
        tag = f"N={r['N']} L={r['L']} ckpt={'on' if r['ckpt'] else 'off'}"
        out.append(
            f"{'PASS' if kv / floor <= OVER_FLOOR else 'MISS'} KV/floor {kv / floor:.3f} <= {OVER_FLOOR} ({tag})"
        )
        out.append(f"{'PASS' if kv < inp else 'MISS'} KV {kv:.1f} ms below input {inp:.1f} ms ({tag})")
    return out


def run(seconds: float, reps: int) -> int:
    deadline = time.time() + seconds
    shape = SHAPE if SHAPE in att.SHAPES else next(iter(att.SHAPES))  # the CPU smoke run's tiny shape
    state = {k: v.clone() for k, v in att._base(shape).state_dict().items()}
    checks = [exactness(state, shape)]
    print(checks[0], flush=True)
    print(HEADER, flush=True)
    rows = speed(state, deadline, reps, shape)
    print("\n" + HEADER + "\n" + "\n".join(_line(r) for r in rows))
    results = checks + verdicts(rows)
    print("\n" + "\n".join(results))
    return 0 if all(not line.startswith("MISS") for line in results) else 1
