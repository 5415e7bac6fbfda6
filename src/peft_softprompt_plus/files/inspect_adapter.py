"""Read a saved soft-prompt adapter without building a model: its config, the prompt's norms, and for each virtual
token of an input prompt the nearest vocabulary tokens (cosine similarity against the base model's input embedding
matrix); a KV prompt, which has no input vectors, gets its norms per position and per layer instead."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import HFValidationError, RemoteEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from .._names import CONFIG_FILE, METHOD, SAVED_ORIGINS_KEY, WEIGHT_FILES
from . import reading


@dataclass
class VirtualToken:
    index: int
    norm: float
    nearest: list[tuple[int, Optional[str], float]] = field(default_factory=list)  # (token id, text, cosine)


@dataclass
class AdapterReport:
    """What `softprompt-plus inspect` prints; `to_dict()` is its `--json` form."""

    adapter: str
    config: dict
    shape: list[int]
    tokens: list[VirtualToken]
    base: Optional[str] = None
    tokenizer: Optional[str] = None
    vocab_mean_norm: Optional[float] = None
    notes: list[str] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)  # a KV prompt's: mean key and value norm per layer
    # A per-head KV prompt's: per layer, how many entries (over its KV heads) came from each demonstration, and from
    # neither (a separator, a BOS)
    origins: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        norms = torch.tensor([t.norm for t in self.tokens])  # [N]
        stats = f"mean {norms.mean():.4f}, min {norms.min():.4f}, max {norms.max():.4f}"
        lines = [f"adapter: {self.adapter}", "config:"]
        lines += [f"  {key}: {json.dumps(value)}" for key, value in sorted(self.config.items())]
        vocab = f"; base vocabulary rows: mean {self.vocab_mean_norm:.4f}" if self.vocab_mean_norm is not None else ""
        kind = " = [layers, 2 (key, value), key/value heads, N, head size]" if self.layers else ""
        per = "position (every layer's keys and values)" if self.layers else "virtual token"
        lines += [
            f"prompt: {self.shape} float32{kind}",
            f"  L2 norm per {per}: {stats}{vocab}",
        ]
        lines += [
            f"  layer {i:>3}: key norm {layer['key']:.4f}, value norm {layer['value']:.4f}"
            for i, layer in enumerate(self.layers)
        ]
        spans = self.config.get("demonstration_spans")
        if spans and self.origins:  # per head: each entry's origin is a context position, saved in the weights
            lines.append(
                f"started from {len(spans)} demonstrations of a {self.config.get('kv_text_start')}-position context, "
                "kept per layer and key/value head; their spans in the context:"
            )
            lines += [f"  demonstration {i}: context positions {span}" for i, span in enumerate(spans)]
            lines.append("  entries per layer (all its key/value heads) from each demonstration, then from neither:")
            lines += [
                f"  layer {i:>3}: {layer['demonstrations']} + {layer['neither']}"
                for i, layer in enumerate(self.origins)
            ]
        elif spans:  # a demonstrations start: which positions each demonstration left (leave-one-out masks them)
            lines.append(f"started from {len(spans)} demonstrations; their spans among the N positions:")
            lines += [f"  demonstration {i}: positions {span}" for i, span in enumerate(spans)]
        if self.base is not None:
            source = f"tokenizer {self.tokenizer}" if self.tokenizer else "no tokenizer found: token ids only"
            lines.append(
                f"nearest vocabulary tokens (cosine similarity to the input embeddings of {self.base}; {source}):"
            )
        for token in self.tokens:
            nearest = "  ".join(
                f"{text!r} {cos:.3f}" if text is not None else f"#{i} {cos:.3f}" for i, text, cos in token.nearest
            )
            lines.append(f"  [{token.index:>3}] norm {token.norm:.4f}  {nearest}".rstrip())
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _not_an_adapter(adapter: str, why: str) -> ValueError:
    return ValueError(
        f"`adapter`={adapter!r} {why}. Pass the folder written by `model.save_pretrained(...)` for a softprompt-plus "
        "adapter, or the Hub repo id it was pushed to."
    )


def _local_or_hub_file(adapter: str, filename: str) -> Optional[str]:
    """Path of `filename` in the adapter folder or Hub repo, or None when the folder/repo has no such file."""
    if os.path.isdir(adapter):
        path = os.path.join(adapter, filename)
        return path if os.path.isfile(path) else None
    try:
        return hf_hub_download(adapter, filename)
    except RemoteEntryNotFoundError:
        return None  # the Hub answered: the repo exists but lacks this file


def _resolve(adapter: str) -> tuple[str, str]:
    """(config path, weights path) for a local folder or a Hub repo id; every failure names `adapter` and a fix."""
    if os.path.isfile(adapter):
        raise _not_an_adapter(adapter, "is a file, not a folder")
    if not os.path.isdir(adapter):
        try:
            validate_repo_id(adapter)
        except HFValidationError as err:
            raise _not_an_adapter(adapter, "is neither an existing folder nor a valid Hub repo id") from err
    try:
        config_path = _local_or_hub_file(adapter, CONFIG_FILE)
        if config_path is None:
            raise _not_an_adapter(adapter, f"has no {CONFIG_FILE}")
        weights_path = next(filter(None, (_local_or_hub_file(adapter, name) for name in WEIGHT_FILES)), None)
    except OSError as err:  # Hub errors, offline mode and unreachable endpoints are all OSErrors here
        raise _not_an_adapter(adapter, f"could not be fetched from the Hub ({type(err).__name__}: {err})") from err
    if weights_path is None:
        raise _not_an_adapter(adapter, f"has {CONFIG_FILE} but no weights ({' or '.join(WEIGHT_FILES)})")
    return config_path, weights_path


def read_adapter(adapter: str) -> tuple[dict, torch.Tensor]:
    """The adapter's config dict and its float32 prompt (`[N, D]`; a KV prompt's `[layers, 2, Hkv, N, hd]`),
    validated as a SOFTPROMPT_PLUS adapter."""
    config_path, weights_path = _resolve(adapter)
    config = reading.read_config(os.path.dirname(config_path))
    if config.get("peft_type") != METHOD:
        raise _not_an_adapter(adapter, f"is a {config.get('peft_type')!r} adapter, not {METHOD}")
    prompt = reading.read_prompt(weights_path, reading.saved_key(config)).float()
    n = config.get("num_virtual_tokens")
    if prompt.dim() != (5 if reading.is_kv(config) else 2) or prompt.shape[-2] != n:
        raise _not_an_adapter(
            adapter, f"has a prompt of shape {list(prompt.shape)}, but its config says num_virtual_tokens={n}"
        )
    return config, prompt


def _local_dirs(*candidates: Optional[str]) -> list[str]:
    return [c for c in candidates if isinstance(c, str) and os.path.isdir(c)]


def _input_embeddings(base: str) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(base)
    return model.get_input_embeddings().weight.detach().float()  # [V, D]


def _tokenizer(sources: list[str], vocab_rows: int, notes: list[str]):
    """The first tokenizer among `sources` that fits a `vocab_rows`-row embedding matrix, as (source, tokenizer)."""
    from transformers import AutoTokenizer

    for source in sources:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            continue
        # transformers 5 builds an empty tokenizer for a folder without tokenizer files; a tokenizer this much
        # smaller than the embedding matrix belongs to another model (padding rows are a few percent at most).
        if 2 * len(tokenizer) < vocab_rows:
            notes.append(
                f"ignored the tokenizer at {source}: {len(tokenizer)} tokens for {vocab_rows} embedding rows."
            )
            continue
        return source, tokenizer
    return None, None


def nearest_tokens(prompt: torch.Tensor, embeddings: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarities and ids of the `top_k` embedding rows nearest to each prompt row: two `[N, k]` tensors."""
    unit = torch.nn.functional.normalize
    sims = unit(prompt, dim=-1) @ unit(embeddings, dim=-1).T  # [N, V]
    return sims.topk(min(top_k, embeddings.shape[0]), dim=-1)


