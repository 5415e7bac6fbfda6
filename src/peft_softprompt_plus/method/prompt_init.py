"""Initial prompt values, one strategy per `prompt_init` mode; every strategy returns a fresh float32 `[N, D]`
tensor that shares no storage with the model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from torch import nn

from .enums import PromptInit

Config = Any  # a SoftPromptPlusConfig (its checks import this module through placement)

_STAT_CHUNK_ROWS = 4096
FREQUENT = 5000  # Lester et al. draw from the 5,000 most common tokens; BPE and SentencePiece ids follow frequency


def _generator(seed: Optional[int], device: torch.device) -> Optional[torch.Generator]:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def _rows(embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    # The module, not its weight rows: Gemma's embedding scales its rows by sqrt(D) inside `forward`, and the prompt
    # must look like what text tokens become. `.float().clone()`: never a view of `wte`.
    return embedding(ids.to(embedding.weight.device)).float().clone()  # [N, D]


@torch.no_grad()
def embedding_stats(embedding: nn.Embedding) -> tuple[float, float]:
    """Mean and std of what the embedding module outputs over the whole vocabulary, in float64 chunks, so a
    low-precision `wte` is never copied whole."""
    total, total_sq, count = 0.0, 0.0, 0
    device = embedding.weight.device
    for start in range(0, embedding.num_embeddings, _STAT_CHUNK_ROWS):
        ids = torch.arange(start, min(start + _STAT_CHUNK_ROWS, embedding.num_embeddings), device=device)
        chunk = embedding(ids).double()
        total += chunk.sum().item()
        total_sq += chunk.square().sum().item()
        count += chunk.numel()
    mean = total / count
    return mean, max(total_sq / count - mean * mean, 0.0) ** 0.5


def _random(config: Config, embedding: nn.Embedding, model_config) -> torch.Tensor:
    # PEFT's N(0, 1) is ~50x GPT-2's embedding scale; matching wte's statistics keeps the prompt on-manifold.
    n, dim = config.num_virtual_tokens, embedding.embedding_dim
    mean, std = embedding_stats(embedding)
    device = embedding.weight.device
    noise = torch.randn(n, dim, generator=_generator(config.init_seed, device), device=device, dtype=torch.float32)
    return noise * std + mean  # [N, D]


def _special_token_ids(model_config) -> set[int]:
    ids = set()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "unk_token_id"):
        value = getattr(model_config, attr, None)
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return {i for i in ids if isinstance(i, int)}


def _vocab(config: Config, embedding: nn.Embedding, model_config) -> torch.Tensor:
    # The default init: one boolean mask, not a Python pass over a vocabulary that may hold 256k ids.
    keep = torch.ones(embedding.num_embeddings, dtype=torch.bool)
    keep[[i for i in _special_token_ids(model_config) if 0 <= i < embedding.num_embeddings]] = False
    allowed = keep.nonzero().squeeze(1)  # [V'] ascending, as before
    if allowed.numel() == 0:
        raise ValueError(
            f"`prompt_init='vocab'` found no non-special token in a vocabulary of {embedding.num_embeddings}. "
            "Use `prompt_init='random'`."
        )
    pick = torch.randint(allowed.numel(), (config.num_virtual_tokens,), generator=_generator(config.init_seed, "cpu"))
    return _rows(embedding, allowed[pick])


def load_tokenizer(config: Config, purpose: Optional[str] = None):
    """The tokenizer at `tokenizer_name_or_path`, or an error naming what needed it (`purpose`)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(config.tokenizer_name_or_path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"`tokenizer_name_or_path`={config.tokenizer_name_or_path!r} could not be loaded for "
            f"{purpose or f'`prompt_init={str(config.prompt_init)!r}`'}: {err}. Pass a local tokenizer directory."
        ) from err


def _check_ids(config: Config, ids: list[int], embedding: nn.Embedding) -> None:
    too_big = [i for i in ids if i >= embedding.num_embeddings]
    if too_big:
        raise ValueError(
            f"`tokenizer_name_or_path`={config.tokenizer_name_or_path!r} produced token ids {too_big[:5]} outside "
            f"the model's vocabulary of {embedding.num_embeddings}: the tokenizer does not belong to this model."
        )


