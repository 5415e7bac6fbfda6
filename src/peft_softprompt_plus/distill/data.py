"""Prompt distillation's text: the hard system prompt cut from the text the student reads (through the model's chat
template, or as a plain text prefix), checked so that the teacher's tokens are exactly the prefix's followed by the
student's; and `student_text` / `student_inputs`, which format a student's inputs the same way at inference."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence, Union

from ..forward.semantics import left_padded, pad_id
from ..method.config import SoftPromptPlusConfig

__all__ = ["left_padded", "pad_id"]  # the forward's, read here by the teacher, the score and the bench

# The system turn's content when formatting for the student: the text after the system turn must not depend on it
# (checked for every distilled turn), so the student's inputs are rendered without knowing the real system prompt.
PLACEHOLDER = "x"
_MARK = "\u2063turn\u2063"  # an invisible separator, to find where a user turn's content sits in the rendering
PLAIN_SEPARATOR = "\n"  # plain mode: the teacher reads system_prompt + "\n" + text


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja2's TemplateError and the templates' own `raise_exception(...)`
        roles = [m.get("role") for m in messages]
        raise ValueError(
            f"`tokenizer`'s chat template can't render a conversation with roles {roles}: {err}. A template without "
            "a system role can't take a distilled system prompt; use chat=False (CLI: --plain) for a plain prefix."
        ) from err


def _system(content: str) -> list[dict]:
    return [{"role": "system", "content": content}]


def _chat_prefix(tokenizer, system_prompt: str) -> str:
    return _render(tokenizer, _system(system_prompt), generation_prompt=False)


def _chat_suffix(tokenizer, system_prompt: str, conversation) -> str:
    """What the template renders after the system turn: the student's text, so that a template which inserts a
    default system prompt when none is given never sees a conversation without one."""
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else list(conversation)
    if any(m.get("role") == "system" for m in messages):
        raise ValueError(
            "`conversation` holds a system message; the distilled soft prompt takes the system turn's place. Pass the "
            "user and assistant turns only."
        )
    prefix = _chat_prefix(tokenizer, system_prompt)
    whole = _render(tokenizer, _system(system_prompt) + messages, generation_prompt=messages[-1]["role"] == "user")
    if not whole.startswith(prefix):
        raise ValueError(
            "`tokenizer`'s chat template renders the system turn differently once other turns follow it (the "
            f"conversation starts {whole[:80]!r}, the system turn alone is {prefix[:80]!r}), so there is no prefix "
            "for the teacher to read. Use chat=False (CLI: --plain) to distill a plain text prefix."
        )
    return whole[len(prefix) :]


def _plain_prefix(tokenizer, system_prompt: str) -> str:
    return system_prompt + PLAIN_SEPARATOR


def _plain_suffix(tokenizer, system_prompt: str, conversation) -> str:
    if not isinstance(conversation, str):
        raise ValueError(
            f"`conversation` must be a str in plain mode (chat=False), got {type(conversation).__name__}. Pass the "
            "text that follows the system prompt."
        )
    return conversation


def _chat_turn_opener(tokenizer, system_prompt: str) -> tuple[str, str]:
    """The text that opens a user turn after the system turn, and the text that closes it."""
    suffix = _chat_suffix(tokenizer, system_prompt, [{"role": "user", "content": _MARK}])
    opener, _, closer = suffix.partition(_MARK)
    return opener, closer


@dataclass(frozen=True)
class Format:
    """One way of cutting the teacher's text: `prefix` (the hard prompt), `suffix` (the student's text) and `opener`
    (what precedes and follows a user turn, for turns the teacher samples itself)."""

    prefix: Callable[[object, str], str]
    suffix: Callable[[object, str, object], str]
    opener: Callable[[object, str], tuple[str, str]]


FORMATS: dict[str, Format] = {
    "chat": Format(_chat_prefix, _chat_suffix, _chat_turn_opener),
    "plain": Format(_plain_prefix, _plain_suffix, lambda tokenizer, system_prompt: ("", "\n")),
}


def mode_of(chat: bool) -> str:
    return "chat" if chat else "plain"


def _ids(tokenizer, text: str) -> list[int]:
    # The rendered text carries the template's own special tokens; the tokenizer must add none of its own.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class Prepared:
    """The teacher's hard prefix for one system prompt, and how each user turn is cut."""

    mode: str
    system_prompt: str
    prefix_ids: list[int]  # [S] the system turn as the teacher reads it
    stop_ids: list[int]  # tokens that end a turn: EOS and the first token of the template's turn closer

    def suffix_ids(self, tokenizer, turn: str) -> list[int]:
        """The student's tokens for `turn`, checked: the teacher's whole text tokenizes to prefix + these."""
        fmt = FORMATS[self.mode]
        suffix = fmt.suffix(tokenizer, self.system_prompt, turn)
        ids = _ids(tokenizer, suffix)
        if _ids(tokenizer, fmt.prefix(tokenizer, self.system_prompt) + suffix) != self.prefix_ids + ids:
            raise ValueError(
                f"The user turn {turn!r} tokenizes differently after the system prompt than on its own (a token "
                "merges across the boundary), so the student would not read the teacher's tokens. End the system "
                "prompt with a newline or reword the turn's start."
            )
        if self.mode == "chat" and suffix != fmt.suffix(tokenizer, PLACEHOLDER, turn):
            raise ValueError(
                f"The chat template renders the turn {turn!r} differently depending on the system prompt's text, so "
                "`student_inputs` (which renders without it) could not reproduce what the student was trained on."
            )
        return ids


