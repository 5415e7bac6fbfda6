"""The checks `SoftPromptPlusConfig` runs on construction: one function per concern, each returning the problem (a
sentence naming the field, its value and the fix) or None."""

from __future__ import annotations

from typing import Any, Callable, Optional

from . import placement
from .enums import ForwardPath, KVSelection, PromptInit, PromptLevel, Reparameterization, ValidateGradients
from .tasks import task_of

Config = Any  # a SoftPromptPlusConfig: config.py imports this module, so the type is named, not imported


CHOICES = {
    "prompt_level": PromptLevel,
    "prompt_init": PromptInit,
    "reparameterization": Reparameterization,
    "validate_gradients": ValidateGradients,
    "forward_path": ForwardPath,
    "kv_selection": KVSelection,
}


def _choice(name: str) -> Callable[[Config], Optional[str]]:
    def check(config: Config) -> Optional[str]:
        value, allowed = getattr(config, name), [m.value for m in CHOICES[name]]
        if value not in allowed:
            return f"`{name}` must be one of {allowed}, got {value!r}."
        return None

    return check


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _task(c: Config) -> Optional[str]:
    try:
        task_of(c.task_type)
    except ValueError as err:
        return str(err)
    return None


def _num_virtual_tokens(c: Config) -> Optional[str]:
    value = c.num_virtual_tokens
    if value is None and c.prompt_init == PromptInit.DEMONSTRATIONS.value:
        return None  # all of the demonstrations' positions, resolved at attach
    if not _is_int(value) or value < 1:
        return f"`num_virtual_tokens` must be a positive int (>= 1), got {value!r} ({type(value).__name__})."
    return None


def _text_init(c: Config) -> Optional[str]:
    text = c.prompt_init == PromptInit.TEXT.value
    if text and not c.prompt_init_text:
        return (
            f"`prompt_init_text` must be a non-empty string when `prompt_init='text'`, got {c.prompt_init_text!r}. "
            "Pass the text whose embeddings should start the prompt."
        )
    if not text and c.prompt_init_text is not None:
        return (
            f"`prompt_init_text` is only used with `prompt_init='text'`, got prompt_init={str(c.prompt_init)!r} with "
            f"prompt_init_text={c.prompt_init_text!r}. Set `prompt_init='text'` or drop the text."
        )
    return None


def _labels(c: Config) -> Optional[str]:
    labels, wanted = c.prompt_init_labels, c.prompt_init == PromptInit.LABELS.value
    words = labels if isinstance(labels, (list, tuple)) else []
    well_formed = bool(words) and all(isinstance(w, str) and w.strip() for w in words)
    if wanted and not well_formed:
        return (
            "`prompt_init_labels` must be a non-empty list of non-empty strings when `prompt_init='labels'`, got "
            f"{labels!r}. Pass the label words, e.g. [' positive', ' negative']."
        )
    if not wanted and labels is not None:
        return (
            f"`prompt_init_labels` is only used with `prompt_init='labels'`, got prompt_init={str(c.prompt_init)!r} "
            f"with prompt_init_labels={labels!r}. Set `prompt_init='labels'` or drop the labels."
        )
    return None


def _tokenizer(c: Config) -> Optional[str]:
    needs = c.prompt_init in (PromptInit.TEXT.value, PromptInit.LABELS.value)
    if needs and not c.tokenizer_name_or_path:
        return (
            f"`tokenizer_name_or_path` is needed when `prompt_init={str(c.prompt_init)!r}`, got "
            f"{c.tokenizer_name_or_path!r}. Pass a local tokenizer directory or Hub id."
        )
    return None


def _init_adapter(c: Config) -> Optional[str]:
    wanted, folder = c.prompt_init == PromptInit.ADAPTER.value, c.prompt_init_adapter
    if wanted and not (isinstance(folder, str) and folder):
        return (
            "`prompt_init_adapter` must be the folder of a saved adapter when `prompt_init='adapter'`, got "
            f"{folder!r}."
        )
    if not wanted and folder is not None:
        return (
            f"`prompt_init_adapter` is only used with `prompt_init='adapter'`, got prompt_init={str(c.prompt_init)!r} "
            f"with prompt_init_adapter={folder!r}. Set `prompt_init='adapter'` or drop the folder."
        )
    return None


