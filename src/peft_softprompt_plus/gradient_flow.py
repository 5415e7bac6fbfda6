"""Gradient reachability: prove that gradients reach the soft prompt, and name the cause when they don't.

One engine serves the attach-time probe (`validate_at_attach`), `check_gradient_flow` for custom loops and
`GradientFlowCallback` for `Trainer`; every finding code is one independent check in `_CHECKS`.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import peft
import torch
import transformers
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from . import tying
from .prompt_bank import SoftPromptBank

_NOT_RUN = object()  # evidence slot for "this caller never ran a loss" (the Trainer callback)


@dataclass
class Finding:
    code: str  # stable, one of `FINDING_CODES`
    message: str  # what is wrong, with the evidence
    fix: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}\n    Fix: {self.fix}"


class GradientFlowError(RuntimeError):
    """Raised when the prompt cannot receive gradients; `.findings` lists each cause with its fix."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("The soft prompt can't train as set up:\n" + "\n".join(map(str, findings)))

    def __reduce__(self):  # pickles with its findings (e.g. raised in a DDP worker), not with the joined message
        return type(self), (self.findings,)


class GradientFlowWarning(UserWarning):
    """A gradient-flow finding reported as a warning (`validate_gradients='warn'`, grad disabled in training)."""


@dataclass
class GradientFlowReport:
    """What one gradient-flow check found; `ok` when nothing. `grad_norms` holds each prompt's gradient L2 norm."""

    findings: list[Finding]
    grad_norms: dict[str, Optional[float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def raise_if_failed(self) -> None:
        if self.findings:
            raise GradientFlowError(self.findings)

    def __str__(self) -> str:
        norms = ", ".join(f"{n}: {'none' if g is None else f'{g:.3g}'}" for n, g in self.grad_norms.items())
        head = f"gradient flow: {'OK' if self.ok else f'{len(self.findings)} problem(s)'} (grad norms: {norms or '-'})"
        return "\n".join([head, *map(str, self.findings)])


@dataclass
class _Evidence:
    model: nn.Module
    prompts: dict[str, torch.Tensor]
    base: list[tuple[str, torch.Tensor]]  # every parameter that is not a soft prompt
    allowed: set[int]  # ids of base parameters meant to train (PEFT `modules_to_save` copies)
    grad_mode: Optional[str] = None  # the context that disabled gradients; None when they are enabled
    loss: Any = _NOT_RUN
    outputs_graph: Optional[bool] = None
    grads: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # a name absent: not measured
    moved: dict[str, bool] = field(default_factory=dict)  # did an optimizer step change it (callback only)
    optimizer: Any = None
    rerun: Optional[Callable[[], float]] = None  # the loss value again, without a graph


# ---------------------------------------------------------------------------------------------- the checks


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _has_graph(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _any_graph(obj) -> bool:
    children = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (tuple, list)) else ()
    return _has_graph(obj) or any(_any_graph(c) for c in children)


def _with_ties(model: nn.Module, names: list[str]) -> list[str]:
    groups = {n: g for g in tying.tied_parameter_groups(model) for n in g}
    return [n if n not in groups else f"{n} (tied to {[t for t in groups[n] if t != n]})" for n in names]


def _grad_disabled(ev: _Evidence) -> list[str]:
    out = [f"Gradients are disabled here ({ev.grad_mode}), so the forward records no graph."] if ev.grad_mode else []
    return out + [
        f"Prompt `{n}` was created under torch.inference_mode(): it is an inference tensor, which autograd never "
        "records, so it can never train."
        for n, p in ev.prompts.items()
        if p.is_inference()
    ]


def _prompt_frozen(ev: _Evidence) -> list[str]:
    return [
        f"Prompt `{n}` {_shape(p)} has requires_grad=False: autograd never computes its gradient."
        for n, p in ev.prompts.items()
        if not p.requires_grad
    ]


def _non_leaf_prompt(ev: _Evidence) -> list[str]:
    return [
        f"Prompt `{n}` is not a leaf tensor (grad_fn={type(p.grad_fn).__name__}): it was computed from the "
        "nn.Parameter (e.g. `nn.Parameter(x).to(...)`/`.cuda()`), so its `.grad` is never filled and an "
        "optimizer cannot hold it."
        for n, p in ev.prompts.items()
        if not p.is_leaf
    ]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor with requires_grad=False (value {value.item():.4g})"
    return f"a {type(value).__module__}.{type(value).__name__} ({value!r})"


def _loss_without_graph(ev: _Evidence) -> list[str]:
    if ev.grad_mode is not None or ev.loss is _NOT_RUN or _has_graph(ev.loss):
        return []
    if isinstance(ev.loss, torch.Tensor) and not ev.outputs_graph:
        return []  # the outputs have no graph either: the model cut it (`unreachable`), not the loss code
    return [
        f"The loss is {_describe(ev.loss)}: it carries no autograd graph, so backward() cannot reach anything "
        f"(the model's outputs {'do' if ev.outputs_graph else 'do not'} carry one)."
    ]


def _prompt_matters(ev: _Evidence) -> Optional[bool]:
    """Whether nudging the prompts changes the loss value; None when that can't be measured."""
    if ev.rerun is None or any(p.is_inference() for p in ev.prompts.values()):
        return None  # inference tensors refuse the in-place nudge
    gen, nudged = torch.Generator().manual_seed(0), []
    try:
        before = ev.rerun()
        with torch.no_grad():
            for p in ev.prompts.values():  # random, not a uniform shift: LayerNorm would erase that
                old = p.detach().clone()
                noise = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)
                p.add_(noise * (old.float().std().nan_to_num(0.0).item() + 1e-2))
                nudged.append((p, old))
        return ev.rerun() != before
    except Exception:  # evidence only: a failing rerun must not hide the finding itself
        return None
    finally:
        with torch.no_grad():
            for p, old in nudged:
                p.copy_(old)


_MATTERS = {
    True: " Nudging the prompt changes the loss, so the prompt is used but the graph is cut between them "
    "(a `.detach()`, `.data`, a `torch.no_grad()` region or a hook returning a detached tensor).",
    False: " Nudging the prompt leaves the loss unchanged: the model never uses it (it ignores `inputs_embeds`, "
    "or the prompt is not passed in).",
    None: "",
}


_WHERE = {  # keyed on "did the model's outputs carry a graph" (None: not seen, as in the Trainer callback)
    False: "the model's outputs carry no autograd graph at all",
    True: "the loss has a graph, but no path in it leads to the prompt",
    None: "its `.grad` was still None at the optimizer step",
}


def _unreachable(ev: _Evidence) -> list[str]:
    if ev.grad_mode is not None or (not _has_graph(ev.loss) and ev.loss is not _NOT_RUN and ev.outputs_graph):
        return []  # `grad_disabled` / `loss_without_graph` explain the missing gradient
    cut = [
        n
        for n, p in ev.prompts.items()
        if p.requires_grad and not p.is_inference() and n in ev.grads and ev.grads[n] is None
    ]
    if not cut:
        return []
    return [f"No gradient reaches prompt(s) {cut}: {_WHERE[ev.outputs_graph]}.{_MATTERS[_prompt_matters(ev)]}"]


def _zero_gradient(ev: _Evidence) -> list[str]:
    out = []
    for name, grad in ev.grads.items():
        if grad is None or not torch.isfinite(grad).all():
            continue
        rows = grad.reshape(grad.shape[0] if grad.dim() else 1, -1)  # [N, D] for a prompt
        zero = (rows == 0).all(dim=1).nonzero().flatten().tolist()
        if zero:
            which = "all" if len(zero) == len(rows) else f"rows {zero[:8]}{'...' if len(zero) > 8 else ''} of"
            out.append(f"The gradient reaches prompt `{name}` but is exactly zero in {which} its {len(rows)} rows.")
    return out


def _nonfinite_gradient(ev: _Evidence) -> list[str]:
    out = []
    for name, p in ev.prompts.items():
        bad_values = int((~torch.isfinite(p.detach())).sum())
        grad = ev.grads.get(name)
        bad_grads = 0 if grad is None else int((~torch.isfinite(grad)).sum())
        if bad_values or bad_grads:
            out.append(f"Prompt `{name}` {_shape(p)} has {bad_values} NaN/inf value(s), its gradient {bad_grads}.")
    return out


def _held(optimizer) -> list[torch.Tensor]:
    return [t for group in optimizer.param_groups for t in group["params"]]


def _not_in_optimizer(ev: _Evidence) -> list[str]:
    if ev.optimizer is None:
        return []
    held = _held(ev.optimizer)
    out = []
    for name, p in ev.prompts.items():
        if any(t is p for t in held):
            continue
        twin = any(t.shape == p.shape for t in held)
        out.append(
            f"The optimizer ({type(ev.optimizer).__name__}, {len(held)} tensor(s)) does not hold prompt `{name}`, "
            "so its gradient arrives but no step ever changes it."
            + (" It holds a tensor of the same shape: it was built before the prompt was replaced." if twin else "")
        )
    return out


def _aliases_base_weights(ev: _Evidence) -> list[str]:
    out = []
    for name, p in ev.prompts.items():
        ptr = p.untyped_storage().data_ptr() if p.device.type != "meta" else 0
        hits = [n for n, b in ev.base if ptr and b.device == p.device and b.untyped_storage().data_ptr() == ptr]
        if hits:
            out.append(
                f"Prompt `{name}` shares storage with base weight(s) {_with_ties(ev.model, hits)}: every optimizer "
                "step on the prompt edits the model too."
            )
    return out


def _low_precision_prompt(ev: _Evidence) -> list[str]:
    return [
        f"Prompt `{n}` is {str(p.dtype).removeprefix('torch.')}: GradScaler refuses low-precision gradients and "
        "updates smaller than the value's precision vanish."
        for n, p in ev.prompts.items()
        if p.is_floating_point() and torch.finfo(p.dtype).bits < 32
    ]


def _base_trainable(ev: _Evidence) -> list[str]:
    trainable = [(n, b) for n, b in ev.base if b.requires_grad and id(b) not in ev.allowed]
    if not trainable:
        return []
    names, count = [n for n, _ in trainable], sum(b.numel() for _, b in trainable)
    return [
        f"{len(names)} base parameter(s) ({count:,} values) require grad: {_with_ties(ev.model, names[:3])}"
        f"{' ...' if len(names) > 3 else ''}. They cost gradient memory and training would modify the base model."
    ]


def _prompt_unchanged(ev: _Evidence) -> list[str]:
    out = []
    for name, moved in ev.moved.items():
        grad, prompt = ev.grads.get(name), ev.prompts[name]
        usable = grad is not None and bool(torch.isfinite(grad).all()) and bool(grad.any())
        groups = [g for g in getattr(ev.optimizer, "param_groups", []) if any(t is prompt for t in g["params"])]
        if not moved and usable and (ev.optimizer is None or groups):
            lrs = [g.get("lr") for g in groups]
            out.append(f"Prompt `{name}` got a usable gradient, but the optimizer step left it unchanged (lr={lrs}).")
    return out


_CHECKS: dict[str, Callable[[_Evidence], list[str]]] = {
    "grad_disabled": _grad_disabled,
    "prompt_frozen": _prompt_frozen,
    "non_leaf_prompt": _non_leaf_prompt,
    "loss_without_graph": _loss_without_graph,
    "unreachable": _unreachable,
    "zero_gradient": _zero_gradient,
    "nonfinite_gradient": _nonfinite_gradient,
    "not_in_optimizer": _not_in_optimizer,
    "aliases_base_weights": _aliases_base_weights,
    "low_precision_prompt": _low_precision_prompt,
    "base_trainable": _base_trainable,
    "prompt_unchanged": _prompt_unchanged,
}

_FIXES: dict[str, str] = {
    "grad_disabled": "Run the training forward outside torch.no_grad()/torch.inference_mode() and never through "
    "`generate()`; call model.eval() for inference instead.",
    "prompt_frozen": "Call `model.set_adapter(name)` (it makes the active prompt trainable) or "
    "`prompt.requires_grad_(True)`; for PeftModel.from_pretrained pass `is_trainable=True`.",
    "non_leaf_prompt": "Move or cast the tensor before wrapping it: `nn.Parameter(x.to(device))`, or register the "
    "Parameter in a module and move the module (`module.to(device)`).",
    "loss_without_graph": "Return the loss tensor itself: no `.item()`, `float()`, `.numpy()` or `.detach()` on the "
    "loss or the logits it is computed from (log `loss.item()` separately).",
    "unreachable": "Feed the prompt in as `inputs_embeds` (or through the cache) of a forward that uses it; remove "
    "`.detach()`, `.data`, `torch.no_grad()` or detaching hooks on the path. See docs/gradient-flow.md.",
    "zero_gradient": "Check that the prompt positions are not masked out and not multiplied by zero, and that the "
    "loss depends on positions after the prompt (labels not all -100).",
    "nonfinite_gradient": "Re-initialise the prompt (NaN/inf values), lower the learning rate, and keep the prompt "
    "float32 with a GradScaler under fp16.",
    "not_in_optimizer": "Build the optimizer after attaching the adapter, from `model.parameters()` or "
    "`[p for p in model.parameters() if p.requires_grad]`.",
    "aliases_base_weights": "Copy the values: `nn.Parameter(wte.weight[:N].detach().clone())`.",
    "low_precision_prompt": "Keep the prompt float32 (`prompt.data = prompt.data.float()`) and cast it to the "
    "model's dtype only where it is used.",
    "base_trainable": "Freeze the base (`model.base_model.model.requires_grad_(False)`); for more capacity raise "
    "`num_virtual_tokens` rather than training the tied wte/lm_head pair.",
    "prompt_unchanged": "Use a learning rate > 0 and check that `optimizer.step()` runs on this optimizer.",
}

FINDING_CODES: tuple[str, ...] = tuple(_CHECKS)


def _report(ev: _Evidence) -> GradientFlowReport:
    findings = [Finding(code, msg, _FIXES[code]) for code, check in _CHECKS.items() for msg in check(ev)]
    norms = {n: None if g is None else float(g.float().norm()) for n, g in ev.grads.items()}
    return GradientFlowReport(findings, norms)


# ---------------------------------------------------------------------------------------------- gathering evidence


def _grad_mode() -> Optional[str]:
    if torch.is_inference_mode_enabled():
        return "torch.inference_mode() is active"
    return None if torch.is_grad_enabled() else "torch.no_grad() is active; `generate()` runs under it too"


def _banks(model: nn.Module) -> list[SoftPromptBank]:
    return [m for m in model.modules() if isinstance(m, SoftPromptBank)]


_NAMING = (  # how a user's `prompt=` argument becomes named tensors
    (Mapping, lambda prompt: {str(k): v for k, v in prompt.items()}),
    ((list, tuple), lambda prompt: {f"prompt[{i}]": v for i, v in enumerate(prompt)}),
    (object, lambda prompt: {"prompt": prompt}),
)


def prompts_of(model: nn.Module, prompt=None) -> dict[str, torch.Tensor]:
    """The tensors whose gradient is checked: `prompt` as given, else each active softprompt-plus adapter's."""
    if prompt is not None:
        named = next(name for kinds, name in _NAMING if isinstance(prompt, kinds))(prompt)
        bad = {k: type(v).__name__ for k, v in named.items() if not isinstance(v, torch.Tensor)}
        if bad or not named:
            raise TypeError(
                f"`prompt` must be a tensor, a list of tensors or a dict of them, got {type(prompt).__name__} "
                f"(non-tensors: {bad}). Pass the tensor(s) your model learns."
            )
        return named
    found = {name: bank.prompt[name] for bank in _banks(model) for name in bank.active_adapters if name in bank.prompt}
    if not found:
        raise ValueError(
            f"`model` ({type(model).__name__}) has no active softprompt-plus prompt. Attach one with "
            "`get_peft_model(model, SoftPromptPlusConfig(...))`, or for a custom module pass `prompt=` the tensor(s) "
            "it learns."
        )
    return found


def _static_evidence(model: nn.Module, prompts: dict[str, torch.Tensor], optimizer) -> _Evidence:
    own = {id(p) for p in prompts.values()} | {id(p) for bank in _banks(model) for p in bank.parameters()}
    allowed = {
        id(p)
        for m in model.modules()
        if isinstance(m, AuxiliaryTrainingWrapper)
        for attr in m.adapter_layer_names
        for p in getattr(m, attr).parameters()
    }
    base = [(n, p) for n, p in model.named_parameters() if id(p) not in own]
    return _Evidence(model=model, prompts=prompts, base=base, allowed=allowed, optimizer=optimizer)


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


def _measure(model, batch, prompts, loss_fn, optimizer, ours: bool) -> _Evidence:
    ev = _static_evidence(model, prompts, optimizer)
    ev.grad_mode = _grad_mode()
    outputs = _run(model, batch, ours)
    ev.loss, ev.outputs_graph = _loss(outputs, batch, loss_fn), _any_graph(outputs)
    ev.rerun = lambda: _value(model, batch, loss_fn, ours)
    wanted = {n: p for n, p in prompts.items() if p.requires_grad}
    if ev.grad_mode is None and wanted:
        grads = _gradients(ev.loss, list(wanted.values()), model) if _has_graph(ev.loss) else [None] * len(wanted)
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


def _value(model, batch, loss_fn, ours: bool) -> float:
    with torch.random.fork_rng(devices=_cuda_devices(model)), torch.no_grad():  # same dropout masks every rerun
        return float(_loss(_run(model, batch, ours), batch, loss_fn))


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _tuners(model: nn.Module) -> list[nn.Module]:
    from .tuner import SoftPromptPlusModel  # the tuner imports this module

    return [m for m in model.modules() if isinstance(m, SoftPromptPlusModel)]


@contextlib.contextmanager
def _undisturbed(model: nn.Module, grad_context):
    """Train mode for the path training uses; afterwards RNG, every module's mode and the warn-once flag as found."""
    modes = [(m, m.training) for m in model.modules()]
    warned = [(t, getattr(t, "_warned_grad_disabled", False)) for t in _tuners(model)]
    with torch.random.fork_rng(devices=_cuda_devices(model)), grad_context:
        for tuner, _ in warned:
            tuner._warned_grad_disabled = True  # the report names `grad_disabled`; keep the one warning for later
        model.train()
        try:
            yield
        finally:
            for module, mode in modes:
                module.training = mode
            for tuner, flag in warned:
                tuner._warned_grad_disabled = flag


# ---------------------------------------------------------------------------------------------- entry points

_PROBE_LABELS: dict[str, bool] = {"CAUSAL_LM": True, "SEQ_CLS": False}  # does the task take token labels


def _probe_batch(tuner, adapter_name: str) -> dict:
    task = tuner.peft_config[adapter_name].task_type or "CAUSAL_LM"
    device = tuner.model.get_input_embeddings().weight.device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]: one text token exercises every path
    labels = {"labels": ids} if _PROBE_LABELS.get(str(getattr(task, "value", task))) else {}
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
    tuners = _tuners(model)
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
    param = tuner.softprompt_plus.prompt[adapter_name]
    active, requires_grad = tuner.active_adapter, param.requires_grad
    tuner.active_adapter = adapter_name
    param.requires_grad_(True)
    try:
        with torch.inference_mode(False), _undisturbed(tuner, torch.enable_grad()):
            yield
    finally:
        tuner.active_adapter = active
        param.requires_grad_(requires_grad)


_LIBRARIES = tuple(os.path.dirname(m.__file__) for m in (torch, peft, transformers)) + (os.path.dirname(__file__),)


def _user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the first frame outside torch/PEFT/transformers/this package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


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
    prompts = {adapter_name: tuner.softprompt_plus.prompt[adapter_name]}
    with _probing(tuner, adapter_name):
        report = _report(_measure(tuner, _probe_batch(tuner, adapter_name), prompts, _probe_loss, None, True))
    handle_failure(report, mode)


def warn_grad_disabled_once(tuner) -> None:
    """A training-mode forward under `no_grad`/`inference_mode` trains nothing; say so once per model."""
    if getattr(tuner, "_warned_grad_disabled", False):
        return
    tuner._warned_grad_disabled = True
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
    ev = _static_evidence(model, prompts, optimizer)
    ev.grads = {n: before[n][1] for n, p in prompts.items() if n in before and p.is_leaf}
    ev.moved = {n: not torch.equal(before[n][0], p.detach()) for n, p in prompts.items() if n in before}
    return _report(ev)
