"""`SoftPromptPlusConfig`: the dataclass a user hands to `get_peft_model`, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from peft.config import PeftConfig

from ._peft_registry import SOFTPROMPT_PLUS
from .tasks import task_of


class PromptInit(str, enum.Enum):
    """How the prompt's `[N, D]` values are first filled (see `prompt_init.py`)."""

    RANDOM = "random"
    VOCAB = "vocab"
    TEXT = "text"


class ValidateGradients(str, enum.Enum):
    """What to do when the attach-time probe finds that gradients can't reach the prompt."""

    RAISE = "raise"
    WARN = "warn"
    OFF = "off"


class ForwardPath(str, enum.Enum):
    """Which forward computes the prompted model (see `forward_paths.py`)."""

    AUTO = "auto"
    SHARED_KV = "shared_kv"
    CONCAT = "concat"


def _choice(enum_cls: type[enum.Enum], name: str, value) -> str:
    allowed = [m.value for m in enum_cls]
    if isinstance(value, enum.Enum):
        value = value.value
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.")
    return value


@dataclass
class SoftPromptPlusConfig(PeftConfig):
    """Configuration of a soft prompt that enters a GPT-2-style model through `inputs_embeds`.

    Exact semantics: the prompt takes positions `0..N-1`, text positions continue from `N` counting only real
    tokens, and the returned logits have the base model's shape `[B, L, V]`.
    """

    num_virtual_tokens: int = field(
        default=20, metadata={"help": "N, the number of virtual (soft prompt) tokens placed before the text."}
    )
    prompt_init: str = field(
        default=PromptInit.RANDOM.value,
        metadata={
            "help": "`random`: normal noise scaled to the statistics of the model's word embeddings; `vocab`: rows "
            "of the embedding matrix of randomly drawn non-special tokens; `text`: rows of the tokenized "
            "`prompt_init_text`, tiled or truncated to N."
        },
    )
    prompt_init_text: Optional[str] = field(
        default=None,
        metadata={"help": "The text whose token embeddings initialize the prompt (`prompt_init='text'`)."},
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Tokenizer used to tokenize `prompt_init_text` (local path or Hub id; `prompt_init='text'`)."
        },
    )
    init_seed: Optional[int] = field(
        default=None,
        metadata={"help": "Seed for `random` and `vocab` init; None draws from torch's global generator."},
    )
    validate_gradients: str = field(
        default=ValidateGradients.RAISE.value,
        metadata={
            "help": "At attach time, prove that gradients reach the prompt: `raise` a GradientFlowError, `warn`, or "
            "`off`."
        },
    )
    forward_path: str = field(
        default=ForwardPath.AUTO.value,
        metadata={
            "help": "`shared_kv` runs the prompt once per forward and hands its keys/values to every attention "
            "layer (gradient checkpointing on or off); `concat` concatenates the prompt to every row; `auto` takes "
            "shared_kv where the model's attention runs through transformers' attention registry, else concat."
        },
    )
    modules_to_save: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "Extra base modules trained and saved with the prompt (for SEQ_CLS the `score` head is added "
            "automatically). The tied `wte`/`lm_head` pair is refused."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = SOFTPROMPT_PLUS
        self.prompt_init = _choice(PromptInit, "prompt_init", self.prompt_init)
        self.validate_gradients = _choice(ValidateGradients, "validate_gradients", self.validate_gradients)
        self.forward_path = _choice(ForwardPath, "forward_path", self.forward_path)
        # Checks are independent `if`s so that one bad field never hides another's message.
        if self.task_type is not None:
            task_of(self.task_type)
        if isinstance(self.num_virtual_tokens, bool) or not isinstance(self.num_virtual_tokens, int):
            raise ValueError(
                f"`num_virtual_tokens` must be a positive int, got {self.num_virtual_tokens!r} "
                f"({type(self.num_virtual_tokens).__name__})."
            )
        if self.num_virtual_tokens < 1:
            raise ValueError(f"`num_virtual_tokens` must be >= 1, got {self.num_virtual_tokens}.")
        if self.prompt_init == PromptInit.TEXT.value and not self.prompt_init_text:
            raise ValueError(
                f"`prompt_init_text` must be a non-empty string when `prompt_init='text'`, got "
                f"{self.prompt_init_text!r}. Pass the text whose embeddings should start the prompt."
            )
        if self.prompt_init == PromptInit.TEXT.value and not self.tokenizer_name_or_path:
            raise ValueError(
                f"`tokenizer_name_or_path` is needed when `prompt_init='text'`, got {self.tokenizer_name_or_path!r}. "
                "Pass a local tokenizer directory or Hub id."
            )
        if self.prompt_init != PromptInit.TEXT.value and self.prompt_init_text is not None:
            raise ValueError(
                f"`prompt_init_text` is only used with `prompt_init='text'`, got prompt_init={self.prompt_init!r} "
                f"with prompt_init_text={self.prompt_init_text!r}. Set `prompt_init='text'` or drop the text."
            )
        if self.init_seed is not None and (isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int)):
            raise ValueError(f"`init_seed` must be an int or None, got {self.init_seed!r}.")
        if self.modules_to_save is not None and not (
            isinstance(self.modules_to_save, list) and all(isinstance(m, str) for m in self.modules_to_save)
        ):
            raise ValueError(
                f"`modules_to_save` must be a list of module names or None, got {self.modules_to_save!r}."
            )
