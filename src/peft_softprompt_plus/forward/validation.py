"""Input checks at the prompted forward and `generate`: each bad input is refused before the model runs, with an error
that names the argument, the value it got, and the fix. Checks are independent; the first failing one raises."""

from __future__ import annotations

import difflib
from typing import Optional

import torch
from torch import nn

from ..method.tasks import task_name
from . import semantics
from .windows import smallest_window


def _shape(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} ({str(t.dtype).removeprefix('torch.')})"


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a torch.Tensor, got {type(value).__name__}. Wrap it: torch.tensor({name}) (a batch of "
            f"one row: torch.tensor([{name}]))."
        )
    return value


def _integers(name: str, value: torch.Tensor) -> None:
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise ValueError(f"`{name}` must hold integer ids, got {_shape(value)}. Convert it with `.long()`.")


def _rows_and_tokens(name: str, value: torch.Tensor, dims: int = 2) -> None:
    if value.dim() != dims:
        fix = f" Add the batch dimension: `{name}.unsqueeze(0)`." if value.dim() == dims - 1 else ""
        layout = "[batch, seq_len]" if dims == 2 else "[batch, seq_len, hidden size]"
        raise ValueError(f"`{name}` must be {layout}, got {_shape(value)}.{fix}")
    if value.shape[0] == 0 or value.shape[1] == 0:
        raise ValueError(f"`{name}` has {_shape(value)}: a batch needs at least one row and one token.")


def _in_range(name: str, value: torch.Tensor, high: int, allowed: Optional[int] = None) -> None:
    kept = value if allowed is None else value[value != allowed]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= high):
        also = f" (or {allowed})" if allowed is not None else ""
        raise ValueError(
            f"`{name}` holds values outside [0, {high}){also}: min {int(kept.min())}, max {int(kept.max())}. Check "
            "that the tokenizer belongs to this model."
        )


def _same_shape(name: str, value: torch.Tensor, want: tuple, what: str) -> None:
    if tuple(value.shape) != want:
        raise ValueError(f"`{name}` must have shape {list(want)} ({what}), got {_shape(value)}.")


def check_ids(name: str, ids, vocab: int) -> torch.Tensor:
    ids = _tensor(name, ids)
    _integers(name, ids)
    _rows_and_tokens(name, ids)
    _in_range(name, ids, vocab)
    return ids


def check_embeds(embeds, embedding: nn.Embedding) -> torch.Tensor:
    embeds = _tensor("inputs_embeds", embeds)
    if not embeds.is_floating_point():
        raise ValueError(f"`inputs_embeds` must be floating point, got {_shape(embeds)}. Pass embeddings, not ids.")
    _rows_and_tokens("inputs_embeds", embeds, dims=3)
    width, dtype = embedding.embedding_dim, embedding.weight.dtype
    if embeds.shape[-1] != width:
        raise ValueError(f"`inputs_embeds` must end in the hidden size {width}, got {_shape(embeds)}.")
    if embeds.dtype != dtype:
        raise ValueError(f"`inputs_embeds` must be {dtype} like the model's embeddings, got {_shape(embeds)}.")
    return embeds


def check_mask(mask, batch: int, length: int) -> None:
    if mask is None:
        return
    mask = _tensor("attention_mask", mask)
    _same_shape("attention_mask", mask, (batch, length), "one entry per token")
    if mask.is_complex() or bool(((mask != 0) & (mask != 1)).any()):
        odd = mask[(mask != 0) & (mask != 1)].unique()[:5].tolist()
        raise ValueError(
            f"`attention_mask` must hold only 0 (padding) and 1 (a real token), got values {odd}. Soft or scaled "
            "masks can't be combined with a soft prompt; pass a binary mask."
        )
    if not bool(mask.bool().any(dim=1).all()):
        empty = (~mask.bool().any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"`attention_mask` has no real token in row(s) {empty[:5]}. Drop empty rows from the batch.")