def _origin_counts(origins: torch.Tensor, config: dict) -> list[dict]:
    """Per layer of `origins` (`[layers, Hkv, N]` context positions): its entries from each demonstration's span in
    the context, and from neither."""
    spans = config.get("demonstration_spans") or []
    counts = []
    for layer in origins:
        inside = [int(((layer >= start) & (layer < end)).sum()) for start, end in spans]
        counts.append({"demonstrations": inside, "neither": int(layer.numel()) - sum(inside)})
    return counts


def inspect_adapter(adapter: str, base: Optional[str] = None, top_k: int = 5) -> AdapterReport:
    """Config, prompt norms and nearest vocabulary tokens of the adapter at `adapter` (folder or Hub repo id).

    The base model (for its embedding matrix) is `base`, else the adapter config's `base_model_name_or_path` when
    that is a local folder. The tokenizer comes from the first of those, or `tokenizer_name_or_path`, that has one.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"`top_k` must be a positive int, got {top_k!r}.")
    config, prompt = read_adapter(adapter)
    rows = prompt.movedim(-2, 0).reshape(prompt.shape[-2], -1)  # [N, ...]: one row per position
    report = AdapterReport(
        adapter=adapter,
        config=config,
        shape=list(prompt.shape),
        tokens=[VirtualToken(i, float(norm)) for i, norm in enumerate(rows.norm(dim=-1))],
    )
    bad = int((~torch.isfinite(prompt)).sum())
    if bad:
        report.notes.append(f"the prompt holds {bad} non-finite value(s) (NaN/inf): it can't load into a model.")
    if reading.is_kv(config):
        norms = prompt.norm(dim=-1).mean(dim=(-1, -2))  # [layers, 2]: mean over heads and positions
        report.layers = [{"key": float(k), "value": float(v)} for k, v in norms.tolist()]
        report.notes.append(
            "a KV prompt holds each layer's keys and values, not input vectors: it has no nearest vocabulary tokens."
        )
        if config.get("kv_selection") == "per_head":
            report.origins = _origin_counts(reading.read_prompt(_resolve(adapter)[1], SAVED_ORIGINS_KEY), config)
        return report
    saved_base = config.get("base_model_name_or_path")
    base = base or next(iter(_local_dirs(saved_base)), None)
    if base is None:
        report.notes.append(
            f"no base model to compare with (the adapter config says base_model_name_or_path={saved_base!r}); pass "
            "--base MODEL_DIR to list the nearest vocabulary tokens."
        )
        return report
    embeddings = _input_embeddings(base)
    if embeddings.shape[1] != prompt.shape[1]:
        raise ValueError(
            f"`base`={base!r} has hidden size {embeddings.shape[1]}, but the adapter's prompt is {list(prompt.shape)} "
            f"= [num_virtual_tokens, hidden size]: it was trained on another base model (its config says "
            f"base_model_name_or_path={saved_base!r}). Pass the base model it was trained on."
        )
    report.base = base
    report.vocab_mean_norm = float(embeddings.norm(dim=-1).mean())
    sources = [base] + [d for d in _local_dirs(saved_base, config.get("tokenizer_name_or_path")) if d != base]
    report.tokenizer, tokenizer = _tokenizer(sources, embeddings.shape[0], report.notes)
    if tokenizer is not None and len(tokenizer) <= embeddings.shape[0]:
        embeddings = embeddings[: len(tokenizer)]  # rows past the tokenizer are padding no text can reach
    sims, ids = nearest_tokens(prompt, embeddings, top_k)
    for token, row_sims, row_ids in zip(report.tokens, sims.tolist(), ids.tolist(), strict=True):
        texts = [tokenizer.decode([i]) if tokenizer is not None else None for i in row_ids]
        token.nearest = list(zip(row_ids, texts, row_sims, strict=True))
    return report
