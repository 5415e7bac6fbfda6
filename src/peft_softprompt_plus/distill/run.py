"""`distill_prompt`: a long system prompt compressed into a few soft tokens of a frozen model (Wingate et al. 2022).
The teacher is the model reading the hard prompt, the student reads a soft prompt in its place, and the loss is
KL(teacher || student) on the next-token distributions of the assistant positions, over turns and continuations the
teacher samples. Only the student's prompt trains, and only the student stays in the returned model."""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable, Optional, Sequence, Union

import torch
from peft import PeftModel, get_peft_model

from ..forward import semantics
from . import content as distill_content
from . import data as distill_data
from . import kv_start
from . import score as distill_score
from .checks import level_defaults, level_problems, problems_of, study_problems
from .options import DistillOptions, from_keywords
from .score import CurvePoint, DistillReport, Figures
from .teacher import (
    KEPT_ONLY,
    TEACHER,
    DistillSamples,
    attach_teacher,
    greedy,
    greedy_continuations,
    quoted_rows,
    sample_continuations,
    sample_turns,
    self_study_turns,
    split_turns,
    teacher_gap,
    unique_turns,
)

SELECTION_ROWS = 96  # training rows whose attention chooses a `selected` start
STUDENT = "default"  # PEFT saves the adapter named "default" at the folder's top level: a normal adapter folder


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