def _demonstrations(c: Config) -> Optional[str]:
    texts, wanted = c.prompt_init_texts, c.prompt_init == PromptInit.DEMONSTRATIONS.value
    if not wanted:
        given = [n for n in ("prompt_init_texts", "demonstration_ids", "demonstration_spans") if getattr(c, n)]
        return (
            f"{', '.join(f'`{n}`' for n in given)} only appl{'y' if len(given) > 1 else 'ies'} to "
            f"`prompt_init='demonstrations'`, got prompt_init={str(c.prompt_init)!r}. Set it or drop them."
            if given
            else None
        )
    problems = []
    if not (isinstance(texts, (list, tuple)) and texts and all(isinstance(t, str) and t.strip() for t in texts)):
        problems.append(
            f"`prompt_init_texts` must be a non-empty list of non-empty strings (the demonstrations) when "
            f"`prompt_init='demonstrations'`, got {texts!r}. Pass k training rows as the model reads them."
        )
    if not is_kv(c):
        problems.append(
            f"`prompt_init='demonstrations'` needs `prompt_level='kv'`, got {str(c.prompt_level)!r}: an input "
            "prompt's pass mixes each demonstration into every later position, so leave-one-out can't take one "
            "out. For the same start as input vectors, use prompt_init='text' with the joined demonstrations."
        )
    if not isinstance(c.demonstration_separator, str):
        problems.append(f"`demonstration_separator` must be a string, got {c.demonstration_separator!r}.")
    if not c.tokenizer_name_or_path and c.demonstration_ids is None:
        problems.append(
            "`tokenizer_name_or_path` is needed to tokenize `prompt_init_texts` (`prompt_init='demonstrations'`), "
            f"got {c.tokenizer_name_or_path!r}. Pass a local tokenizer directory."
        )
    return " ".join(problems) or None


def _regularizers(c: Config) -> Optional[str]:
    problems = []
    if not isinstance(c.kv_leave_one_out, bool):
        problems.append(f"`kv_leave_one_out` must be True or False, got {c.kv_leave_one_out!r}.")
    p = c.kv_position_dropout
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        problems.append(f"`kv_position_dropout` must be a number in [0, 1), got {p!r}. 0 turns it off.")
    elif p and not is_kv(c):
        problems.append(
            f"`kv_position_dropout`={p!r} drops a KV prompt's positions; pass prompt_level='kv' too, or leave it 0."
        )
    return " ".join(problems) or None


def _selection(c: Config) -> Optional[str]:
    if c.kv_selection != KVSelection.PER_HEAD.value:
        return None
    problems = []
    if not is_kv(c) or c.prompt_init != PromptInit.DEMONSTRATIONS.value:
        problems.append(
            f"`kv_selection='per_head'` chooses each layer's and key/value head's positions of a demonstrations "
            f"context, so it needs prompt_level='kv' and prompt_init='demonstrations', got "
            f"prompt_level={str(c.prompt_level)!r} and prompt_init={str(c.prompt_init)!r}. Set both, or leave "
            "kv_selection='shared'."
        )
    if c.num_virtual_tokens is None:
        problems.append(
            "`kv_selection='per_head'` keeps N of the context's positions per layer and head, got "
            "num_virtual_tokens=None (every position, nothing to choose). Pass an N below the context's positions."
        )
    return " ".join(problems) or None


def _residual(c: Config) -> Optional[str]:
    problems = []
    if not _is_int(c.residual_hidden) or c.residual_hidden < 1:
        problems.append(f"`residual_hidden` must be a positive int, got {c.residual_hidden!r}.")
    if not isinstance(c.residual_layer_norm, bool):
        problems.append(f"`residual_layer_norm` must be True or False, got {c.residual_layer_norm!r}.")
    return " ".join(problems) or None


def _init_seed(c: Config) -> Optional[str]:
    if c.init_seed is not None and not _is_int(c.init_seed):
        return f"`init_seed` must be an int or None, got {c.init_seed!r}."
    return None


