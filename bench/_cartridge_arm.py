"""bench_distill_content.py's PEFT CARTRIDGE arm: PEFT 0.21's CARTRIDGE (first position frozen) started from the
very keys/values of our KV text start, trained by distill_prompt's loop (the same samples, batches, weighted KL,
AdamW and learning rate) through PEFT's own forward, then copied into this library's KV adapter to be scored by the
bench's held-out KL and user probes (PEFT's prefix `generate` is not trusted here). The copy is checked against
PEFT's forward on one unpadded row before it is scored.

PEFT's forward gives a left-padded row positions shifted by its padding (it reads `cache_position`, not the mask);
that is part of what this arm measures."""

from __future__ import annotations

import random
import time

import torch
from _common import peft_cartridge
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from peft_softprompt_plus.distill import data as distill_data
from peft_softprompt_plus.distill import kv_start
from peft_softprompt_plus.distill import score as distill_score
from peft_softprompt_plus.distill.prepare import STUDENT
from peft_softprompt_plus.distill.refusals import LEVEL_DEFAULTS
from peft_softprompt_plus.distill.teacher import TEACHER, attach_teacher
from peft_softprompt_plus.distill.train import _batches


def _values(cartridge, like: torch.Tensor) -> torch.Tensor:
    """CARTRIDGE's `[N, layers*2*Hkv*hd]` table (frozen row included) as `[layers, 2, Hkv, N, hd]`."""
    layers, _, heads, n, hd = like.shape
    table = cartridge.get_prompt_embedding_to_save("default")
    return table.view(n, layers, 2, heads, hd).permute(1, 2, 3, 0, 4).float()


def train(path: str, tokenizer, system_prompt: str, samples, n: int, steps: int, lr: float, seed: int, weight: float):
    """(our model holding the trained CARTRIDGE's values as its student, figures): figures has `train_cpu`,
    `train_seconds` and `copy_gap` (max |logit| difference, copy against PEFT's forward, on one unpadded row)."""
    prepared = distill_data.prepare(tokenizer, system_prompt, True, n)
    config = distill_data.init_config(tokenizer, prepared, n, seed, "text", prompt_level="kv", kv_frozen_positions=1)
    config.chat_format = "student"
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(path), config).eval()
    attach_teacher(ours, prepared.prefix_ids)
    start = ours.base_model.prompt_bank.values(STUDENT).detach()  # [layers, 2, Hkv, N, hd]
    cartridge = peft_cartridge(AutoModelForCausalLM.from_pretrained(path), start).eval()  # no dropout, as ours
    params = [p for p in cartridge.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    pad = distill_data.pad_id(tokenizer)
    picks, wall, cpu = _batches(len(samples.train), 8, random.Random(seed)), 0.0, 0.0
    for step in range(1, steps + 1):
        began, began_cpu = time.perf_counter(), time.process_time()
        batch = distill_score.scored_batch([samples.train[i] for i in next(picks)], pad, "cpu")
        student = cartridge(**batch.kwargs).logits  # [B, K, V], PEFT's forward
        kl = distill_score.weighted_kl(ours, batch, STUDENT, weight, student=student)
        kl.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        wall, cpu = wall + time.perf_counter() - began, cpu + time.process_time() - began_cpu
        if step % max(1, steps // 10) == 0:
            print(f"  CARTRIDGE step {step}/{steps}: training KL {kl.item():.4f} ({wall:.0f} s)", flush=True)
    with torch.no_grad():
        kv_start.install(ours, STUDENT, _values(cartridge, start))
        row = torch.tensor([samples.held_out[0].ids])  # [1, L], unpadded: both read positions N.. exactly
        theirs, mine = cartridge(input_ids=row).logits, ours(input_ids=row, adapter_names=[STUDENT]).logits
        copy_gap = ((theirs - mine).abs().max() / theirs.abs().max()).item()
    ours.delete_adapter(TEACHER)
    return ours, {"train_cpu": cpu, "train_seconds": wall, "copy_gap": copy_gap}


def arm(args, path, tokenizer, data, system_prompt, samples, n: int, weight: float, scorers) -> dict:
    """The arm's record for bench_distill_content.py; `scorers`: its (held-out gaps, user probes, saved folder, recipe
    flags)."""
    held_out_gaps, user_probes, folder, knobs = scorers
    if samples is None:
        raise SystemExit("the PEFT CARTRIDGE arm trains on a seed's kept samples: run a KV arm of this seed first")
    lr = LEVEL_DEFAULTS["kv"]["lr"] if args.lr is None else args.lr  # the KV student's default
    began = time.perf_counter()
    model, figures = train(path, tokenizer, system_prompt, samples, n, args.steps, lr, args.seed, weight)
    model.save_pretrained(folder)
    gap = held_out_gaps(model, tokenizer, system_prompt, samples, None)["student"]
    u, _ = user_probes(model, tokenizer, data, system_prompt)
    nan = float("nan")
    return dict(
        prompt=data.name, gap_closed=gap, probes=0, teacher=nan, student=nan, none=nan, kept=nan,
        seconds=time.perf_counter() - began, seed=args.seed, steps=args.steps, lr=lr, samples_reused=True,
        max_new_tokens=args.max_new_tokens, self_study=args.self_study, kl_top_k=0, kv_frozen_positions=1,
        user_probes=dict(probes=u.probes, teacher=u.teacher, student=u.student, none=u.none, kept=u.kept),
        user_replies=u.replies, kept_text_only=None, curve={}, knobs=knobs, **figures,
    )  # fmt: skip
