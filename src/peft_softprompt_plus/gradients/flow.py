"""Gradient reachability, run: one engine for the attach-time probe, `check_gradient_flow` in custom loops and
`GradientFlowCallback` in `Trainer`. What it checks for lives in `gradient_checks`, what it reports in
`gradient_report`."""

from __future__ import annotations

import contextlib
import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import peft
import torch
import transformers
from torch import nn

from .._moved import user_stacklevel
from ..method.tasks import task_of
from .causes import run_checks
from .evidence import Evidence, has_graph, prompts_of, static_evidence, tuners_of
from .findings import GradientFlowError, GradientFlowReport, GradientFlowWarning


def _report(ev: Evidence) -> GradientFlowReport:
    norms = {n: None if g is None else float(g.float().norm()) for n, g in ev.grads.items()}
    return GradientFlowReport(run_checks(ev), norms)


# ---------------------------------------------------------------------------------------------- running the model


def _grad_mode() -> Optional[str]:
    if torch.is_inference_mode_enabled():
        return "torch.inference_mode() is active"
    return None if torch.is_grad_enabled() else "torch.no_grad() is active; `generate()` runs under it too"


def _any_graph(obj) -> bool:
    children = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (tuple, list)) else ()
    return has_graph(obj) or any(_any_graph(c) for c in children)


_CALLS = (  # how a batch of each kind is handed to the model
    (Mapping, lambda model, batch: model(**batch)),
    (torch.Tensor, lambda model, batch: model(batch)),
    ((tuple, list), lambda model, batch: model(*batch)),
)


def _run(model: nn.Module, batch, ours: bool):
    call = next((c for kinds, c in _CALLS if isinstance(batch, kinds)), None)
    if call is None:
        raise TypeError(f"`batch` must be a dict of model inputs, a tensor or a tuple, got {type(batch).__name__}.")
    if ours and isinstance(batch, Mapping) and batch.get("input_ids") is None and batch.get("inputs_embeds") is None:
        raise ValueError(
            f"`batch` must contain `input_ids` (or `inputs_embeds`) for a soft-prompted model, got keys {list(batch)}."
        )
    try:
        return call(model, batch)
    except torch.OutOfMemoryError:
        raise  # not a malformed batch
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError) as err:
        keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"`batch` ({keys}) could not be run through the model: {type(err).__name__}: {err} Pass the model's "
            "forward inputs (e.g. `input_ids`, `attention_mask`, `labels`) on the model's device."
        ) from err


def _scalar(value, who: str):
    size = value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", None)
    if size is None and not isinstance(value, numbers.Number):
        raise TypeError(f"{who} must be a scalar loss tensor, got {type(value).__name__}. Return e.g. `outputs.loss`.")
    if size is not None and size != 1:
        raise ValueError(
            f"{who} must be a scalar loss, got shape {list(value.shape)}. Reduce it (e.g. `.mean()`) before returning."
        )
    return value


def _loss(outputs, batch, loss_fn):
    if loss_fn is not None:
        return _scalar(loss_fn(outputs, batch), "`loss_fn(outputs, batch)`")
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None:
        keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"The model returned no loss for `batch` ({keys}): add `labels` to the batch or pass "
            "`loss_fn(outputs, batch)`."
        )
    return _scalar(loss, "`outputs.loss`")


def _measure(model, batch, prompts, loss_fn, optimizer, ours: bool) -> Evidence:
    ev = static_evidence(model, prompts, optimizer)
    ev.grad_mode = _grad_mode()
    outputs = _run(model, batch, ours)
    ev.loss, ev.outputs_graph = _loss(outputs, batch, loss_fn), _any_graph(outputs)
    wanted = {n: p for n, p in prompts.items() if p.requires_grad}
    if ev.grad_mode is None and wanted:
        grads = _gradients(ev.loss, list(wanted.values()), model) if has_graph(ev.loss) else [None] * len(wanted)
        ev.grads = dict(zip(wanted, grads, strict=True))
    return ev


