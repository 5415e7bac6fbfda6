"""The string options of `SoftPromptPlusConfig`: each compares, prints and serialises as its value."""

from __future__ import annotations

import enum


class _Choice(str, enum.Enum):
    """A string option: compares, prints and serialises as its value."""

    __str__ = str.__str__
    __format__ = str.__format__


class PromptLevel(_Choice):
    """What the trained parameters are (see docs/concepts.md): input vectors in front of the text's embeddings, or
    each attention layer's keys and values for the prompt's positions."""

    INPUT = "input"
    KV = "kv"


class PromptInit(_Choice):
    """How the prompt's `[N, D]` values are first filled (see `prompt_init.py`)."""

    RANDOM = "random"
    VOCAB = "vocab"
    TEXT = "text"
    LABELS = "labels"
    ADAPTER = "adapter"
    DEMONSTRATIONS = "demonstrations"


class KVSelection(_Choice):
    """Which of the demonstrations' cached positions a KV prompt keeps when N is below their count (see
    `kv_select.py`): the same whole positions in every layer and key/value head, or each layer's and head's own."""

    SHARED = "shared"
    PER_HEAD = "per_head"


class Reparameterization(_Choice):
    """How the trained `[N, D]` prompt is produced from its parameters (see `reparam.py`)."""

    NONE = "none"
    RESIDUAL = "residual"


class ValidateGradients(_Choice):
    """What to do when the attach-time probe finds that gradients can't reach the prompt."""

    RAISE = "raise"
    WARN = "warn"
    OFF = "off"


class ForwardPath(_Choice):
    """Which forward computes the prompted model (see `forward/paths.py`)."""

    AUTO = "auto"
    SHARED_KV = "shared_kv"
    CONCAT = "concat"
