"""Error-feedback memory (Seide et al. 2014; Karimireddy et al. 2019): what compression dropped is kept
and added to the next step's gradient, so nothing is lost, only delayed.

Invariant (tested): after ``remember(key, corrected, sent)``, ``sent + residual == corrected``
exactly, where ``corrected = gradient + previous residual``. Residuals are in the units of the main
gradients, which in a float16 run carry the loss scale: ``rescale`` follows the scaler, and a step
the scaler skips (inf/NaN) clears the memory, since its gradients are discarded.
"""
from __future__ import annotations

import torch


class ErrorFeedback:
    """Residuals by key (``worker/<bucket>``, ``server/<bucket>``, ``residual/<param>``), on this rank."""

    def __init__(self):
        self.residuals: dict[str, torch.Tensor] = {}

    def corrected(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """A new tensor: ``x`` plus the residual kept under ``key`` (none yet: a copy of ``x``)."""
        residual = self.residuals.get(key)
        return x.clone() if residual is None else x + residual.view_as(x)

    def remember(self, key: str, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        self.residuals[key] = corrected - sent.view_as(corrected)

    def rescale(self, factor: float) -> None:
        for residual in self.residuals.values():
            residual.mul_(factor)

    def clear(self) -> None:
        self.residuals.clear()