def system_turn(tokenizer, prepared: Prepared) -> tuple[list[int], list[int]]:
    """The ids that open and close the system turn around its content (plain mode: none, then the separator), for a
    student whose soft tokens sit inside the turn (`in_system_turn`). Checked against the teacher's own tokens, so the
    student reads the teacher's text with the system prompt's content alone replaced."""
    if prepared.mode == "plain":
        opener, closer = "", PLAIN_SEPARATOR
    else:
        opener, _, closer = _chat_prefix(tokenizer, _MARK).partition(_MARK)
    head, tail = _ids(tokenizer, opener) if opener else [], _ids(tokenizer, closer) if closer else []
    ids = prepared.prefix_ids
    if ids[: len(head)] != head or ids[len(ids) - len(tail) :] != tail or len(head) + len(tail) >= len(ids):
        raise ValueError(
            f"`in_system_turn`: the system turn's opener {opener!r} and closer {closer!r} don't tokenize as they do "
            "around this system prompt (a token merges across the boundary), so the student would not read the "
            "teacher's tokens. Distill with in_system_turn=False."
        )
    return head, tail


def prepare(tokenizer, system_prompt, chat: bool, num_virtual_tokens: int) -> Prepared:
    """Check the system prompt and the template, and tokenize the hard prefix."""
    if not isinstance(system_prompt, str) or not system_prompt.strip():
        raise ValueError(
            f"`system_prompt` must be the non-empty text of the system prompt to distill, got {system_prompt!r}."
        )
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"`tokenizer` ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '')!r}) has no chat "
            "template, which chat=True needs to place the system prompt. Pass chat=False (CLI: --plain) to distill "
            "a plain text prefix, or set `tokenizer.chat_template`."
        )
    mode = mode_of(chat)
    prefix_ids = _ids(tokenizer, FORMATS[mode].prefix(tokenizer, system_prompt))
    if len(prefix_ids) < num_virtual_tokens:
        raise ValueError(
            f"`system_prompt` is {len(prefix_ids)} tokens as the teacher reads it ({mode} mode), shorter than "
            f"`num_virtual_tokens`={num_virtual_tokens}: the soft prompt would cost more than the text it replaces. "
            f"Pass num_virtual_tokens <= {len(prefix_ids)}, or keep the hard prompt."
        )
    closer = FORMATS[mode].opener(tokenizer, system_prompt)[1]
    stops = [tokenizer.eos_token_id] + (_ids(tokenizer, closer)[:1] if closer.strip() else [])
    stop_ids = list(dict.fromkeys(i for i in stops if i is not None))
    return Prepared(mode, system_prompt, prefix_ids, stop_ids)


def cut_turn(tokenizer, prepared: Prepared, new_ids: list[int]) -> str:
    """A turn the teacher sampled, as text: cut where the template's turn closer (or EOS) begins."""
    closer = FORMATS[prepared.mode].opener(tokenizer, prepared.system_prompt)[1]
    text = tokenizer.decode(new_ids, skip_special_tokens=False)
    for end in (closer.strip() or closer, tokenizer.eos_token or ""):
        if end and end in text:
            text = text[: text.index(end)]
    return text.strip()


def opener_ids(tokenizer, prepared: Prepared) -> list[int]:
    """The teacher's text for sampling a user turn: what opens a user turn after the system prompt."""
    opener = FORMATS[prepared.mode].opener(tokenizer, prepared.system_prompt)[0]
    return _ids(tokenizer, opener)


def fits(prepared: Prepared, tokenizer, turn: str) -> bool:
    """Whether `turn` tokenizes the same after the system prompt as on its own (`Prepared.suffix_ids` accepts it)."""
    try:
        prepared.suffix_ids(tokenizer, turn)
    except ValueError:
        return False
    return True


def passages(keep_text) -> list[str]:
    """`keep_text` (a passage, or a list of them) as a list of stripped passages."""
    return [keep_text.strip()] if isinstance(keep_text, str) else [t.strip() for t in keep_text]