def _gradients(loss: torch.Tensor, tensors: list[torch.Tensor], model: nn.Module) -> list[Optional[torch.Tensor]]:
    """d loss / d tensors without leaving any `.grad` behind."""
    try:
        # The graph is retained only so that the fallback below can still use it.
        return list(torch.autograd.grad(loss, tensors, allow_unused=True, retain_graph=True))
    except RuntimeError as err:
        if "use_reentrant" not in str(err):
            raise
    # Reentrant gradient checkpointing refuses `autograd.grad`: run `backward()` and put every `.grad` back.
    holders = [p for p in model.parameters() if p.requires_grad] + [t for t in tensors if t.is_leaf]
    saved = [(t, t.grad) for t in holders]
    for t in holders:
        t.grad = None
    for t in tensors:
        if not t.is_leaf:
            t.retain_grad()
    try:
        loss.backward()
        return [t.grad for t in tensors]
    finally:
        for t in tensors:
            t.grad = None
        for t, grad in saved:
            t.grad = grad


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def _undisturbed(model: nn.Module, grad_context):
    """Train mode for the path training uses; afterwards RNG, every module's mode and the warn-once flag as found."""
    modes = [(m, m.training) for m in model.modules()]
    with contextlib.ExitStack() as held, torch.random.fork_rng(devices=_cuda_devices(model)), grad_context:
        for tuner in tuners_of(model):  # the report names `grad_disabled`; keep the one warning for later
            held.enter_context(tuner.forward_state.grad_warning_held())
            held.enter_context(tuner.forward_state.regularizers_off())  # every position can get a gradient
        model.train()
        try:
            yield
        finally:
            for module, mode in modes:
                module.training = mode


# ---------------------------------------------------------------------------------------------- entry points


def _probe_batch(tuner, adapter_name: str) -> dict:
    config = tuner.peft_config[adapter_name]
    device = tuner.model.get_input_embeddings().weight.device
    token_labels = task_of(config.task_type).token_labels
    # One text token exercises every path; not the prefix's first token, which may be a BOS the text can't repeat. A
    # KV prompt predicts no text token 0, so its loss needs a second token, predicted by a query that reads it.
    token = 1 if (config.prompt_prefix_ids or [None])[0] == 0 else 0
    length = 2 if token_labels and config.prompt_level == "kv" else 1
    ids = torch.full((1, length), token, dtype=torch.long, device=device)  # [1, length]
    labels = {"labels": ids} if token_labels else {}
    return {"input_ids": ids, **labels}


def _probe_loss(outputs, batch):
    # Without labels (classification), the log-partition of the logits is a loss that never saturates to 0 grad.
    return outputs.loss if outputs.loss is not None else torch.logsumexp(outputs.logits.float(), dim=-1).sum()


