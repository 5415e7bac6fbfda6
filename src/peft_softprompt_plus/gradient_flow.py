"""Gradient reachability: prove at attach time that gradients reach the prompt."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class Finding:
    code: str
    message: str
    fix: str


class GradientFlowError(RuntimeError):
    """Raised when the prompt cannot receive gradients; `.findings` lists each cause with its fix."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("\n".join(f"[{f.code}] {f.message} Fix: {f.fix}" for f in findings))


def _probe_findings(tuner, adapter_name: str) -> list[Finding]:
    param = tuner.softprompt_plus.prompt[adapter_name]
    findings = []
    base = [n for n, p in tuner.model.named_parameters() if p.requires_grad and "modules_to_save" not in n]
    if base:
        findings.append(
            Finding(
                "base_trainable",
                f"{len(base)} base parameter(s) require grad, e.g. {base[:3]}.",
                "Freeze them: only the prompt should train (`model.base_model.model.requires_grad_(False)`).",
            )
        )
    device = param.device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    was_training = tuner.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
        tuner.train()
        try:
            out = tuner(input_ids=ids, labels=ids if _wants_token_labels(tuner, adapter_name) else torch.zeros(1, dtype=torch.long, device=device))
        finally:
            tuner.train(was_training)
        loss = out.loss
        if loss is None or loss.grad_fn is None:
            findings.append(Finding("unreachable", "The probe loss has no graph back to the prompt.", "See docs/gradient-flow.md."))
            return findings
        (grad,) = torch.autograd.grad(loss, [param], allow_unused=True)
    if grad is None:
        findings.append(Finding("unreachable", "The probe loss's graph does not reach the prompt.", "See docs/gradient-flow.md."))
    elif not torch.isfinite(grad).all():
        findings.append(Finding("nonfinite_gradient", "The probe gradient has NaN/inf.", "Check the prompt values."))
    elif not grad.abs().sum() > 0:
        findings.append(Finding("zero_gradient", "The probe gradient is exactly zero.", "See docs/gradient-flow.md."))
    return findings


def _wants_token_labels(tuner, adapter_name: str) -> bool:
    task = tuner.peft_config[adapter_name].task_type or "CAUSAL_LM"
    return str(getattr(task, "value", task)) == "CAUSAL_LM"


def validate_at_attach(tuner, adapter_name: str, mode: str) -> None:
    findings = _probe_findings(tuner, adapter_name)
    if not findings:
        return
    if mode == "raise":
        raise GradientFlowError(findings)
    warnings.warn(str(GradientFlowError(findings)), stacklevel=3)


def warn_grad_disabled_once(tuner) -> None:
    """A training-mode forward under `no_grad`/`inference_mode` trains nothing; say so once per model."""
    if getattr(tuner, "_warned_grad_disabled", False):
        return
    tuner._warned_grad_disabled = True
    warnings.warn(
        "[grad_disabled] The soft-prompted model ran a forward in training mode with gradients disabled "
        "(torch.no_grad(), torch.inference_mode() or inside generate()), so the prompt gets no gradient from it. "
        "Fix: run the training forward outside those contexts, or call model.eval() for inference.",
        stacklevel=4,
    )