def kept_ids(tokenizer, prepared, keep_text, in_system_turn: bool) -> list[int]:
    """`keep_text`'s ids as the student reads them after its soft tokens: a system turn of its own (plain mode: the
    text and the separator), or, inside the system turn, a paragraph before the turn's end. Several passages are
    joined by blank lines, in the order given."""
    text = "\n\n".join(passages(keep_text))
    return _ids(tokenizer, "\n\n" + text if in_system_turn else FORMATS[prepared.mode].prefix(tokenizer, text))


def kept_positions(tokenizer, prepared: Prepared, keep_text) -> tuple[list[int], list[int]]:
    """What a KV student keeps of the teacher's system turn (`prepared.prefix_ids`) as its own keys/values, sorted:
    the positions whose tokens overlap a passage of `keep_text` (spacing aside), and the template's own around the
    system prompt (header and end of turn; plain: the separator), as an input student's kept text is a turn."""
    text = FORMATS[prepared.mode].prefix(tokenizer, prepared.system_prompt)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:  # a slow (Python) tokenizer has no offsets
        raise ValueError(
            f"`keep_text` with prompt_level='kv' finds the passage's tokens by their character offsets, which "
            f"`tokenizer` ({type(tokenizer).__name__}) does not give. Load a fast tokenizer (use_fast=True)."
        ) from err
    if encoded["input_ids"] != prepared.prefix_ids:
        raise ValueError("`tokenizer` gives other ids for the system turn with offsets than without them.")
    spans = encoded["offset_mapping"]  # [S] (start, end) characters of each token

    def overlapping(start: int, end: int) -> set:
        return {i for i, (s, e) in enumerate(spans) if s < end and e > start}

    begin = text.find(prepared.system_prompt)  # search the system prompt, not the template's own text
    prompt = overlapping(begin, begin + len(prepared.system_prompt)) if begin >= 0 else set(range(len(spans)))
    facts = set()
    for passage in passages(keep_text):
        found = re.compile(r"\s+".join(map(re.escape, passage.split()))).search(text, max(begin, 0))
        if found is None:
            raise ValueError(
                f"`keep_text` passage {passage!r:.80} is not in the system turn as the template renders it (the "
                "template changed its spacing or text). Keep a passage the rendered system turn holds."
            )
        facts |= overlapping(found.start(), found.end())
    return sorted(facts), sorted(set(range(len(spans))) - prompt)


def init_config(tokenizer, prepared: Prepared, n: int, seed: int, init: str, **fields) -> SoftPromptPlusConfig:
    """`init="text"` starts from the system prompt's own first N tokens where the tokenizer can be reloaded (else from
    vocabulary rows); only those N tokens' text is kept in the config, not the whole (maybe private) system prompt.
    `fields`: more config fields (`prompt_level`, `kv_text_start`)."""
    folder = getattr(tokenizer, "name_or_path", "")
    if init != "text" or not (folder and os.path.isdir(folder)):
        init = "vocab" if init == "text" else init
        return SoftPromptPlusConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=n, prompt_init=init, init_seed=seed, **fields
        )
    ids = tokenizer(prepared.system_prompt, add_special_tokens=False)["input_ids"]
    head = tokenizer.decode(ids[:n])
    exact = tokenizer(head, add_special_tokens=False)["input_ids"][:n] == ids[:n]
    text = head if exact and len(ids) >= n else prepared.system_prompt
    return SoftPromptPlusConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=n,
        prompt_init="text",
        prompt_init_text=text,
        tokenizer_name_or_path=folder,
        **fields,
    )


# ---------------------------------------------------------------------------------------------- at inference

Conversation = Union[str, Sequence[dict]]


def student_text(tokenizer, conversation: Conversation, chat: bool = True) -> str:
    """The text a distilled soft prompt reads for `conversation`: in chat mode, the chat template's rendering after
    the system turn (with the generation prompt when the last turn is the user's); in plain mode the text itself."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"`tokenizer` ({getattr(tokenizer, 'name_or_path', '')!r}) has no chat template; pass chat=False for a "
            "prompt distilled in plain mode."
        )
    return FORMATS[mode_of(chat)].suffix(tokenizer, PLACEHOLDER, conversation)


def student_inputs(tokenizer, conversations, chat: bool = True) -> dict:
    """`input_ids` and `attention_mask` `[B, L]`, left-padded for `generate`, of the student's text for each
    conversation (a list of them, or one: a list of messages in chat mode, a str in plain mode)."""
    single = isinstance(conversations, str) or (
        isinstance(conversations, (list, tuple)) and bool(conversations) and isinstance(conversations[0], dict)
    )
    batch = [conversations] if single else list(conversations)
    rows = [_ids(tokenizer, student_text(tokenizer, c, chat)) for c in batch]
    return left_padded(rows, pad_id(tokenizer))
