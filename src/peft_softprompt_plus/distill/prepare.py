"""The prepare stage of `distill_prompt`: the options resolved, every argument checked before the model changes, the
student attached beside the frozen teacher (the hard system prompt as an adapter), and the teacher's samples drawn:
user turns (given, written, or by self-study), continuations, greedy references and content probes."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from peft import PeftModel, get_peft_model

from ..forward import semantics, validation
from . import content as distill_content
from . import data as distill_data
from .options import DistillOptions
from .refusals import LEVEL_DEFAULTS, keep_text_form, level_defaults, level_problems, problems_of, study_problems
from .teacher import (
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

STUDENT = "default"  # PEFT saves the adapter named "default" at the folder's top level: a normal adapter folder


@dataclass
class Given:
    """What the caller hands `distill_prompt` beside the options: the data."""

    user_turns: Optional[Sequence[str]] = None
    held_out_turns: Optional[Sequence[str]] = None
    probes: Optional[Sequence[Union[str, distill_content.Probe]]] = None
    samples: Optional[DistillSamples] = None  # an earlier report's: the teacher is not asked again


@dataclass
class Preparation:
    """The prepare stage's record."""

    model: PeftModel  # the student (STUDENT, not yet started when `selected`) and the teacher
    prompt: distill_data.Prepared  # the system prompt as the teacher reads it
    samples: DistillSamples
    teacher_gap: float  # max |teacher adapter - base on the hard ids| / max |logit|, on one training row
    pad_id: int
    # A KV student's kept positions of the system turn (a passage's and the template's own), and how many are the
    # passage's (`keep_text`): the teacher's keys/values, never trained.
    kept_positions: tuple[int, ...] = ()
    facts: int = 0
    options: Optional[DistillOptions] = None  # `o` as it ran: a KV student's default N settled


def resolved(o: DistillOptions) -> DistillOptions:
    """`o` with every None the student form's default (`LEVEL_DEFAULTS`). The default sink leaves one position to
    train at N=1; a sink the caller gave is checked as given."""
    chosen = level_defaults(
        o.prompt_level, lr=o.lr, prompt_init=o.prompt_init, self_study=o.self_study,
        kv_frozen_positions=o.kv_frozen_positions,
    )  # fmt: skip
    if o.num_virtual_tokens is None and o.prompt_level != "kv":  # a KV student's N needs the system turn: _kv_n
        chosen["num_virtual_tokens"] = level_defaults(o.prompt_level, num_virtual_tokens=None)["num_virtual_tokens"]
    n = o.num_virtual_tokens
    if o.kv_frozen_positions is None and chosen["kv_frozen_positions"] and type(n) is int and n >= 1:
        chosen["kv_frozen_positions"] = min(chosen["kv_frozen_positions"], n - 1)
    return dataclasses.replace(o, **chosen)


def _check(model, system_prompt: str, o: DistillOptions, given: Given) -> None:
    if not isinstance(o.in_system_turn, bool):
        raise ValueError(f"distill_prompt: `in_system_turn` must be True or False, got {o.in_system_turn!r}.")
    problems = problems_of(model, o, given.user_turns, given.held_out_turns, given.probes)
    problems += level_problems(o.prompt_level, o.prompt_init, o.in_system_turn, o.keep_text)
    problems += study_problems(o.self_study, o.kl_top_k, o.kv_frozen_positions, o.prompt_level)
    kept = distill_data.passages(o.keep_text) if o.keep_text is not None and keep_text_form(o.keep_text) else []
    for passage in kept:
        if not distill_content.passage_of(passage, system_prompt):
            problems.append(
                f"`keep_text` must be a non-empty passage of `system_prompt` (spacing aside), got {passage!r:.80}. "
                "Copy the sentences to keep as hard text (its facts, say) from the system prompt."
            )
    if problems:
        raise ValueError("distill_prompt: " + " ".join(problems))


def _student_config(tokenizer, prompt: distill_data.Prepared, o: DistillOptions):
    selected = o.prompt_init == "selected"  # attached from noise; the start stage replaces it
    # A selected student's text reads on from where the whole system turn ended, as the teacher's does.
    level = {"prompt_level": o.prompt_level, **({"kv_text_start": len(prompt.prefix_ids)} if selected else {})}
    if o.kv_frozen_positions is not None:
        level["kv_frozen_positions"] = o.kv_frozen_positions
    start = "random" if selected else o.prompt_init
    config = distill_data.init_config(tokenizer, prompt, o.num_virtual_tokens, o.seed, start, **level)
    config.chat_format = "student" if o.chat else None  # how a server formats its messages (`student_inputs`)
    if o.in_system_turn:  # the template's system header before the soft tokens, its end of turn after them
        head, tail = distill_data.system_turn(tokenizer, prompt)
        config.prompt_prefix_ids, config.prompt_suffix_ids = head or None, tail or None
    if o.keep_text is not None and o.prompt_level == "input":  # frozen hard tokens after the soft ones, saved
        kept = distill_data.kept_ids(tokenizer, prompt, o.keep_text, o.in_system_turn)
        config.prompt_suffix_ids = kept + (config.prompt_suffix_ids or [])
    return config


