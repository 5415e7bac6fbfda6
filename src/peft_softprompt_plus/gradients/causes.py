"""What can keep a soft prompt from training: one independent check per finding code, with its fix (`CHECKS`).
Each reads only the evidence (`gradient_evidence`); `gradient_flow` gathers it by running the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..method import tying
from .evidence import _NOT_RUN, Evidence, has_graph
from .findings import Finding


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _with_ties(model: nn.Module, names: list[str]) -> list[str]:
    groups = {n: g for g in tying.tied_parameter_groups(model) for n in g}
    return [n if n not in groups else f"{n} (tied to {[t for t in groups[n] if t != n]})" for n in names]


def _grad_disabled(ev: Evidence) -> list[str]:
    out = [f"Gradients are disabled here ({ev.grad_mode}), so the forward records no graph."] if ev.grad_mode else []
    return out + [
        f"Prompt `{n}` was created under torch.inference_mode(): it is an inference tensor, which autograd never "
        "records, so it can never train."
        for n, p in ev.prompts.items()
        if p.is_inference()
    ]


def _prompt_frozen(ev: Evidence) -> list[str]:
    return [
        f"Prompt `{n}` {_shape(p)} has requires_grad=False: autograd never computes its gradient."
        for n, p in ev.prompts.items()
        if not p.requires_grad
    ]


def _non_leaf_prompt(ev: Evidence) -> list[str]:
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


def _loss_without_graph(ev: Evidence) -> list[str]:
    if ev.grad_mode is not None or ev.loss is _NOT_RUN or has_graph(ev.loss):
        return []
    if isinstance(ev.loss, torch.Tensor) and not ev.outputs_graph:
        return []  # the outputs have no graph either: the model cut it (`unreachable`), not the loss code
    return [
        f"The loss is {_describe(ev.loss)}: it carries no autograd graph, so backward() cannot reach anything "
        f"(the model's outputs {'do' if ev.outputs_graph else 'do not'} carry one)."
    ]


_WHERE = {  # keyed on "did the model's outputs carry a graph" (None: not seen, as in the Trainer callback)
    False: "the model's outputs carry no autograd graph at all: the model never uses the prompt (it ignores "
    "`inputs_embeds`; for a KV prompt, no attention layer reads the keys/values handed to it; or the prompt is not "
    "passed in), or runs it without autograd",
    True: "the loss has a graph, but no path in it leads to the prompt: a `.detach()`, `.data`, a `torch.no_grad()` "
    "region or a hook returning a detached tensor cuts it, or the model never uses the prompt",
    None: "its `.grad` was still None at the optimizer step",
}


def _unreachable(ev: Evidence) -> list[str]:
    if ev.grad_mode is not None or (not has_graph(ev.loss) and ev.loss is not _NOT_RUN and ev.outputs_graph):
        return []  # `grad_disabled` / `loss_without_graph` explain the missing gradient
    cut = [
        n
        for n, p in ev.prompts.items()
        if p.requires_grad and not p.is_inference() and n in ev.grads and ev.grads[n] is None
    ]
    if not cut:
        return []
    return [f"No gradient reaches prompt(s) {cut}: {_WHERE[ev.outputs_graph]}."]


def _zero_gradient(ev: Evidence) -> list[str]:
    out = []
    for name, grad in ev.grads.items():
        if grad is None or not torch.isfinite(grad).all():
            continue
        kv = grad.dim() == 5 and name not in ev.whole  # a KV prompt `[layers, 2, Hkv, N, hd]`: judged per position
        if kv:
            rows = grad.movedim(-2, 0).reshape(grad.shape[-2], -1)  # [N, layers*2*Hkv*hd]
        else:
            rows = grad.reshape(1 if name in ev.whole or not grad.dim() else grad.shape[0], -1)  # [N, D] for a prompt
        zero = (rows == 0).all(dim=1).nonzero().flatten().tolist()
        unit = "positions" if kv else "rows"
        if zero:
            which = "all" if len(zero) == len(rows) else f"{unit} {zero[:8]}{'...' if len(zero) > 8 else ''} of"
            out.append(f"The gradient reaches prompt `{name}` but is exactly zero in {which} its {len(rows)} {unit}.")
    return out


def _nonfinite_gradient(ev: Evidence) -> list[str]:
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


def _not_in_optimizer(ev: Evidence) -> list[str]:
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


def _aliases_base_weights(ev: Evidence) -> list[str]:
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


def _low_precision_prompt(ev: Evidence) -> list[str]:
    return [
        f"Prompt `{n}` is {str(p.dtype).removeprefix('torch.')}: GradScaler refuses low-precision gradients and "
        "updates smaller than the value's precision vanish."
        for n, p in ev.prompts.items()
        if p.is_floating_point() and torch.finfo(p.dtype).bits < 32
    ]


def _base_trainable(ev: Evidence) -> list[str]:
    trainable = [(n, b) for n, b in ev.base if b.requires_grad and id(b) not in ev.allowed]
    if not trainable:
        return []
    names, count = [n for n, _ in trainable], sum(b.numel() for _, b in trainable)
    return [
        f"{len(names)} base parameter(s) ({count:,} values) require grad: {_with_ties(ev.model, names[:3])}"
        f"{' ...' if len(names) > 3 else ''}. They cost gradient memory and training would modify the base model."
    ]


def _prompt_unchanged(ev: Evidence) -> list[str]:
    out = []
    for name, moved in ev.moved.items():
        grad, prompt = ev.grads.get(name), ev.prompts[name]
        usable = grad is not None and bool(torch.isfinite(grad).all()) and bool(grad.any())
        groups = [g for g in getattr(ev.optimizer, "param_groups", []) if any(t is prompt for t in g["params"])]
        if not moved and usable and (ev.optimizer is None or groups):
            lrs = [g.get("lr") for g in groups]
            out.append(f"Prompt `{name}` got a usable gradient, but the optimizer step left it unchanged (lr={lrs}).")
    return out


@dataclass(frozen=True)
class Check:
    code: str  # stable: reports, warnings and docs name it
    find: Callable[[Evidence], list[str]]  # one message per instance found, from the evidence alone
    fix: str


CHECKS: tuple[Check, ...] = (
    Check(
        "grad_disabled",
        _grad_disabled,
        "Run the training forward outside torch.no_grad()/torch.inference_mode() and never through "
        "`generate()`; call model.eval() for inference instead.",
    ),
    Check(
        "prompt_frozen",
        _prompt_frozen,
        "Call `model.set_adapter(name)` (it makes the active prompt trainable) or "
        "`prompt.requires_grad_(True)`; for PeftModel.from_pretrained pass `is_trainable=True`.",
    ),
    Check(
        "non_leaf_prompt",
        _non_leaf_prompt,
        "Move or cast the tensor before wrapping it: `nn.Parameter(x.to(device))`, or register the "
        "Parameter in a module and move the module (`module.to(device)`).",
    ),
    Check(
        "loss_without_graph",
        _loss_without_graph,
        "Return the loss tensor itself: no `.item()`, `float()`, `.numpy()` or `.detach()` on the "
        "loss or the logits it is computed from (log `loss.item()` separately).",
    ),
    Check(
        "unreachable",
        _unreachable,
        "Feed the prompt in as `inputs_embeds` (or through the cache) of a forward that uses it; a KV prompt reaches "
        "every attention layer through the forward keyword `softprompt_plus_kv`, which a hook or wrapper must pass "
        "on; remove `.detach()`, `.data`, `torch.no_grad()` or detaching hooks on the path. See "
        "docs/gradient-flow.md.",
    ),
    Check(
        "zero_gradient",
        _zero_gradient,
        "Check that the prompt positions are not masked out and not multiplied by zero, and that the "
        "loss depends on positions after the prompt (labels not all -100).",
    ),
    Check(
        "nonfinite_gradient",
        _nonfinite_gradient,
        "Re-initialise the prompt (NaN/inf values), lower the learning rate, and keep the prompt "
        "float32 with a GradScaler under fp16.",
    ),
    Check(
        "not_in_optimizer",
        _not_in_optimizer,
        "Build the optimizer after attaching the adapter, from `model.parameters()` or "
        "`[p for p in model.parameters() if p.requires_grad]`.",
    ),
    Check(
        "aliases_base_weights",
        _aliases_base_weights,
        "Copy the values: `nn.Parameter(wte.weight[:N].detach().clone())`.",
    ),
    Check(
        "low_precision_prompt",
        _low_precision_prompt,
        "Keep the prompt float32 (`prompt.data = prompt.data.float()`) and cast it to the "
        "model's dtype only where it is used.",
    ),
    Check(
        "base_trainable",
        _base_trainable,
        "Freeze the base (`model.base_model.model.requires_grad_(False)`); for more capacity raise "
        "`num_virtual_tokens` rather than training the tied wte/lm_head pair.",
    ),
    Check(
        "prompt_unchanged",
        _prompt_unchanged,
        "Use a learning rate > 0 and check that `optimizer.step()` runs on this optimizer.",
    ),
)

FINDING_CODES: tuple[str, ...] = tuple(c.code for c in CHECKS)


def run_checks(ev: Evidence) -> list[Finding]:
    """Every check's findings, each with its code's fix."""
    return [Finding(check.code, message, check.fix) for check in CHECKS for message in check.find(ev)]
