"""`KeepBest`: keep the trainable values that scored best on held-out data, and stop when the score stops improving.

A prompt trained on a few hundred examples overfits: on the capitals task 5 of 9 runs lost held-out exact match
between steps 80 and 120 while the training loss kept falling. A custom loop calls `update` after each evaluation and
`restore` at the end; with Trainer, `load_best_model_at_end=True` and `EarlyStoppingCallback` do the same
(docs/training-recipe.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class KeepBest:
    """Copies of the model's trainable tensors at the best held-out score seen so far.

    - `patience`: evaluations in a row without improvement before `update` says stop (None: never stop).
    - `higher_is_better`: True for accuracy or exact match, False for a loss.
    - `min_delta`: how much better a score must be to count as an improvement.
    """

    def __init__(self, patience: Optional[int] = None, higher_is_better: bool = True, min_delta: float = 0.0):
        if patience is not None and (not isinstance(patience, int) or isinstance(patience, bool) or patience < 1):
            raise ValueError(f"`patience` must be a positive int or None, got {patience!r}.")
        if not isinstance(higher_is_better, bool):
            raise ValueError(f"`higher_is_better` must be True or False, got {higher_is_better!r}.")
        if not isinstance(min_delta, (int, float)) or isinstance(min_delta, bool) or not min_delta >= 0:
            raise ValueError(f"`min_delta` must be a number >= 0, got {min_delta!r}.")
        self.patience, self.higher_is_better, self.min_delta = patience, higher_is_better, float(min_delta)
        self.best_score: Optional[float] = None
        self.best_step: Optional[int] = None
        self.since_best = 0  # evaluations since the best one
        self._kept: dict[str, torch.Tensor] = {}

    def update(self, model: nn.Module, score: float, step: int) -> bool:
        """Record the held-out `score` of `model` at `step`; keep its trainable values if it is the best so far.
        Returns True when `patience` evaluations in a row have not improved: time to stop."""
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"`score` must be a finite number, got {score!r} at step {step}.")
        sign = 1.0 if self.higher_is_better else -1.0
        if self.best_score is None or sign * (score - self.best_score) > self.min_delta:
            self.best_score, self.best_step, self.since_best = float(score), step, 0
            self._kept = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            if not self._kept:
                raise ValueError("`model` has no trainable parameters to keep: attach the adapter before training.")
        else:
            self.since_best += 1
        return self.patience is not None and self.since_best >= self.patience

    @torch.no_grad()
    def restore(self, model: nn.Module) -> None:
        """Put the best values back into `model`'s parameters in place (the optimizer's leaves stay the same)."""
        if not self._kept:
            raise ValueError("Nothing to restore: `update` was never called with a score.")
        params = dict(model.named_parameters())
        missing = sorted(set(self._kept) - set(params))
        if missing:
            raise ValueError(
                f"`model` lacks the parameters {missing[:3]} kept from the best step: not the same model."
            )
        for name, value in self._kept.items():
            params[name].copy_(value)