def check_gradient_flow(
    model: nn.Module,
    batch: Union[Mapping, torch.Tensor, tuple, None] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    *,
    prompt: Union[torch.Tensor, Mapping, list, None] = None,
) -> GradientFlowReport:
    """One forward/backward on `batch` (default: a one-token probe) in the caller's grad mode; reports every cause
    that keeps the prompt from training. The model is left as found: no `.grad` set, RNG, modes, values unchanged.

    `loss_fn(outputs, batch)` replaces `outputs.loss`; `optimizer` is checked to hold the prompt; `prompt` names
    the learned tensor(s) of a custom module (a softprompt-plus PeftModel needs none).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module (the model you train), got {type(model).__name__}.")
    if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
        hint = " Pass `scheduler.optimizer`." if hasattr(optimizer, "optimizer") else ""
        raise TypeError(
            f"`optimizer` must be a torch.optim.Optimizer (the one your loop steps), got "
            f"{type(optimizer).__name__}.{hint} Build it first, e.g. `torch.optim.AdamW(model.parameters())`."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable as `loss_fn(outputs, batch)`, got {type(loss_fn).__name__}.")
    prompts = prompts_of(model, prompt)
    tuners = tuners_of(model)
    ours = bool(tuners) and prompt is None
    if batch is None and not ours:
        raise ValueError("`batch` is required for a model without a softprompt-plus adapter; pass one training batch.")
    if batch is None:
        batch, loss_fn = _probe_batch(tuners[0], tuners[0].active_adapters[0]), loss_fn or _probe_loss
    with _undisturbed(model, contextlib.nullcontext()):
        return _report(_measure(model, batch, prompts, loss_fn, optimizer, ours))


@contextlib.contextmanager
def _probing(tuner, adapter_name: str):
    # `add_adapter` attaches an inactive, frozen prompt: make it the trainable active one while it is probed.
    params = list(tuner.prompt_bank.trainable(adapter_name).values())
    active, requires_grad = tuner.active_adapter, [p.requires_grad for p in params]
    tuner.active_adapter = adapter_name
    for param in params:
        param.requires_grad_(True)
    try:
        with torch.inference_mode(False), _undisturbed(tuner, torch.enable_grad()):
            yield
    finally:
        tuner.active_adapter = active
        for param, flag in zip(params, requires_grad, strict=True):
            param.requires_grad_(flag)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # all of peft_softprompt_plus
_LIBRARIES = tuple(os.path.dirname(m.__file__) for m in (torch, peft, transformers)) + (_PACKAGE_DIR,)


def _user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the first frame outside torch/PEFT/transformers/this package."""
    return user_stacklevel(_LIBRARIES, helpers=1)


def _warn(report: GradientFlowReport) -> None:
    warnings.warn(str(GradientFlowError(report.findings)), GradientFlowWarning, stacklevel=_user_stacklevel())


_ON_FAILURE: dict[str, Callable[[GradientFlowReport], None]] = {
    "raise": GradientFlowReport.raise_if_failed,
    "warn": _warn,
}


def handle_failure(report: GradientFlowReport, mode: str) -> None:
    """`raise` a GradientFlowError or `warn` (a GradientFlowWarning naming the codes) when `report` has findings."""
    if not report.ok:
        _ON_FAILURE[mode](report)


def validate_at_attach(tuner, adapter_name: str, mode: str) -> None:
    """Probe `adapter_name` through the tuner's real forward on one token; act on findings per `mode`."""
    prompts = tuner.prompt_bank.trainable(adapter_name)  # the prompt, and a residual encoder's weights
    with _probing(tuner, adapter_name):
        report = _report(_measure(tuner, _probe_batch(tuner, adapter_name), prompts, _probe_loss, None, True))
    handle_failure(report, mode)


def warn_grad_disabled(tuner) -> None:
    """A training-mode forward under `no_grad`/`inference_mode` trains nothing; the forward says so once per model
    (`ForwardState.take_grad_warning`)."""
    warnings.warn(
        "[grad_disabled] The soft-prompted model ran a forward in training mode with gradients disabled "
        "(torch.no_grad(), torch.inference_mode() or inside generate()), so the prompt gets no gradient from it. "
        "Fix: run the training forward outside those contexts, or call model.eval() for inference.",
        GradientFlowWarning,
        stacklevel=_user_stacklevel(),
    )


def step_snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Each prompt's values and `.grad` just before an optimizer step (non-leaf prompts have no `.grad` to read)."""
    return {
        n: (p.detach().clone(), p.grad.detach().clone() if p.is_leaf and p.grad is not None else None)
        for n, p in prompts_of(model).items()
    }


def diagnose_step(model: nn.Module, optimizer, before: dict) -> GradientFlowReport:
    """Findings after a real optimizer step, from the `step_snapshot` taken just before it."""
    prompts = prompts_of(model)
    ev = static_evidence(model, prompts, optimizer)
    ev.grads = {n: before[n][1] for n, p in prompts.items() if n in before and p.is_leaf}
    ev.moved = {n: not torch.equal(before[n][0], p.detach()) for n, p in prompts.items() if n in before}
    return _report(ev)
