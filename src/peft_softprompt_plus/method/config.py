"""`SoftPromptPlusConfig`: the dataclass a user hands to `get_peft_model`, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional

from peft.config import PeftConfig

from ..integrations.peft_registry import SOFTPROMPT_PLUS
from .tasks import task_of


class _Choice(str, enum.Enum):
    """A string option: compares, prints and serialises as its value."""

    __str__ = str.__str__
    __format__ = str.__format__


class PromptInit(_Choice):
    """How the prompt's `[N, D]` values are first filled (see `prompt_init.py`)."""

    RANDOM = "random"
    VOCAB = "vocab"
    TEXT = "text"
    LABELS = "labels"


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


@dataclass
class SoftPromptPlusConfig(PeftConfig):
    """Configuration of a soft prompt for a transformers decoder model (tested on GPT-2, GPT-J, GPT-NeoX, OPT, Bloom,
    Falcon, Llama, Mistral, Qwen2, Phi-3 and Gemma-2).

    The prompt enters at the attention: its keys/values, computed in a pass of their own, are handed to every
    attention layer. Families whose attention runs outside transformers' attention registry (Bloom, Falcon), and
    `forward_path='concat'`, concatenate it in front of the text's embeddings instead (see `forward/paths.py`).

    Exact semantics: the prompt takes positions `0..N-1`, text positions continue from `N` counting only real
    tokens, and the returned logits have the base model's shape `[B, L, V]`.
    """

    num_virtual_tokens: int = field(
        default=20, metadata={"help": "N, the number of virtual (soft prompt) tokens placed before the text."}
    )
    prompt_init: PromptInit = field(
        default=PromptInit.VOCAB,
        metadata={
            "help": "`random`: normal noise scaled to the statistics of the model's word embeddings; `vocab`: rows "
            "of the embedding matrix of randomly drawn non-special tokens; `text`: rows of the tokenized "
            "`prompt_init_text`, tiled or truncated to N; `labels`: one row per word of `prompt_init_labels` (the "
            "mean of its sub-tokens' embeddings), the remaining rows drawn from the vocabulary's first "
            "(most frequent) tokens (Lester et al., 2021). Default `vocab`: docs/training-recipe.md."
        },
    )
    prompt_init_text: Optional[str] = field(
        default=None,
        metadata={"help": "The text whose token embeddings initialize the prompt (`prompt_init='text'`)."},
    )
    prompt_init_labels: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "The label words (class names, answers) whose embeddings start the prompt (`prompt_init="
            "'labels'`); tokenized as given, so include the leading space your text has (' positive'). Words past N "
            "are not used."
        },
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Tokenizer used to tokenize `prompt_init_text` or `prompt_init_labels` (local path or Hub id; "
            "`prompt_init='text'` or `'labels'`)."
        },
    )
    init_seed: Optional[int] = field(
        default=None,
        metadata={
            "help": "Seed for `random` and `vocab` init and for the rows `labels` fills past its words; None draws "
            "from torch's global generator."
        },
    )
    reparameterization: Reparameterization = field(
        default=Reparameterization.NONE,
        metadata={
            "help": "`none`: the prompt is trained directly. `residual`: Residual Prompt Tuning (Razdaibiedina et "
            "al., 2023): every prompt row goes through one shared MLP with a skip connection while training, "
            "`P + LayerNorm(up(relu(down(P))))`; `save_pretrained` writes the folded `[N, D]` table as the adapter "
            "(so every loader and serving engine sees a plain prompt) and the encoder beside it, so training resumes."
        },
    )
    residual_hidden: int = field(
        default=400, metadata={"help": "The residual encoder's bottleneck width m (`reparameterization='residual'`)."}
    )
    residual_layer_norm: bool = field(
        default=True,
        metadata={"help": "Whether the residual branch ends in a LayerNorm (`reparameterization='residual'`)."},
    )
    validate_gradients: ValidateGradients = field(
        default=ValidateGradients.RAISE,
        metadata={
            "help": "At attach time, prove that gradients reach the prompt: `raise` a GradientFlowError, `warn`, or "
            "`off`."
        },
    )
    forward_path: ForwardPath = field(
        default=ForwardPath.AUTO,
        metadata={
            "help": "`shared_kv` runs the prompt once per forward and hands its keys/values to every attention "
            "layer (gradient checkpointing on or off); `concat` concatenates the prompt to every row; `auto` takes "
            "shared_kv where the model's attention runs through transformers' attention registry, else concat, and "
            "concat for a training step with one prompt on a GPU (faster there: bench/RESULTS.md)."
        },
    )
    chat_format: Optional[str] = field(
        default=None,
        metadata={
            "help": "How this adapter's chat inputs were formatted in training, for a server that formats messages "
            "(`softprompt-plus serve`): `template`, the tokenizer's chat template as is; `student`, the template "
            "without the default system prompt some templates insert (what `distill_prompt` trains: "
            "`student_inputs`). None: not recorded, served as `template`."
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
        if self.task_type is None:
            # PEFT wraps a config without a task type in a bare PeftModel, whose forward calls the base model
            # directly: the prompt would be silently ignored. No task type means a causal LM here.
            self.task_type = "CAUSAL_LM"
        # Every check runs; the error lists every bad field, so one never hides another.
        problems = [problem for check in _CHECKS if (problem := check(self))]
        if len(problems) == 1:
            raise ValueError(problems[0])
        if problems:
            raise ValueError(f"SoftPromptPlusConfig has {len(problems)} problems:\n- " + "\n- ".join(problems))
        for name, choice in _CHOICES.items():
            setattr(self, name, choice(getattr(self, name)))  # the enum member (a str)


_CHOICES = {
    "prompt_init": PromptInit,
    "reparameterization": Reparameterization,
    "validate_gradients": ValidateGradients,
    "forward_path": ForwardPath,
}


def _choice(name: str) -> Callable[[SoftPromptPlusConfig], Optional[str]]:
    def check(config: SoftPromptPlusConfig) -> Optional[str]:
        value, allowed = getattr(config, name), [m.value for m in _CHOICES[name]]
        if value not in allowed:
            return f"`{name}` must be one of {allowed}, got {value!r}."
        return None

    return check


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _task(c: SoftPromptPlusConfig) -> Optional[str]:
    try:
        task_of(c.task_type)
    except ValueError as err:
        return str(err)
    return None


def _num_virtual_tokens(c: SoftPromptPlusConfig) -> Optional[str]:
    value = c.num_virtual_tokens
    if not _is_int(value) or value < 1:
        return f"`num_virtual_tokens` must be a positive int (>= 1), got {value!r} ({type(value).__name__})."
    return None


def _text_init(c: SoftPromptPlusConfig) -> Optional[str]:
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


def _labels(c: SoftPromptPlusConfig) -> Optional[str]:
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


def _tokenizer(c: SoftPromptPlusConfig) -> Optional[str]:
    needs = c.prompt_init in (PromptInit.TEXT.value, PromptInit.LABELS.value)
    if needs and not c.tokenizer_name_or_path:
        return (
            f"`tokenizer_name_or_path` is needed when `prompt_init={str(c.prompt_init)!r}`, got "
            f"{c.tokenizer_name_or_path!r}. Pass a local tokenizer directory or Hub id."
        )
    return None


def _residual(c: SoftPromptPlusConfig) -> Optional[str]:
    problems = []
    if not _is_int(c.residual_hidden) or c.residual_hidden < 1:
        problems.append(f"`residual_hidden` must be a positive int, got {c.residual_hidden!r}.")
    if not isinstance(c.residual_layer_norm, bool):
        problems.append(f"`residual_layer_norm` must be True or False, got {c.residual_layer_norm!r}.")
    return " ".join(problems) or None


def _init_seed(c: SoftPromptPlusConfig) -> Optional[str]:
    if c.init_seed is not None and not _is_int(c.init_seed):
        return f"`init_seed` must be an int or None, got {c.init_seed!r}."
    return None


def _modules_to_save(c: SoftPromptPlusConfig) -> Optional[str]:
    names = c.modules_to_save
    if names is not None and not (isinstance(names, list) and all(isinstance(m, str) for m in names)):
        return f"`modules_to_save` must be a list of module names or None, got {names!r}."
    return None


CHAT_FORMATS = ("template", "student")


def _chat_format(config: SoftPromptPlusConfig) -> Optional[str]:
    if config.chat_format is not None and config.chat_format not in CHAT_FORMATS:
        return f"`chat_format` must be one of {list(CHAT_FORMATS)} or None, got {config.chat_format!r}."
    return None


_CHECKS: tuple[Callable[[SoftPromptPlusConfig], Optional[str]], ...] = (
    _task,
    _num_virtual_tokens,
    *(_choice(name) for name in _CHOICES),
    _text_init,
    _labels,
    _tokenizer,
    _residual,
    _init_seed,
    _modules_to_save,
    _chat_format,
)
