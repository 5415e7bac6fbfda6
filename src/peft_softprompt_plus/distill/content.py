"""What a system prompt says, kept or lost: probe questions whose answers the prompt fixes, each reader's greedy reply
(the teacher reading the hard prompt, the student, no system prompt), and how often the reply states the facts the
probe asks for. A probe's facts are given (the user's probe file) or taken from the teacher's own reply: the words
of the system prompt it states that the question doesn't already hold. The per-token KL mostly scores style; this
scores content. Also the parts of a system prompt, which the teacher drafts questions about (training turns that
cover every part, and probes about each)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from .data import Prepared

REPLY_TOKENS = 64  # a probe's reply: long enough to state a fact after a greeting
# English function words and the words any answer uses: never a fact on their own.
_COMMON = frozenset(
    """a about above after again all also am an and any are as at be because been before being below between both
    but by can could did do does doing down during each few for from further had has have having he her here hers
    him his how i if in into is it its itself just me more most my no nor not now of off on once only or other our
    out over own same she should so some such than that the their them then there these they this those through to
    too under until up very was we were what when where which while who whom why will with would you your yours
    yes please thank thanks sure help hello hi one may might must shall us let get got like well ask asked answer
    reply say said tell know don't can't i'm you're it's that's""".split()
)
_WORD = re.compile(r"[0-9][0-9,.:]*[0-9]|[0-9]+|[a-z][a-z'@.\-]*[a-z]|[a-z]", re.IGNORECASE)


def words(text: str) -> set[str]:
    """The content words of `text`, normalized: lower case, numbers without thousands commas ("1,200" -> "1200"),
    function words dropped."""
    found = set()
    for word in _WORD.findall(text.casefold()):
        word = word.replace(",", "") if word[0].isdigit() else word.strip("'.-")
        if word and word not in _COMMON:
            found.add(word)
    return found


def passage_of(text, whole: str) -> bool:
    """Whether `text` is a non-empty passage of `whole`, spacing aside (`keep_text`, CLI `--keep-file`)."""
    flat = " ".join(text.split()) if isinstance(text, str) else ""
    return bool(flat) and flat in " ".join(whole.split())


@dataclass(frozen=True)
class Probe:
    """A question whose answer the system prompt fixes; `facts`: what a reply must state (None: the facts of the
    teacher's reply)."""

    question: str
    facts: Optional[tuple[str, ...]] = None


def read_probes(lines: Sequence[str]) -> list[Probe]:
    """Probes from a file's lines: a plain question, or a JSON object `{"question": ..., "facts": [...]}`."""
    probes = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if not line.startswith("{"):
            probes.append(Probe(line))
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"probe line {number} is not valid JSON ({err.msg}): {line[:80]!r}") from err
        question, facts = entry.get("question") if isinstance(entry, dict) else None, entry.get("facts")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f'probe line {number} needs a non-empty string under "question", got {line[:80]!r}.')
        if facts is not None and (not isinstance(facts, list) or not all(isinstance(f, str) for f in facts)):
            raise ValueError(f'probe line {number}: "facts" must be a list of strings, got {facts!r}.')
        probes.append(Probe(question.strip(), tuple(facts) if facts else None))
    return probes


def reference_facts(probe: Probe, teacher_reply: str, system_prompt: str) -> set[str]:
    """The words a reply must carry: the probe's own facts, or the system prompt's words the teacher's reply states
    beyond the question's."""
    if probe.facts is not None:
        return set().union(*(words(fact) for fact in probe.facts))
    return (words(teacher_reply) & words(system_prompt)) - words(probe.question)


@dataclass
class ContentScore:
    """Each reader's mean share of a probe's facts its greedy reply states, over the probes that have facts."""

    teacher: float
    student: float
    none: float
    probes: int  # probes scored (a probe whose reference has no fact is left out)
    replies: list[dict] = field(default_factory=list)  # per probe: question, facts, and each reader's reply

    @property
    def kept(self) -> float:
        """(student - none) / (teacher - none): the share of the teacher's content gain over no prompt the student
        keeps (NaN where the teacher gains nothing)."""
        gain = self.teacher - self.none
        return (self.student - self.none) / gain if gain > 0 else float("nan")


def _share(reply: str, facts: set[str]) -> float:
    return len(words(reply) & facts) / len(facts)


