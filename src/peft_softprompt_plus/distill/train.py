"""The start and train stages of `distill_prompt`: where the student's prompt begins (a `selected` KV start replaces
the noise it was attached with), and the loop: AdamW on the student's prompt alone, KL(teacher || student) on shuffled
epochs of the teacher's samples, the held-out curve at the steps asked for."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..method import kv_select
from . import kv_start
from . import score as distill_score
from .options import DistillOptions
from .prepare import STUDENT, Preparation
from .score import CurvePoint, Figures

SELECTION_ROWS = 96  # training rows whose attention chooses a `selected` start


@dataclass
class Start:
    """The start stage's record."""

    init: str  # the start, in words
    # A kept passage's entries in the trained prompt leaf, `[layers, 1, Hkv, N - frozen, 1]` bool: their gradient is
    # zeroed, so they stay the teacher's own keys/values (None: nothing kept).
    kept: Optional[torch.Tensor] = None
    kept_positions: int = 0  # how many of the N positions are kept (the passage's and the template's own)
    facts: int = 0  # how many of those are the passage's


def start(prep: Preparation, o: DistillOptions) -> Start:
    """The student's start: the `selected` KV start is installed here; the others were set when it attached."""
    if o.prompt_init == "selected":
        kept = _select(prep, o)
        words = "selected (the system turn's most attended positions)"
        if prep.kept_positions:
            words += f" and {len(prep.kept_positions)} kept (the teacher's own, never trained)"
        return Start(words + ", KV", kept, len(prep.kept_positions), prep.facts)
    init = prep.model.peft_config[STUDENT].prompt_init  # "text" becomes "vocab" where the tokenizer can't reload
    init += " (the system prompt's first tokens)" if init == "text" else ""
    return Start(init + (", KV" if o.prompt_level == "kv" else ""))


def _select(prep: Preparation, o: DistillOptions) -> Optional[torch.Tensor]:
    """The student's N positions: a kept passage's, and the system turn's most attended by the training texts; the
    kept ones' mask over the trained leaf (None: nothing kept)."""
    model, prefix_ids = prep.model, prep.prompt.prefix_ids
    heads = model.base_model.forward_state.kv_layout.heads
    # Rows spread over every kind of training turn (the teacher's own, the questions about each part), scored by the
    # attention their replies pay: the positions a reply reads its facts from.
    train = prep.samples.train
    rows = train[:: max(1, len(train) // SELECTION_ROWS)][:SELECTION_ROWS]
    scores = kv_start.attention_scores(model, prefix_ids, [(s.ids, s.first) for s in rows], heads)
    frozen = model.peft_config[STUDENT].kv_frozen_positions
    forced = sorted(set(range(frozen)) | set(prep.kept_positions))
    positions = kv_select.per_head_positions(scores, o.num_virtual_tokens, forced)  # [layers, Hkv, N]
    kv_start.install(model, STUDENT, kv_select.gathered(kv_start.prompt_cache(model, prefix_ids), positions))
    return kv_select.kept_mask(positions, frozen, prep.kept_positions) if prep.kept_positions else None


@dataclass
class Training:
    """The train stage's record."""

    seconds: float  # wall time of the steps alone (no evaluation)
    cpu_seconds: float
    curve: list[CurvePoint] = field(default_factory=list)  # the held-out figures at `evaluate_at`


def _batches(count: int, batch_size: int, rng: random.Random):
    """Indices of shuffled epochs, `batch_size` at a time, for ever: every row weighs the same."""
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            epoch = list(range(count))
            rng.shuffle(epoch)
            order += epoch
        yield order[:batch_size]
        order = order[batch_size:]


def train(prep: Preparation, o: DistillOptions, began: Start, evaluate: Callable[[], Figures], log) -> Training:
    prompt = prep.model.base_model.prompt(STUDENT)
    # A kept entry's gradient is zero at every step, so AdamW (no decay) never moves it: its moments stay zero.
    hook = None if began.kept is None else prompt.register_hook(lambda grad: grad.masked_fill(began.kept, 0.0))
    try:
        return _loop(prep, o, prompt, evaluate, log)
    finally:
        if hook is not None:
            hook.remove()


def _loop(prep: Preparation, o: DistillOptions, prompt, evaluate: Callable[[], Figures], log) -> Training:
    model, samples = prep.model, prep.samples
    # Decay would pull the prompt off the embedding manifold; the optimizer holds the student's prompt alone.
    opt = torch.optim.AdamW([prompt], lr=o.lr, weight_decay=0.0)
    picks, losses = _batches(len(samples.train), o.batch_size, random.Random(o.seed)), []
    out, evaluate_at = Training(0.0, 0.0), set(o.evaluate_at)
    if 0 in evaluate_at:
        out.curve.append(CurvePoint(0, 0.0, None, evaluate()))
    for step in range(1, o.steps + 1):
        started, started_cpu = time.perf_counter(), time.process_time()
        batch = distill_score.scored_batch([samples.train[i] for i in next(picks)], prep.pad_id, prompt.device)
        kl = distill_score.weighted_kl(model, batch, STUDENT, o.answer_weight, o.kl_top_k)
        loss = kl
        if o.prompt_text_weight:  # the system turn's own text, memorised beside the teacher's turns
            loss = kl + o.prompt_text_weight * distill_score.text_nll(model, prep.prompt.prefix_ids, STUDENT)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.seconds += time.perf_counter() - started
        out.cpu_seconds += time.process_time() - started_cpu
        losses.append(kl.item())
        recent = sum(losses[-10:]) / len(losses[-10:])
        if step % max(1, o.steps // 10) == 0 or step == o.steps:
            log(f"step {step}/{o.steps}: training KL {recent:.4f} ({out.seconds:.0f} s)")
        if step in evaluate_at:
            out.curve.append(CurvePoint(step, out.seconds, recent, evaluate()))
            log(f"step {step}: held-out KL {out.curve[-1].held_out.kl:.4f}")
    return out