def _modules_to_save(c: Config) -> Optional[str]:
    names = c.modules_to_save
    if names is not None and not (isinstance(names, list) and all(isinstance(m, str) for m in names)):
        return f"`modules_to_save` must be a list of module names or None, got {names!r}."
    return None


CHAT_FORMATS = ("template", "student")


def _chat_format(config: Config) -> Optional[str]:
    if config.chat_format is not None and config.chat_format not in CHAT_FORMATS:
        return f"`chat_format` must be one of {list(CHAT_FORMATS)} or None, got {config.chat_format!r}."
    return None


def is_kv(config: Config) -> bool:
    return config.prompt_level == PromptLevel.KV.value


_KV_FIELDS = ("kv_frozen_positions", "kv_text_start", "kv_base")
# What a KV prompt can't take, with the way to get what the user meant.
_NOT_FOR_KV = {
    "forward_path": (
        lambda c: c.forward_path == ForwardPath.CONCAT.value,
        "a KV prompt enters at the attention only, never concatenated in front of the text. Use 'auto'",
    ),
    "reparameterization": (
        lambda c: c.reparameterization != Reparameterization.NONE.value,
        "the residual encoder maps embedding rows, and a KV prompt has none. Use 'none'",
    ),
    **{
        name: (
            lambda c, name=name: getattr(c, name) is not None,
            "a KV prompt has no frozen hard text of its own (the keys of text after it depend on the trained ones). "
            "Put the text in `prompt_init_text`, or lift an input adapter that has it (`prompt_init='adapter'` folds "
            "its prefix and suffix in)",
        )
        for name in ("prompt_prefix", "prompt_suffix", "prompt_prefix_ids", "prompt_suffix_ids")
    },
}


def _kv(c: Config) -> Optional[str]:
    if not is_kv(c):
        given = [name for name in _KV_FIELDS if getattr(c, name) is not None]
        return (
            f"{', '.join(f'`{n}`={getattr(c, n)!r}' for n in given)} only appl{'y' if len(given) > 1 else 'ies'} to "
            f"`prompt_level='kv'`, got "
            f"prompt_level={str(c.prompt_level)!r}. Set `prompt_level='kv'` or drop them."
            if given
            else None
        )
    problems = [
        f"`{name}`={getattr(c, name)!r} can't be used with `prompt_level='kv'`: {why}."
        for name, (refused, why) in _NOT_FOR_KV.items()
        if refused(c)
    ]
    n, frozen, start = c.num_virtual_tokens, c.kv_frozen_positions, c.kv_text_start
    if frozen is not None and not (_is_int(frozen) and 0 <= frozen and (n is None or (_is_int(n) and frozen < n))):
        problems.append(
            f"`kv_frozen_positions` must be an int in [0, num_virtual_tokens) = [0, {n}), got {frozen!r}: at least "
            "one position must train."
        )
    if start is not None and not (_is_int(start) and _is_int(n) and start >= n):
        problems.append(
            f"`kv_text_start` must be an int >= num_virtual_tokens ({n}), got {start!r}: the text starts after the "
            "prompt's positions. Leave it None for N."
        )
    if c.kv_base is not None and not isinstance(c.kv_base, dict):
        problems.append(f"`kv_base` must be a dict recorded at attach, or None, got {c.kv_base!r}.")
    return " ".join(problems) or None


# No position frozen unless asked: on the task suite a KV prompt trained at every position, as PEFT PREFIX_TUNING
# trains, was ahead of one with its first position frozen (bench/RESULTS.md). A KV student freezes its sink: its own
# measured recipe (distill/refusals.py).
KV_FROZEN_DEFAULT = 0


CHECKS: tuple[Callable[[Config], Optional[str]], ...] = (
    _task,
    _num_virtual_tokens,
    *(_choice(name) for name in CHOICES),
    _text_init,
    _labels,
    _tokenizer,
    _init_adapter,
    _demonstrations,
    _regularizers,
    _selection,
    placement.check,
    _residual,
    _init_seed,
    _modules_to_save,
    _chat_format,
    _kv,
)
