"""Task heads over a prompted batch, one per `task_type`: what runs after the prompt is in place, and how the
outputs are cut back to the base model's shapes."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from peft.utils.other import ModulesToSaveWrapper
from torch import nn
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss, ForSequenceClassificationLoss
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from ..forward import semantics
from ..forward.paths import PromptedBatch
from ..forward.semantics import IGNORE_INDEX

# transformers' Trainer counts `num_items_in_batch` over `labels[..., 1:]` when a model's `loss_type` maps to
# ForCausalLMLoss itself (every `*ForCausalLM` class), and over all labels otherwise (GPT2LMHeadModel). With a prompt
# every label is a target (the last prompt position predicts label 0), so such models get the same loss under a name
# the Trainer does not take for a shifting one; TRL divides by the Trainer's count too.
PROMPTED_CAUSAL_LM_LOSS = "ForSoftPromptedCausalLM"


@functools.wraps(ForCausalLMLoss)
def _prompted_causal_lm_loss(*args, **kwargs):
    return ForCausalLMLoss(*args, **kwargs)


def _count_every_label(model: nn.Module) -> None:
    # A model without a `loss_type` (GPT2LMHeadModel) falls back to ForCausalLMLoss with a warning about a config
    # field the user never set, on the first read of `loss_function` (ours reads it too). Under the alias it computes
    # the same loss, and the Trainer still counts every label: only ForCausalLMLoss itself makes it shift the labels.
    # Registered here, at attach, not at import; it stays registered afterwards (the same loss under another name).
    LOSS_MAPPING.setdefault(PROMPTED_CAUSAL_LM_LOSS, _prompted_causal_lm_loss)
    _count_label_zero(model, True)


def _count_label_zero(model: nn.Module, counted: bool) -> None:
    """The Trainer counts `num_items_in_batch` by the `loss_type` it finds when it is built: every label under the
    alias (an input prompt's last position predicts label 0), labels 1.. under ForCausalLM (a KV prompt has no last
    position). A model whose loss is not transformers' causal-LM loss is left as it is."""
    loss_type = getattr(model, "loss_type", False)
    if loss_type is None or LOSS_MAPPING.get(loss_type) in (ForCausalLMLoss, _prompted_causal_lm_loss):
        model.loss_type = PROMPTED_CAUSAL_LM_LOSS if counted else "ForCausalLM"


def count_label_zero(model: nn.Module, active_configs: list) -> None:
    """After the active adapter changes: whether the Trainer counts label 0 (see `_count_label_zero`)."""
    if active_configs and task_name(active_configs[0].task_type) == "CAUSAL_LM":
        _count_label_zero(model, active_configs[0].prompt_level != "kv")


def _strip(output, in_text: int, length: int):
    """Drop the prompt positions that ran in the text pass, so per-position outputs are base-shaped `[B, L, ...]`."""
    if in_text == 0:
        return output
    logits = getattr(output, "logits", None)
    if logits is not None and logits.dim() == 3 and logits.shape[1] == in_text + length:
        output.logits = logits[:, in_text:]  # [B, L, V]
    hidden = getattr(output, "hidden_states", None)
    if hidden is not None:
        output.hidden_states = tuple(h[:, in_text:] for h in hidden)  # each [B, L, D]
    attentions = getattr(output, "attentions", None)
    if attentions is not None:
        output.attentions = tuple(a[:, :, in_text:] for a in attentions)  # each [B, H, L, N+L]
    return output


# Forward keywords that leave the loss to the model's own `loss_function`. Anything else (TRL's `fused_lm_head`, say)
# may compute the loss or metrics from the labels the model sees, so the last prompt position then rides along.
_PLAIN_KWARGS = frozenset(
    {"num_items_in_batch", "return_dict", "output_attentions", "output_hidden_states", "use_cache", "token_type_ids"}
)
# Without labels, `logits_to_keep` only trims the logits the model returns (the last K text positions).
_UNLABELLED_KWARGS = _PLAIN_KWARGS | {"logits_to_keep"}
_SUM_OVER_ITEMS_LOSSES = (ForCausalLMLoss, _prompted_causal_lm_loss)


def _causal_lm_prompt_in_text(model: nn.Module, labels: Optional[torch.Tensor], kwargs: dict) -> int:
    """0 when the shared pass can also predict text token 0 (its logits are the same for every row), else 1."""
    if not kwargs.keys() <= (_PLAIN_KWARGS if labels is not None else _UNLABELLED_KWARGS):
        return 1
    # The first-token term is added as `sum / num_items_in_batch`, which is ForCausalLMLoss's contract.
    return 0 if labels is None or model.loss_function in _SUM_OVER_ITEMS_LOSSES else 1


def _first_token_term(model: nn.Module, batch: PromptedBatch, labels: torch.Tensor, total) -> torch.Tensor:
    """Each prompted row's last prompt position predicts its text token 0: `[A, V]` logits, once per prompt."""
    rows = batch.row_prompts
    logits = model.get_output_embeddings()(batch.prompt_last)  # [A, V]
    first = rows.per_row(logits, labels.shape[0]).unsqueeze(1)  # [B, 1, V]
    targets = labels[:, :1].masked_fill(~rows.predicts_first(labels.shape[0], labels.device)[:, None], IGNORE_INDEX)
    return model.loss_function(first, None, first.shape[-1], num_items_in_batch=total, shift_labels=targets)