def _text(config: Config, embedding: nn.Embedding, model_config) -> torch.Tensor:
    ids = load_tokenizer(config)(config.prompt_init_text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"`prompt_init_text`={config.prompt_init_text!r} tokenizes to no tokens.")
    _check_ids(config, ids, embedding)
    n = config.num_virtual_tokens
    tiled = (ids * (n // len(ids) + 1))[:n]
    return _rows(embedding, torch.tensor(tiled, dtype=torch.long))


def _labels(config: Config, embedding: nn.Embedding, model_config) -> torch.Tensor:
    """One row per label word (its sub-tokens' mean embedding), then rows of frequent tokens (Lester et al.)."""
    tokenizer = load_tokenizer(config)
    n = config.num_virtual_tokens
    words = list(config.prompt_init_labels)[:n]
    rows = []
    for word in words:
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"`prompt_init_labels` holds {word!r}, which the tokenizer encodes to no tokens.")
        _check_ids(config, ids, embedding)
        rows.append(_rows(embedding, torch.tensor(ids, dtype=torch.long)).mean(dim=0))  # [D]
    special = _special_token_ids(model_config) | set(getattr(tokenizer, "all_special_ids", []))
    frequent = [i for i in range(min(embedding.num_embeddings, FREQUENT + len(special))) if i not in special]
    missing, generator = n - len(words), _generator(config.init_seed, "cpu")
    if missing <= len(frequent):  # distinct tokens where the vocabulary has enough
        pick = torch.randperm(len(frequent), generator=generator)[:missing]
    else:
        pick = torch.randint(len(frequent), (missing,), generator=generator)
    fill = _rows(embedding, torch.tensor(frequent, dtype=torch.long)[pick]) if len(pick) else None
    return torch.cat([torch.stack(rows), *([fill] if fill is not None else [])])  # [N, D]


def _adapter(config: Config, embedding: nn.Embedding, model_config) -> torch.Tensor:
    """The soft rows of a saved adapter (transfer, SPoT-style); a longer N draws its extra rows as `vocab` does."""
    from ..files import reading

    folder = config.prompt_init_adapter
    try:
        saved, values = reading.read_adapter_values(folder)
    except reading.AdapterFileError as err:
        raise ValueError(f"`prompt_init_adapter`={folder!r} can't start this prompt: {err}") from err
    if reading.is_kv(saved):
        raise ValueError(
            f"`prompt_init_adapter`={folder!r} is a KV adapter (prompt_level='kv'): its keys/values can't start an "
            "input prompt, which is made of input vectors. Start a KV prompt from it (prompt_level='kv')."
        )
    if values.shape[1] != embedding.embedding_dim:
        raise ValueError(
            f"`prompt_init_adapter`={folder!r} can't start this prompt: it holds a prompt of hidden size "
            f"{values.shape[1]}, but this base model's is {embedding.embedding_dim}: the adapter was trained on "
            "another base. Start from an adapter of this base."
        )
    n, saved_n = config.num_virtual_tokens, values.shape[0]
    if saved_n > n:
        raise ValueError(
            f"`prompt_init_adapter`={folder!r} holds {saved_n} virtual tokens, more than num_virtual_tokens={n}; "
            f"which of its rows to drop is not ours to guess. Pass num_virtual_tokens >= {saved_n}."
        )
    values = values.to(embedding.weight.device)
    if saved_n == n:
        return values.clone()  # [N, D]
    rest = SimpleNamespace(num_virtual_tokens=n - saved_n, init_seed=config.init_seed)
    extra = _vocab(rest, embedding, model_config)  # [N - N_saved, D]
    return torch.cat([values, extra.to(values.device)])  # [N, D]


def placeholder(config: Config, embedding: nn.Embedding, model_config=None) -> torch.Tensor:
    """`[N, D]` values for an adapter being loaded, which the load overwrites: seeded noise at a word embedding's
    scale, read by nothing but an attach probe."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(config.num_virtual_tokens, embedding.embedding_dim, generator=generator) * 0.02


INIT_STRATEGIES: dict[str, Callable[[Config, nn.Embedding, object], torch.Tensor]] = {
    PromptInit.RANDOM.value: _random,
    PromptInit.VOCAB.value: _vocab,
    PromptInit.TEXT.value: _text,
    PromptInit.LABELS.value: _labels,
    PromptInit.ADAPTER.value: _adapter,
}


def initial_prompt(config: Config, embedding: nn.Embedding, model_config) -> torch.Tensor:
    """Return the starting `[N, D]` float32 values for `config` on the model whose input embedding is `embedding`."""
    return INIT_STRATEGIES[config.prompt_init](config, embedding, model_config)
