"""A tiny, seeded, offline GPT-2 and tokenizer: what the demo, examples and tests run on without the Hub."""

from __future__ import annotations

import os
from typing import Optional

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, PreTrainedTokenizerFast

from ..method.tasks import task_of

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]

# Small on purpose: enough words for the demo task and for tokenizing test sentences.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a soft prompt is a learned sequence of input embeddings",
    "gradients flow from the loss back to the prompt through the frozen model",
    "positive negative review movie film great terrible good bad",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white orange purple",
    "cat dog bird fish horse cow sheep goat",
    "hello world this is a tiny model for tests",
    "answer question label sentiment topic color animal number",
]


# A toy "style" for the examples to learn: colour and animal lists, all in the tiny tokenizer's vocabulary.
SAMPLE_TEXTS = [
    "red green blue yellow black white orange purple",
    "cat dog bird fish horse cow sheep goat",
    "red blue green cat dog bird",
    "white black orange horse cow sheep",
    "yellow purple red goat fish bird",
    "green white blue dog cat horse",
    "orange red black sheep goat cow",
    "purple yellow green fish bird dog",
]


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on an embedded corpus; ids 0/1 are end-of-text and pad."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>"
    )


def tiny_config(vocab_size: int, **overrides) -> GPT2Config:
    kwargs = dict(
        vocab_size=vocab_size,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def _seeded(seed: int, build):
    """`build()` under `seed`, leaving the caller's random state as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build()


def tiny_gpt2(seed: int = 0, task: str = "CAUSAL_LM", vocab_size: Optional[int] = None, **overrides):
    """A seeded random GPT-2 (causal LM or sequence classifier) sized for CPU tests."""
    vocab_size = vocab_size if vocab_size is not None else len(tiny_tokenizer())
    config = tiny_config(vocab_size, **overrides)
    return _seeded(seed, lambda: getattr(transformers, task_of(task).auto_class).from_config(config).eval())


def save_tiny(path: str, seed: int = 0, **overrides) -> str:
    """Write a tiny GPT-2 + tokenizer to `path` so `from_pretrained(path)` works offline."""
    tokenizer = tiny_tokenizer()
    model = tiny_gpt2(seed=seed, vocab_size=len(tokenizer), **overrides)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# One tiny, dropout-free config per decoder family the library is tested on (`tests/forward/test_families.py`). Sliding
# windows (8) are shorter than the test sequences, so a prompt can fall out of a layer's window.
_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=1)
_LLAMA_LIKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, **_IDS)
FAMILIES: dict[str, tuple[str, dict]] = {  # name -> (config class in transformers, its arguments)
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, **_IDS)),
    "gpt_neox": ("GPTNeoXConfig", _LLAMA_LIKE),
    "opt": (
        "OPTConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            word_embed_proj_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
            **_IDS,
        ),
    ),
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4, **_IDS)),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **_IDS)),
    "llama": ("LlamaConfig", dict(_LLAMA_LIKE, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(_LLAMA_LIKE, num_key_value_heads=2, sliding_window=8)),
    "qwen2": (
        "Qwen2Config",
        dict(_LLAMA_LIKE, num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "phi3": ("Phi3Config", dict(_LLAMA_LIKE, num_key_value_heads=2)),
    "gemma2": (  # soft-capping needs eager attention
        "Gemma2Config",
        dict(_LLAMA_LIKE, num_key_value_heads=2, head_dim=16, sliding_window=8, attn_implementation="eager"),
    ),
}


def tiny_family(name: str, vocab_size: int = 300, seed: int = 0, task: str = "CAUSAL_LM"):
    """A seeded tiny model of family `name` (a key of `FAMILIES`) for `task` (a causal LM by default), in eval mode.
    Sequence classifiers get 3 labels and pad id 1, so they pool each row's last real token."""
    if name not in FAMILIES:
        raise ValueError(f"`name` must be one of {sorted(FAMILIES)}, got {name!r}.")
    config_name, kwargs = FAMILIES[name]
    config = getattr(transformers, config_name)(vocab_size=vocab_size, **{**_TASK_CONFIG.get(task, {}), **kwargs})
    return _seeded(seed, lambda: getattr(transformers, task_of(task).auto_class).from_config(config).eval())


_TASK_CONFIG = {"SEQ_CLS": dict(num_labels=3, pad_token_id=1)}