def check_labels(labels, batch: int, length: int, model: nn.Module, token_labels: bool) -> None:
    if labels is None:
        return
    labels = _tensor("labels", labels)
    if token_labels:  # CAUSAL_LM: one target id (or -100) per token
        _integers("labels", labels)
        _same_shape("labels", labels, (batch, length), "one label per input token, -100 to skip one")
        _in_range("labels", labels, model.config.vocab_size, allowed=semantics.IGNORE_INDEX)
        return
    if labels.shape[:1] != (batch,):
        raise ValueError(f"`labels` must have one entry per row ({batch}), got {_shape(labels)}.")
    if not labels.is_floating_point():
        _in_range("labels", labels, getattr(model.config, "num_labels", 2))


def check_forward(
    model: nn.Module, input_ids, inputs_embeds, attention_mask, labels, kwargs: dict, token_labels: bool
):
    """Every input of a prompted forward; returns `[B, L]` as (batch, length)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(
            "Pass exactly one of `input_ids` and `inputs_embeds` to a soft-prompted model, got "
            f"input_ids={'a tensor' if input_ids is not None else None}, "
            f"inputs_embeds={'a tensor' if inputs_embeds is not None else None}."
        )
    embedding = model.get_input_embeddings()
    if input_ids is not None:
        text = check_ids("input_ids", input_ids, embedding.num_embeddings)
    else:
        text = check_embeds(inputs_embeds, embedding)
    batch, length = text.shape[0], text.shape[1]
    check_mask(attention_mask, batch, length)
    check_labels(labels, batch, length, model, token_labels)
    if kwargs.get("token_type_ids") is not None:
        types = check_ids("token_type_ids", kwargs["token_type_ids"], embedding.num_embeddings)
        _same_shape("token_type_ids", types, (batch, length), "one type per token")
    refuse_owned(
        kwargs,
        "a soft-prompted forward",
        "for incremental decoding use `model.generate()`; with TRL, turn off `packing` and `padding_free` (one prompt "
        "can't sit in front of each packed document)",
    )
    return batch, length


OWNED = ("cache", "past_key_values", "position_ids")  # what the prompt owns: positions 0..N-1 and the cache


def refuse_owned(kwargs: dict, where: str, advice: str) -> None:
    for key in OWNED:
        if kwargs.get(key) is not None:
            raise ValueError(
                f"`{key}` can't be passed to {where}, got a {type(kwargs[key]).__name__}: the prompt owns positions "
                f"0..N-1 and the cache. Positions come from `attention_mask`; {advice}."
            )


def new_tokens(model: nn.Module, length: int, kwargs: dict) -> int:
    """How many tokens `generate` may add, as it resolves them: max_new_tokens, else max_length, else the config."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    settings = vars(config) if config is not None else {}
    if settings.get("max_length") == 20:  # transformers' default, which it reads as "20 new tokens"
        settings = {**settings, "max_length": None}
    for source in (kwargs, settings):
        if source.get("max_new_tokens") is not None:
            return int(source["max_new_tokens"])
        if source.get("max_length") is not None:
            return max(int(source["max_length"]) - length, 0)
    return 20


def check_generate_fits(model: nn.Module, num_prompt: int, length: int, kwargs: dict) -> None:
    limit = semantics.max_positions(model.config)
    total = num_prompt + length + new_tokens(model, length, kwargs)
    if limit is not None and total > limit:
        raise ValueError(
            f"`generate` would need {total} positions: the prompt (num_virtual_tokens N={num_prompt}) + the input "
            f"(L={length}) + the new tokens ({total - num_prompt - length}), but the model has {limit}. Lower "
            f"`max_new_tokens` to at most {max(limit - num_prompt - length, 0)} or shorten the input."
        )


def _check_modules_to_save(model: nn.Module, wanted, task) -> None:
    """Each name must match a module as PEFT matches them (the full name or its last parts)."""
    names = [n for n, _ in model.named_modules() if n]
    for entry in set(wanted or ()) - set(task.head_copies):
        if not any(n == entry or n.endswith("." + entry) for n in names):
            close = difflib.get_close_matches(entry, sorted({n.rsplit(".", 1)[-1] for n in names} | set(names)), n=3)
            raise ValueError(
                f"`modules_to_save` names {entry!r}, which matches no module of {type(model).__name__}"
                f"{f'; did you mean {close}?' if close else '.'} List module names from `model.named_modules()`."
            )


