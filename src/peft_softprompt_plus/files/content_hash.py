"""An adapter's content hash: its saved tensors and the config fields that change what it computes. The file a KV
prompt is published as (serve/share.py) is this hash, and the serving front's secret `cache_salt` derives from
it (serve/salts.py), so equal adapters share them and a changed one never does."""

from __future__ import annotations

import hashlib
import json

import torch

VERSION = "peft-softprompt-plus adapter content 1"  # changes only with the definition below

# Saved config fields that change nothing an adapter computes once saved: where it came from, how its prompt started
# (the text a prefix/suffix was tokenized from: the ids count), how it was trained and checked, and which path the
# forward takes (every path computes the concatenation reference). Every other field counts, so a field added later
# changes the hash until it is listed here: two equal adapters told apart cost a cache miss, two different ones told
# equal would share one.
NOT_COMPUTED = frozenset(
    {
        "auto_mapping",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "peft_version",
        "prompt_init",
        "prompt_init_text",
        "prompt_init_labels",
        "prompt_init_adapter",
        "init_seed",
        "prompt_prefix",
        "prompt_suffix",
        "tokenizer_name_or_path",
        "reparameterization",  # the weights file holds the folded table; the encoder beside it resumes training only
        "residual_hidden",
        "residual_layer_norm",
        "kv_frozen_positions",
        "validate_gradients",
        "forward_path",
    }
)


def content_hash(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """32 hex digits of SHA-256 over `VERSION`, a JSON header (keys sorted, no spaces) of the counted `config` fields
    (a saved adapter_config.json's dict) and of each tensor's name, dtype and shape in name order (`tensors`: the
    weights file's, by their saved keys), then each tensor's bytes in that order (CPU, contiguous)."""
    counted = {key: value for key, value in config.items() if key not in NOT_COMPUTED}
    names = sorted(tensors)
    header = {
        "config": counted,
        "tensors": [[name, str(tensors[name].dtype), list(tensors[name].shape)] for name in names],
    }
    digest = hashlib.sha256(f"{VERSION}\n".encode())
    digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for name in names:
        flat = tensors[name].detach().cpu().contiguous().reshape(-1)  # [numel]
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]