def _train(model, samples: DistillSamples, o: DistillOptions, evaluate, log) -> tuple:
    steps, evaluate_at = o.steps, set(o.evaluate_at)
    prompt = model.base_model.prompt(STUDENT)
    # Decay would pull the prompt off the embedding manifold; the optimizer holds the student's prompt alone.
    opt = torch.optim.AdamW([prompt], lr=o.lr, weight_decay=0.0)
    pad, device = _pad_id(model), prompt.device
    picks, losses, curve = _batches(len(samples.train), o.batch_size, random.Random(o.seed)), [], []
    wall = cpu = 0.0
    if 0 in evaluate_at:
        curve.append(CurvePoint(0, 0.0, None, evaluate()))
    for step in range(1, steps + 1):
        started, started_cpu = time.perf_counter(), time.process_time()
        batch = distill_score.scored_batch([samples.train[i] for i in next(picks)], pad, device)
        kl = distill_score.weighted_kl(model, batch, STUDENT, o.answer_weight, o.kl_top_k)
        kl.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        wall, cpu = wall + time.perf_counter() - started, cpu + time.process_time() - started_cpu
        losses.append(kl.item())
        if step % max(1, steps // 10) == 0 or step == steps:
            log(f"step {step}/{steps}: training KL {sum(losses[-10:]) / len(losses[-10:]):.4f} ({wall:.0f} s)")
        if step in evaluate_at:
            curve.append(CurvePoint(step, wall, sum(losses[-10:]) / len(losses[-10:]), evaluate()))
            log(f"step {step}: held-out KL {curve[-1].held_out.kl:.4f}")
    return curve, wall, cpu


def _pad_id(model) -> int:
    return semantics.pad_id(model.get_base_model().config)


def distill_prompt(
    model,
    tokenizer,
    system_prompt: str,
    options: Optional[DistillOptions] = None,
    *,
    user_turns: Optional[Sequence[str]] = None,
    held_out_turns: Optional[Sequence[str]] = None,
    probes: Optional[Sequence[Union[str, distill_content.Probe]]] = None,
    samples: Optional[DistillSamples] = None,
    progress: Optional[Callable[[str], None]] = None,
    **old_keywords,
) -> PeftModel:
    """Train `options.num_virtual_tokens` soft tokens that make the frozen `model` behave as it does after
    `system_prompt`; `options` (a `DistillOptions`, default: its defaults) says how. The data: the user turns to train
    on and to hold out (default: the teacher writes them), the content probes, samples from an earlier report, and a
    `progress` callable given one line at a time.

    Returns a PeftModel holding the student alone (adapter "default"; `save_pretrained` writes a normal adapter
    folder) with `model.distill_report` (a `DistillReport`). Its inputs are formatted by `student_inputs`. The 0.3
    keywords (`old_keywords`: `steps=...`) still work, with a FutureWarning, until 0.4.0. See docs/distillation.md."""
    o = from_keywords(options, old_keywords)
    sink_given = o.kv_frozen_positions is not None
    o = dataclasses.replace(
        o,
        **level_defaults(
            o.prompt_level, lr=o.lr, prompt_init=o.prompt_init, self_study=o.self_study,
            kv_frozen_positions=o.kv_frozen_positions,
        ),
    )  # fmt: skip
    counts = dict(num_virtual_tokens=o.num_virtual_tokens, steps=o.steps, batch_size=o.batch_size)
    counts.update(samples_per_turn=o.samples_per_turn, held_out_samples_per_turn=o.held_out_samples_per_turn)
    counts.update(max_new_tokens=o.max_new_tokens, sampled_turns=o.sampled_turns)
    how = (o.turns_per_part, o.answer_weight, probes, o.greedy_part_replies, o.quote_parts)
    if not isinstance(o.in_system_turn, bool):
        raise ValueError(f"distill_prompt: `in_system_turn` must be True or False, got {o.in_system_turn!r}.")
    problems = problems_of(
        model, user_turns, held_out_turns, counts, o.lr, o.held_out_fraction, o.prompt_init, o.evaluate_at, how
    ) + level_problems(o.prompt_level, o.prompt_init, o.in_system_turn, o.keep_text)
    problems += study_problems(o.self_study, o.kl_top_k, o.kv_frozen_positions, o.prompt_level)
    if o.keep_text is not None and not distill_content.passage_of(o.keep_text, system_prompt):
        problems.append(
            f"`keep_text` must be a non-empty passage of `system_prompt` (spacing aside), got {o.keep_text!r:.80}. "
            "Copy the sentences to keep as hard text (its facts, say) from the system prompt."
        )
    if problems:
        raise ValueError("distill_prompt: " + " ".join(problems))
    log = progress or (lambda line: None)
    prepared = distill_data.prepare(tokenizer, system_prompt, o.chat, o.num_virtual_tokens)
    if samples is not None and (samples.mode, samples.prefix_ids) != (prepared.mode, prepared.prefix_ids):
        raise ValueError("`samples` were drawn for another system prompt or mode; pass samples=None to draw new ones.")
    turns = unique_turns(user_turns) if user_turns is not None else None
    probes = [p if isinstance(p, distill_content.Probe) else distill_content.Probe(p) for p in probes or []] or None
    if turns is not None:
        train, held_out = split_turns(turns, held_out_turns, o.held_out_fraction, o.seed)
        if not train or not held_out:
            raise ValueError(
                f"`user_turns` leave {len(train)} turn(s) to train on and {len(held_out)} held out; pass at least "
                "two distinct turns (and held-out turns that are not all of them)."
            )
    given = (turns or []) + list(held_out_turns or []) + [p.question for p in probes or []]
    for turn in given:  # every given turn is checked before the model changes
        prepared.suffix_ids(tokenizer, turn)
    chosen = o.prompt_init == "selected"  # attach from noise; the selection replaces it once the samples are drawn
    # A selected student's text reads on from where the whole system turn ended, as the teacher's does.
    level = {"prompt_level": o.prompt_level, **({"kv_text_start": len(prepared.prefix_ids)} if chosen else {})}
    if o.kv_frozen_positions is not None:  # the default sink leaves one position to train at N=1
        sink = o.kv_frozen_positions
        level["kv_frozen_positions"] = sink if sink_given else min(sink, o.num_virtual_tokens - 1)
    start = "random" if chosen else o.prompt_init
    config = distill_data.init_config(tokenizer, prepared, o.num_virtual_tokens, o.seed, start, **level)
    config.chat_format = "student" if o.chat else None  # how a server formats its messages (`student_inputs`)
    if o.in_system_turn:  # the template's system header before the soft tokens, its end of turn after them
        head, tail = distill_data.system_turn(tokenizer, prepared)
        config.prompt_prefix_ids, config.prompt_suffix_ids = head or None, tail or None
    if o.keep_text is not None:  # frozen hard tokens after the soft ones, saved with the adapter
        kept = distill_data.kept_ids(tokenizer, prepared, o.keep_text, o.in_system_turn)
        config.prompt_suffix_ids = kept + (config.prompt_suffix_ids or [])
    model = get_peft_model(model, config)
    attach_teacher(model, prepared.prefix_ids)
    model.eval()  # no dropout: the student matches the teacher's own deterministic distribution
    pad, stops = _pad_id(model), prepared.stop_ids
    with torch.random.fork_rng():
        torch.manual_seed(o.seed)
        if samples is None:
            began, began_cpu = time.perf_counter(), time.process_time()
            draw = (turns, held_out_turns, probes, o.turns_per_part, o.greedy_part_replies, o.quote_parts)
            draw += (o.self_study,)
            samples = _draw(model, tokenizer, prepared, draw, o.held_out_fraction, o.seed, counts, log)
            samples.seconds = (time.perf_counter() - began, time.process_time() - began_cpu)
    if chosen:
        _select(model, prepared.prefix_ids, samples, o.num_virtual_tokens, config.kv_frozen_positions)
    gap = teacher_gap(model, prepared.prefix_ids, samples.train[0].ids)
    none = distill_score.none_figures(model, samples, pad, stops, o.batch_size)

    def evaluate() -> Figures:
        return distill_score.figures(model, samples, STUDENT, pad, stops, o.batch_size)

    curve, wall, cpu = _train(model, samples, o, evaluate, log)
    student = curve[-1].held_out if curve and curve[-1].step == o.steps else evaluate()
    kept_only = None
    if o.keep_text is not None:  # the kept text alone as the system turn: what the soft tokens add over it
        attach_teacher(model, distill_data.kept_ids(tokenizer, prepared, o.keep_text, False), KEPT_ONLY)
        kept_only = distill_score.figures(model, samples, KEPT_ONLY, pad, stops, o.batch_size)
    readers = (STUDENT, KEPT_ONLY) if kept_only is not None else (STUDENT,)
    scores = distill_score.content_scores(model, tokenizer, prepared, samples, readers, pad, o.batch_size, log)
    content, kept_content = scores.get(STUDENT), scores.get(KEPT_ONLY)
    init = "selected (the system turn's most attended positions)" if chosen else f"{config.prompt_init}"
    init += " (the system prompt's first tokens)" if config.prompt_init == "text" and not chosen else ""
    init += ", KV" if o.prompt_level == "kv" else ""
    report = DistillReport(
        prepared.mode, len(prepared.prefix_ids), o.num_virtual_tokens, o.steps, o.batch_size, o.lr, o.seed, init, gap,
        student, none, wall, cpu, samples, curve, content, o.turns_per_part, o.answer_weight, o.greedy_part_replies,
        o.quote_parts, kept_only, kept_content, o.kl_top_k,
    )  # fmt: skip
    model.delete_adapter(TEACHER)
    if kept_only is not None:
        model.delete_adapter(KEPT_ONLY)
    model.softprompt_plus_metrics = report.metrics()
    model.distill_report = report
    for line in report.lines():
        log(line)
    return model


def _select(model, prefix_ids: list[int], samples: DistillSamples, n: int, frozen: int) -> None:
    """The `selected` start: the student's N positions, the system turn's most attended by the training texts."""
    heads = model.base_model.forward_state.kv_layout.heads
    # Rows spread over every kind of training turn (the teacher's own, the questions about each part), scored by the
    # attention their replies pay: the positions a reply reads its facts from.
    rows = samples.train[:: max(1, len(samples.train) // SELECTION_ROWS)][:SELECTION_ROWS]
    scores = kv_start.attention_scores(model, prefix_ids, [(s.ids, s.first) for s in rows], heads)
    values = kv_start.selected(kv_start.prompt_cache(model, prefix_ids), scores, n, frozen)
    kv_start.install(model, STUDENT, values)


def _draw(model, tokenizer, prepared, draw: tuple, fraction, seed, counts, log) -> DistillSamples:
    """The teacher's samples: user turns (given, or written by the teacher; with `turns_per_part`, that many questions
    about each part of the system prompt too), continuations, greedy references, and the content probes (given, or
    one question per part in a form no training turn uses); with `greedy_part_replies`, each question about a part
    also trains on the teacher's greedy reply."""
    turns, held_out_turns, probes, turns_per_part, greedy_part_replies, quote_parts, self_study = draw
    pad, stops, batch = _pad_id(model), prepared.stop_ids, counts["batch_size"]
    written = turns is None
    if written:
        how = "self-study " if self_study else ""
        log(f"sampling {counts['sampled_turns']} {how}user turns from the teacher")
        write = self_study_turns if self_study else sample_turns
        turns = write(model, tokenizer, prepared, counts["sampled_turns"], batch, pad)
    parts = distill_content.parts(prepared.system_prompt)
    drafted = [
        [q for q in part.questions(turns_per_part) if distill_data.fits(prepared, tokenizer, q)] for part in parts
    ]
    drafted_probes = probes is None
    if drafted_probes:  # one question per part, in a form no training turn uses
        probes = [part.probe() for part in parts if distill_data.fits(prepared, tokenizer, part.probe().question)]
    # The user's held-out turns stay held out even when the teacher writes the training turns.
    train, held_out = split_turns(turns, held_out_turns, fraction, seed)
    if written:  # sampled turns are checked here; given ones were checked before the model changed
        train = [t for t in train if distill_data.fits(prepared, tokenizer, t)]
        held_out = [t for t in held_out if distill_data.fits(prepared, tokenizer, t)]
        if not train or not held_out:
            raise ValueError(
                f"The teacher's own user turns left {len(train)} to train on and {len(held_out)} held out; pass "
                "`user_turns` (CLI: --user-file), or a larger `sampled_turns`."
            )
    probed = {p.question.casefold() for p in probes}
    train = unique_turns(train + [q for questions in drafted for q in questions])
    train = [t for t in train if t.casefold() not in probed and t not in held_out]
    suffixes = [prepared.suffix_ids(tokenizer, t) for t in train]
    held = [prepared.suffix_ids(tokenizer, t) for t in held_out]
    log(
        f"sampling teacher continuations: {counts['samples_per_turn']} for each of {len(train)} training turns, "
        f"{counts['held_out_samples_per_turn']} for each of {len(held)} held-out turns"
    )
    out = DistillSamples(prepared.mode, prepared.prefix_ids, train, held_out, sampled_turns=written, probes=probes)
    out.self_study = written and self_study
    out.drafted_probes = drafted_probes
    length = counts["max_new_tokens"]
    out.train = sample_continuations(model, suffixes, counts["samples_per_turn"], length, pad, stops, batch)
    if greedy_part_replies:
        asked = {q for questions in drafted for q in questions}
        on_parts = [suffix for turn, suffix in zip(train, suffixes, strict=True) if turn in asked]
        out.train += greedy_continuations(model, on_parts, length, pad, stops, batch)
    out.train += quoted_rows(tokenizer, prepared, parts, quote_parts)
    out.held_out = sample_continuations(model, held, counts["held_out_samples_per_turn"], length, pad, stops, batch)
    out.held_out_prompts = held
    out.teacher_greedy = greedy(model, held, TEACHER, pad, stops, batch)
    return out