def prepare(model, tokenizer, system_prompt: str, o: DistillOptions, given: Given, log) -> Preparation:
    """Check, attach the student and the teacher, draw the samples (`o` resolved; a KV student's default N is
    settled here, in `Preparation.options`)."""
    _check(model, system_prompt, o, given)
    prompt = distill_data.prepare(tokenizer, system_prompt, o.chat, o.num_virtual_tokens or 1)
    held = _held(tokenizer, prompt, o)
    o = _kv_n(prompt, o, held)
    kept, facts = _kv_check(model, prompt, o, held)
    if given.samples is not None and (given.samples.mode, given.samples.prefix_ids) != (
        prompt.mode,
        prompt.prefix_ids,
    ):
        raise ValueError("`samples` were drawn for another system prompt or mode; pass samples=None to draw new ones.")
    turns = unique_turns(given.user_turns) if given.user_turns is not None else None
    probes = [p if isinstance(p, distill_content.Probe) else distill_content.Probe(p) for p in given.probes or []]
    given = dataclasses.replace(given, user_turns=turns, probes=probes or None)
    if turns is not None:
        train, held_out = split_turns(turns, given.held_out_turns, o.held_out_fraction, o.seed)
        if not train or not held_out:
            raise ValueError(
                f"`user_turns` leave {len(train)} turn(s) to train on and {len(held_out)} held out; pass at least "
                "two distinct turns (and held-out turns that are not all of them)."
            )
    for turn in (turns or []) + list(given.held_out_turns or []) + [p.question for p in probes]:
        prompt.suffix_ids(tokenizer, turn)  # every given turn is checked before the model changes
    model = get_peft_model(model, _student_config(tokenizer, prompt, o))
    attach_teacher(model, prompt.prefix_ids)
    model.eval()  # no dropout: the student matches the teacher's own deterministic distribution
    pad = semantics.pad_id(model.get_base_model().config)
    samples = given.samples
    if samples is None:
        with torch.random.fork_rng():
            torch.manual_seed(o.seed)
            began, began_cpu = time.perf_counter(), time.process_time()
            samples = _draw(model, tokenizer, prompt, o, given, pad, log)
            samples.seconds = (time.perf_counter() - began, time.process_time() - began_cpu)
    gap = teacher_gap(model, prompt.prefix_ids, samples.train[0].ids)
    return Preparation(
        model=model, prompt=prompt, samples=samples, teacher_gap=gap, pad_id=pad, kept_positions=kept, facts=facts,
        options=o,
    )  # fmt: skip


@dataclass(frozen=True)
class Held:
    """A `selected` KV student's positions of the system turn that `keep_text` holds as the teacher's keys/values."""

    facts: tuple[int, ...]  # the kept passage's own positions
    kept: tuple[int, ...]  # those and the template's, sorted: what the student keeps
    forced: frozenset[int]  # those and the frozen sink: every position N must count


def _held(tokenizer, prompt: distill_data.Prepared, o: DistillOptions) -> Optional[Held]:
    """The positions `keep_text` holds, read once from the system turn's offsets; None without a kept passage."""
    if o.prompt_level != "kv" or o.prompt_init != "selected" or o.keep_text is None:
        return None
    facts, frame = distill_data.kept_positions(tokenizer, prompt, o.keep_text)
    kept = tuple(sorted(set(facts) | set(frame)))
    return Held(tuple(facts), kept, frozenset(kept) | frozenset(range(o.kv_frozen_positions or 0)))


def _kv_n(prompt: distill_data.Prepared, o: DistillOptions, held: Optional[Held]) -> DistillOptions:
    """`o` with a KV student's N left None settled: the selected positions of its recipe, plus the held ones (kept
    and the frozen sink), at most the system turn's length (every position: the teacher)."""
    if o.num_virtual_tokens is not None:
        return o
    n = LEVEL_DEFAULTS["kv"]["num_virtual_tokens"] + (len(held.forced) if held else 0)
    return dataclasses.replace(o, num_virtual_tokens=min(n, len(prompt.prefix_ids)))