def score(replies: dict[str, list[str]], probes: list[Probe], system_prompt: str) -> ContentScore:
    """`replies[reader]`, one per probe, for the readers "teacher", "student" and "none"."""
    shares: dict[str, list[float]] = {reader: [] for reader in replies}
    kept = []
    for i, probe in enumerate(probes):
        facts = reference_facts(probe, replies["teacher"][i], system_prompt)
        if not facts:
            continue
        for reader, texts in replies.items():
            shares[reader].append(_share(texts[i], facts))
        kept.append({"question": probe.question, "facts": sorted(facts), **{r: t[i] for r, t in replies.items()}})
    if not kept:
        return ContentScore(float("nan"), float("nan"), float("nan"), 0, kept)
    mean = {reader: sum(values) / len(values) for reader, values in shares.items()}
    return ContentScore(mean["teacher"], mean["student"], mean["none"], len(kept), kept)


def replies(
    model, tokenizer, prepared: Prepared, questions: list[str], adapter: str, pad_id: int, batch_size: int,
    prefix_ids: Sequence[int] = (),
):  # fmt: skip
    """`adapter`'s greedy reply to each question (TEACHER, the student, or BASE for no prompt), as text; `prefix_ids`
    go before each question's ids (BASE after the hard prefix's ids reads as the teacher does)."""
    from .teacher import generate_rows  # torch: only here, so the CLI reads a probe file without it

    rows = [list(prefix_ids) + prepared.suffix_ids(tokenizer, q) for q in questions]
    out = []
    for start in range(0, len(rows), batch_size):
        new = generate_rows(
            model, rows[start : start + batch_size], adapter, pad_id, prepared.stop_ids,
            do_sample=False, max_new_tokens=REPLY_TOKENS,
        )  # fmt: skip
        out += [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in new]
    return out


# ---------------------------------------------------------------------------------------------- the prompt's parts

# Questions about a part, built from its opening words: the training turns use the first `turns_per_part` forms, the
# probe a form no training turn uses. (A 135M model asked to draft questions about each part wrote ~2 on-topic
# questions out of 48 in 200 s: docs/distillation.md; templates cost nothing and always ask about the part.)
TRAIN_FORMS = (
    "Can you tell me about {phrase}?",
    "I have a question about {phrase}.",
    "What should I know about {phrase}?",
    "Please explain {phrase}.",
)
PROBE_FORM = "What do you know about {phrase}?"
# Questions whose reply is the part's own text (`quote_parts`): the teacher reads it off the hard prompt, so the
# student can match those positions only by holding the part's facts in its soft tokens.
QUOTE_FORMS = (
    "Quote what your instructions say about {phrase}.",
    "What exactly do your instructions say about {phrase}?",
    "Repeat your instructions about {phrase} word for word.",
)
PHRASE_WORDS = 5


@dataclass(frozen=True)
class Part:
    """One sentence (or list item) of the system prompt, the words a question about it opens with, and its facts:
    the part's content words beyond those."""

    text: str
    phrase: str
    facts: tuple[str, ...]

    def questions(self, count: int) -> list[str]:
        return [form.format(phrase=self.phrase) for form in TRAIN_FORMS[:count]]

    def quotes(self, count: int) -> list[str]:
        return [form.format(phrase=self.phrase) for form in QUOTE_FORMS[:count]]

    def probe(self) -> Probe:
        return Probe(PROBE_FORM.format(phrase=self.phrase), self.facts)


def parts(system_prompt: str) -> list[Part]:
    """The system prompt's sentences and `;`-separated items that state something beyond their opening words. A short
    label before a colon ("Tone:", "Facts you may rely on:") is dropped from the phrase."""
    found = []
    for piece in re.split(r"(?<=[.!?;])\s+|\n+", system_prompt):
        piece = piece.strip()
        head, colon, rest = piece.partition(":")
        body = rest.strip() if colon and len(head.split()) <= 5 and rest.strip() else piece
        tokens = []
        for token in body.rstrip(".;!?").split()[:PHRASE_WORDS]:
            if any(ch.isdigit() for ch in token):  # a number is what the question asks for, never in it
                break
            tokens.append(token.strip(",;:()\"'"))
        while tokens and (not tokens[-1] or tokens[-1].casefold() in _COMMON):  # end on a content word
            tokens.pop()
        phrase = " ".join(tokens)
        facts = words(body) - words(phrase)
        if phrase and facts:
            found.append(Part(piece, phrase[0].lower() + phrase[1:] if not phrase[:2].isupper() else phrase,
                              tuple(sorted(facts))))  # fmt: skip
    return found