def _first_of_unprompted(batch: PromptedBatch, labels: torch.Tensor) -> torch.Tensor:
    """`[B, L]`: True at label 0 of each row whose prompt doesn't predict it (no prompt, or a KV prompt)."""
    unprompted = ~batch.row_prompts.predicts_first(labels.shape[0], labels.device)  # [B]
    first = torch.zeros_like(labels, dtype=torch.bool)
    first[:, 0] = unprompted
    return first


def _causal_lm(model: nn.Module, batch: PromptedBatch, labels: Optional[torch.Tensor], kwargs: dict):
    # The wrapped model computes the text's loss itself, so `num_items_in_batch` and wrappers such as TRL's fused
    # head see the labels. Text token 0 is predicted by the last prompt position: running in the text pass, or from the
    # prompt pass's output, once per prompt.
    if batch.prompt_last is None or labels is None:
        if labels is not None and batch.in_text:  # a row without an input prompt has nothing to predict its token 0
            labels = labels.masked_fill(_first_of_unprompted(batch, labels), IGNORE_INDEX)
        output = model(**batch.kwargs, labels=semantics.prefixed_labels(labels, batch.in_text), **kwargs)
        return _strip(output, batch.in_text, batch.mask.shape[1])
    kwargs = dict(kwargs)
    total = kwargs.pop("num_items_in_batch", None)
    if total is None:
        total = semantics.targets(labels, batch.row_prompts.predicts_first(labels.shape[0], labels.device))
    output = model(**batch.kwargs, labels=labels, num_items_in_batch=total, **kwargs)  # sum over tokens 1.. / total
    output.loss = output.loss + _first_token_term(model, batch, labels, total).to(output.loss.device)
    return output


def _sequence_classification(model: nn.Module, batch: PromptedBatch, labels: Optional[torch.Tensor], kwargs: dict):
    # Pool at each row's last real token from the mask: GPT-2 itself pools index -1 when it only sees embeddings.
    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_items_in_batch", "return_dict")}
    out = model.base_model(**batch.kwargs, **kwargs)
    hidden = out.last_hidden_state[:, batch.in_text :]  # [B, L, D]
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    pooled = hidden[rows, semantics.last_real_index(batch.mask).to(hidden.device)]  # [B, D]
    names = batch.row_prompts.names
    routed = {"adapter_names": names} if names is not None and isinstance(model.score, ModulesToSaveWrapper) else {}
    logits = model.score(pooled, **routed)  # [B, C]: each row through its own adapter's copy of the head
    loss = None
    if labels is not None:
        loss = ForSequenceClassificationLoss(labels.to(logits.device), logits, model.config)
    output = SequenceClassifierOutputWithPast(
        loss=loss,
        logits=logits,
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )
    return _strip(output, batch.in_text, batch.mask.shape[1])


@dataclass(frozen=True)
class Task:
    """Everything that differs between task types; adding a task type means adding one record to `TASKS`."""

    run: Callable  # (model, PromptedBatch, labels, forward kwargs) -> outputs shaped like the base model's
    prompt_in_text: Callable[[nn.Module, Optional[torch.Tensor], dict], int]  # prompt positions run in the text pass
    head: str  # the attribute the wrapped model must have
    auto_class: str  # the transformers Auto class that loads such a base (model card, tiny models, errors)
    token_labels: bool  # labels per token `[B, L]` (the probe labels its token) or per row `[B]`
    on_attach: Callable = lambda model: None  # adjusts the base model once, when the first adapter is attached
    # Its output is the base model's own next-token head, so an engine fed `prompt_embeds` serves it exactly.
    served_by_engines: bool = False
    # The heads PEFT wraps in `modules_to_save` for this task by itself (one copy per adapter, chosen per row).
    head_copies: tuple[str, ...] = ()


TASKS: dict[str, Task] = {
    "CAUSAL_LM": Task(
        run=_causal_lm,
        prompt_in_text=_causal_lm_prompt_in_text,
        head="lm_head",
        auto_class="AutoModelForCausalLM",
        token_labels=True,
        on_attach=_count_every_label,
        served_by_engines=True,
    ),
    "SEQ_CLS": Task(
        run=_sequence_classification,
        prompt_in_text=lambda model, labels, kwargs: 0,
        head="score",
        auto_class="AutoModelForSequenceClassification",
        token_labels=False,
        head_copies=("classifier", "score"),  # PeftModelForSequenceClassification adds both, whichever exists
    ),
}
SUPPORTED_TASK_TYPES = tuple(TASKS)


def task_name(task_type) -> str:
    """A config's `task_type` (a `TaskType`, its string, or None for CAUSAL_LM) as the key of `TASKS`."""
    return str(getattr(task_type, "value", task_type) or "CAUSAL_LM")


def task_of(task_type) -> Task:
    name = task_name(task_type)
    if name not in TASKS:
        raise ValueError(
            f"`task_type` must be one of {list(SUPPORTED_TASK_TYPES)}, got {task_type!r}: soft prompts here target "
            "decoder models for causal language modelling or sequence classification."
        )
    return TASKS[name]
