"""What a gradient check reports: each `Finding` (a stable code, the evidence, the fix), a `GradientFlowReport`, and
the `GradientFlowError` / `GradientFlowWarning` raised or warned with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