def _kv_check(
    model, prompt: distill_data.Prepared, o: DistillOptions, held: Optional[Held]
) -> tuple[tuple[int, ...], int]:
    """A `selected` KV student's checks that need the system turn's tokens: the sliding window, and the kept
    positions, which N counts (returned, with how many of them are the passage's)."""
    if o.prompt_level != "kv" or o.prompt_init != "selected":
        return (), 0
    s, n = len(prompt.prefix_ids), o.num_virtual_tokens
    why = validation.window_refused(model, s, n)
    if why:
        raise ValueError(
            f"distill_prompt: prompt_init='selected' keeps {n} of the system turn's {s} positions, each at its own "
            f"position, and the text reads on at {s}: {why} Pass num_virtual_tokens={s} (every position: the "
            "teacher, exactly), another start (prompt_init='text', 'vocab' or 'random': a KV prompt at positions "
            "0..N-1), or prompt_level='input'."
        )
    if held is None:
        return (), 0
    facts, kept, forced = held.facts, held.kept, held.forced
    frame = set(kept) - set(facts)
    if len(forced) > n:
        raise ValueError(
            f"distill_prompt: `keep_text` covers {len(facts)} of the system turn's {s} positions, {len(forced)} with "
            f"the template's own ({len(frame)}) and the {o.kv_frozen_positions or 0} frozen first, more than "
            f"`num_virtual_tokens`={n}, which counts every kept position. Pass num_virtual_tokens >= {len(forced)} "
            "(the kept positions, then the ones to select), or keep a shorter passage."
        )
    return tuple(kept), len(facts)


def _draw(model, tokenizer, prompt, o: DistillOptions, given: Given, pad: int, log) -> DistillSamples:
    """The teacher's samples: user turns (given, or written by the teacher; with `turns_per_part`, that many questions
    about each part of the system prompt too), continuations, greedy references, and the content probes (given, or
    one question per part in a form no training turn uses); with `greedy_part_replies`, each question about a part
    also trains on the teacher's greedy reply."""
    stops, batch, turns = prompt.stop_ids, o.batch_size, given.user_turns
    written = turns is None
    if written:
        log(f"sampling {o.sampled_turns} {'self-study ' if o.self_study else ''}user turns from the teacher")
        write = self_study_turns if o.self_study else sample_turns
        turns = write(model, tokenizer, prompt, o.sampled_turns, batch, pad)
    parts = distill_content.parts(prompt.system_prompt)
    drafted = [
        [q for q in part.questions(o.turns_per_part) if distill_data.fits(prompt, tokenizer, q)] for part in parts
    ]
    probes = given.probes
    if probes is None:  # one question per part, in a form no training turn uses
        probes = [part.probe() for part in parts if distill_data.fits(prompt, tokenizer, part.probe().question)]
    # The user's held-out turns stay held out even when the teacher writes the training turns.
    train, held_out = split_turns(turns, given.held_out_turns, o.held_out_fraction, o.seed)
    if written:  # sampled turns are checked here; given ones were checked before the model changed
        train = [t for t in train if distill_data.fits(prompt, tokenizer, t)]
        held_out = [t for t in held_out if distill_data.fits(prompt, tokenizer, t)]
        if not train or not held_out:
            raise ValueError(
                f"The teacher's own user turns left {len(train)} to train on and {len(held_out)} held out; pass "
                "`user_turns` (CLI: --user-file), or a larger `sampled_turns`."
            )
    probed = {p.question.casefold() for p in probes}
    train = unique_turns(train + [q for questions in drafted for q in questions])
    train = [t for t in train if t.casefold() not in probed and t not in held_out]
    suffixes = [prompt.suffix_ids(tokenizer, t) for t in train]
    held = [prompt.suffix_ids(tokenizer, t) for t in held_out]
    log(
        f"sampling teacher continuations: {o.samples_per_turn} for each of {len(train)} training turns, "
        f"{o.held_out_samples_per_turn} for each of {len(held)} held-out turns"
    )
    out = DistillSamples(prompt.mode, prompt.prefix_ids, train, held_out, sampled_turns=written, probes=probes)
    out.self_study = written and o.self_study
    out.drafted_probes = given.probes is None
    length = o.max_new_tokens
    out.train = sample_continuations(model, suffixes, o.samples_per_turn, length, pad, stops, batch)
    if o.greedy_part_replies:
        asked = {q for questions in drafted for q in questions}
        on_parts = [suffix for turn, suffix in zip(train, suffixes, strict=True) if turn in asked]
        out.train += greedy_continuations(model, on_parts, length, pad, stops, batch)
    out.train += quoted_rows(tokenizer, prompt, parts, o.quote_parts)
    out.held_out = sample_continuations(model, held, o.held_out_samples_per_turn, length, pad, stops, batch)
    out.held_out_prompts = held
    out.teacher_greedy = greedy(model, held, TEACHER, pad, stops, batch)
    return out