def check_placed_room(model: nn.Module, prefix: int, num_virtual: int, suffix: int) -> None:
    """With a hard prefix and suffix, the whole prompt must still leave room for text (checked once they are ids)."""
    limit, length = semantics.max_positions(getattr(model, "config", None)), prefix + num_virtual + suffix
    if limit is not None and length >= limit:
        raise ValueError(
            f"The prompt takes {length} positions (prompt_prefix_ids {prefix} + num_virtual_tokens {num_virtual} + "
            f"prompt_suffix_ids {suffix}), which leaves no room for text: {type(model).__name__} has {limit} "
            "positions. Use fewer virtual tokens or a shorter prefix or suffix."
        )


def check_attach(model: nn.Module, config, task) -> None:
    """The model and config of an attach, checked before anything is allocated."""
    limit = semantics.max_positions(getattr(model, "config", None))
    # None (the demonstrations' positions) is resolved and checked with them (method/demonstrations.py).
    if limit is not None and config.num_virtual_tokens is not None and config.num_virtual_tokens >= limit:
        raise ValueError(
            f"`num_virtual_tokens`={config.num_virtual_tokens} leaves no room for text: {type(model).__name__} "
            f"has {limit} positions. Use fewer virtual tokens (the prompt and the longest text must fit in "
            f"{limit})."
        )
    _check_modules_to_save(model, config.modules_to_save, task)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, nn.Embedding):
        raise ValueError(
            f"SoftPromptPlusConfig needs a model whose `get_input_embeddings()` is an nn.Embedding, got "
            f"{type(model).__name__} with {type(embedding).__name__}. Use a transformers decoder model (the README "
            "lists the tested families)."
        )
    if not hasattr(model, task.head):
        raise ValueError(
            f"`task_type`={task_name(config.task_type)!r} needs a model with `.{task.head}`, got "
            f"{type(model).__name__}. Load the base with {task.auto_class}."
        )


def kv_refused(model: nn.Module, config, layout) -> Optional[str]:
    """Why `model` can't read a KV prompt (`prompt_level='kv'`), or None."""
    name = type(model).__name__
    if layout is None:
        return (
            f"`prompt_level`='kv' needs a model whose attention layers read keys/values through transformers' "
            f"attention registry, and {name} ({getattr(model.config, 'model_type', '?')}) computes attention outside "
            "it (Bloom and Falcon do): its prompt can only be concatenated in front of the text. Use "
            "prompt_level='input' for this family."
        )
    why = layout.why_not()
    if why:
        return f"`prompt_level`='kv' can't be stored for {name}: {why}. Use prompt_level='input'."
    return window_refused(model, config.kv_text_start, config.num_virtual_tokens)


def window_refused(model: nn.Module, start: Optional[int], n: int) -> Optional[str]:
    """Why N stored keys read with the text at `start` can't be exact on `model`, or None: a sliding window
    measures a prompt key's distance by its index among the N, which is its position only when `start` is N."""
    if start is None or start == n:  # the common case, on every forward: no window read
        return None
    window = smallest_window(getattr(model, "config", None))
    if not window:
        return None
    return (
        f"`kv_text_start`={start} with num_virtual_tokens={n} on {type(model).__name__}, whose layers have a sliding "
        f"window ({window}): the window measures each key's distance from the text, and keys kept at their own "
        "positions in a longer text have no single distance. Use kv_text_start=None (N) on this model."
    )


def check_kv_room(model: nn.Module, config) -> None:
    """A KV prompt's text start must leave room for text."""
    limit = semantics.max_positions(getattr(model, "config", None))
    if limit is not None and config.kv_text_start >= limit:
        raise ValueError(
            f"`kv_text_start`={config.kv_text_start} leaves no room for text: {type(model).__name__} has {limit} "
            "positions. Use fewer virtual tokens, or a smaller kv_text_start."
        )
