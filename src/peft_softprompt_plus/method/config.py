"""`SoftPromptPlusConfig`: the dataclass a user hands to `get_peft_model`, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from peft.config import PeftConfig
from peft.utils import PeftType

from .._names import METHOD
from .config_checks import CHECKS, CHOICES, KV_FROZEN_DEFAULT, is_kv
from .enums import ForwardPath, KVSelection, PromptInit, PromptLevel, Reparameterization, ValidateGradients

__all__ = [
    "ForwardPath",
    "KVSelection",
    "PromptInit",
    "PromptLevel",
    "Reparameterization",
    "SoftPromptPlusConfig",
    "ValidateGradients",
]


@dataclass
class SoftPromptPlusConfig(PeftConfig):
    """Configuration of a soft prompt for a transformers decoder model (tested on GPT-2, GPT-J, GPT-NeoX, OPT, Bloom,
    Falcon, Llama, Mistral, Qwen2, Phi-3 and Gemma-2).

    The prompt enters at the attention: its keys/values, computed in a pass of their own, are handed to every
    attention layer. Families whose attention runs outside transformers' attention registry (Bloom, Falcon), and
    `forward_path='concat'`, concatenate it in front of the text's embeddings instead (see `forward/paths.py`).

    Exact semantics: the prompt (hard prefix, N soft tokens, hard suffix: P+N+S positions) takes positions
    `0..P+N+S-1`, text positions continue from there counting only real tokens, and the returned logits have the base
    model's shape `[B, L, V]`.
    """

    num_virtual_tokens: Optional[int] = field(
        default=20,
        metadata={
            "help": "N, the number of virtual (soft prompt) tokens placed before the text. None only with "
            "`prompt_init='demonstrations'`: all of their positions, resolved at attach and saved as a number."
        },
    )
    prompt_level: PromptLevel = field(
        default=PromptLevel.INPUT,
        metadata={
            "help": "What is trained. `input`: N vectors in front of the text's embeddings, whose keys/values every "
            "layer computes in a prompt pass. `kv`: every attention layer's keys and values for N positions "
            "(per key/value head, float32, as the attention reads them), trained directly: no prompt pass, more "
            "capacity, read only at the attention (docs/concepts.md). `prompt_init` keeps its meaning: the input "
            "prompt it names, run once through the frozen model. A `kv` prompt predicts no text token 0 (the loss "
            "runs over labels 1..), takes no hard prefix or suffix of its own and no reparameterization, and families "
            "whose attention runs outside transformers' attention registry (Bloom, Falcon) refuse it."
        },
    )
    kv_frozen_positions: Optional[int] = field(
        default=None,
        metadata={
            "help": "`prompt_level='kv'`: how many leading positions stay frozen (1: the attention sink, as in PEFT's "
            "CARTRIDGE and Cartridges). None: 0, every position trained, as PEFT PREFIX_TUNING (measured ahead on the "
            "task suite). Must leave at least one position to train."
        },
    )
    kv_text_start: Optional[int] = field(
        default=None,
        metadata={
            "help": "`prompt_level='kv'`: the position the text's first token takes (>= N). None: N, or a lifted KV "
            "adapter's own; filled at attach and saved. Larger when the N keys were selected from a longer text and "
            "keep their own positions."
        },
    )
    kv_base: Optional[dict] = field(
        default=None,
        metadata={
            "help": "`prompt_level='kv'`: what the stored keys depend on (the model type, layers, key/value heads, "
            "head size and rotary settings), recorded at attach and saved; a base that differs is refused."
        },
    )
    prompt_init: PromptInit = field(
        default=PromptInit.VOCAB,
        metadata={
            "help": "`random`: normal noise scaled to the statistics of the model's word embeddings; `vocab`: rows "
            "of the embedding matrix of randomly drawn non-special tokens; `text`: rows of the tokenized "
            "`prompt_init_text`, tiled or truncated to N; `labels`: one row per word of `prompt_init_labels` (the "
            "mean of its sub-tokens' embeddings), the remaining rows drawn from the vocabulary's first "
            "(most frequent) tokens (Lester et al., 2021); `adapter`: the prompt of the saved adapter in "
            "`prompt_init_adapter` (transfer; a longer N fills its extra rows as `vocab` does). Default `vocab`: "
            "docs/training-recipe.md."
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
    prompt_init_adapter: Optional[str] = field(
        default=None,
        metadata={
            "help": "A folder written by `save_pretrained` whose prompt starts this one (`prompt_init='adapter'`): "
            "same base model's hidden size, at most N virtual tokens. Only its soft rows are copied; this config's "
            "own prefix and suffix apply."
        },
    )
    prompt_init_texts: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "The demonstrations (`prompt_init='demonstrations'`, `prompt_level='kv'`): training rows "
            "written as the model reads them. Each is tokenized alone (no BOS), each followed by "
            "`demonstration_separator`, the whole context run once through the frozen model; its keys/values are "
            "the start, every kept position where it was computed (`kv_text_start` = the context's length). Pick "
            "them with `pick_demonstrations`."
        },
    )
    demonstration_separator: str = field(
        default="\n",
        metadata={"help": "The text after each demonstration in the context (`prompt_init='demonstrations'`)."},
    )
    demonstration_ids: Optional[list[list[int]]] = field(
        default=None,
        metadata={
            "help": "Each demonstration's token ids, filled at attach and saved: a training row whose real ids equal "
            "one of them is that demonstration (leave-one-out)."
        },
    )
    demonstration_spans: Optional[list[list[int]]] = field(
        default=None,
        metadata={
            "help": "Each demonstration's `[start, end)`, filled at attach and saved (the separators and a BOS "
            "belong to none): among the prompt's N positions with `kv_selection='shared'`, among the context's "
            "positions with 'per_head' (each kept entry's origin, saved in the weights, is a context position). "
            "Loading needs nothing else."
        },
    )
    kv_selection: str = field(
        default="shared",
        metadata={
            "help": "`prompt_init='demonstrations'` with N below the context's positions: which N are kept. "
            "'shared': the N whole positions the demonstrations, each read after the context, attend to most, the "
            "same in every layer and key/value head. 'per_head': each layer's and key/value head's own N most "
            "attended, as a KV student's `selected` start keeps them; each entry's origin (its context position, "
            "`[layers, Hkv, N]`) is saved in the weights, and leave-one-out and dropout act per entry."
        },
    )
    kv_leave_one_out: bool = field(
        default=True,
        metadata={
            "help": "`prompt_init='demonstrations'`: while training, a row that is demonstration i (its ids equal "
            "`demonstration_ids[i]`, or a `demonstration_index` column names i) reads none of i's positions (with "
            "`kv_selection='per_head'`: no entry whose origin lies in i's span, in any layer and head); frozen "
            "positions stay read. Eval and `generate` read every position."
        },
    )
    kv_position_dropout: float = field(
        default=0.0,
        metadata={
            "help": "`prompt_level='kv'`: while training (training mode, gradients on), each prompt position is "
            "dropped for each row with this probability (each entry, per layer and key/value head, with "
            "`kv_selection='per_head'`); frozen positions never are. 0: off."
        },
    )
    prompt_prefix: Optional[str] = field(
        default=None,
        metadata={
            "help": "Fixed text before the soft tokens (e.g. a chat template's system header), tokenized once at "
            "attach with `tokenizer_name_or_path` and stored as `prompt_prefix_ids`. Frozen; it runs in the same "
            "prompt pass as the soft tokens."
        },
    )
    prompt_suffix: Optional[str] = field(
        default=None,
        metadata={"help": "Fixed text after the soft tokens (e.g. the system turn's end), as `prompt_prefix`."},
    )
    prompt_prefix_ids: Optional[list[int]] = field(
        default=None,
        metadata={
            "help": "The token ids before the soft tokens (e.g. `[tokenizer.bos_token_id]`); filled from "
            "`prompt_prefix` at attach and saved, so loading needs no tokenizer."
        },
    )
    prompt_suffix_ids: Optional[list[int]] = field(
        default=None, metadata={"help": "The token ids after the soft tokens; filled from `prompt_suffix` at attach."}
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Tokenizer used to tokenize `prompt_init_text`, `prompt_init_labels`, `prompt_prefix` or "
            "`prompt_suffix` (local path or Hub id)."
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
            "concat for a training step (training mode, gradients on) with one input prompt on a GPU (faster there: "
            "bench/RESULTS.md), never for an eval forward, `generate` or a KV prompt."
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
        # The member PEFT's registration added (integrations/peft_registry.py, run by the import hook before any
        # module of this layer loads): read by name, so the config depends on PEFT's public enum alone.
        self.peft_type = PeftType[METHOD]
        if self.task_type is None:
            # PEFT wraps a config without a task type in a bare PeftModel, whose forward calls the base model
            # directly: the prompt would be silently ignored. No task type means a causal LM here.
            self.task_type = "CAUSAL_LM"
        # Every check runs; the error lists every bad field, so one never hides another.
        problems = [problem for check in CHECKS if (problem := check(self))]
        if len(problems) == 1:
            raise ValueError(problems[0])
        if problems:
            raise ValueError(f"SoftPromptPlusConfig has {len(problems)} problems:\n- " + "\n- ".join(problems))
        for name, choice in CHOICES.items():
            setattr(self, name, choice(getattr(self, name)))  # the enum member (a str)
        if is_kv(self) and self.kv_frozen_positions is None:
            # Written into the saved config, so a later change of the default never changes a saved adapter.
            self.kv_frozen_positions = KV_FROZEN_DEFAULT
