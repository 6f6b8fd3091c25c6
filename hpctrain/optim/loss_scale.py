"""Dynamic loss scaling for float16 training (bf16, float32 and float64 use a fixed scale of 1)."""
from __future__ import annotations

import math

import torch


class DynamicLossScaler:
    """Halve the scale and skip the step on inf/NaN gradients; double it after ``growth_interval`` good steps.

    The decision uses the GLOBAL gradient norm (already agreed by an all-reduce), so every rank skips
    or steps together. It is made twice, by the same rule: on the device (``update_on_device``, into
    ``scale_tensor``, which the step multiplies the loss by: no host read) and on the host when the step's
    verdict is read (``update``, into ``scale``, what checkpoints and metrics see; hpctrain/train/verdict.py
    checks that both agree).
    """

    def __init__(self, initial: float = 65536.0, growth_interval: int = 1000, enabled: bool = True,
                 min_scale: float = 1.0, device: torch.device | None = None):
        self.scale = initial if enabled else 1.0
        self.enabled, self.growth_interval, self.min_scale = enabled, growth_interval, min_scale
        self.good_steps = 0
        self.scale_tensor = torch.full((), self.scale, dtype=torch.float64, device=device)
        self.good_tensor = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, grad_norm: float) -> bool:
        """Record this step's (scaled) gradient norm; True if the step must be skipped."""
        if not self.enabled:
            return False
        if not math.isfinite(grad_norm):
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            return True
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return False

    def update_on_device(self, finite_norm: torch.Tensor) -> None:
        """``update``'s rule on the device tensors, from a bool 0-d tensor (the gradient norm is finite)."""
        if not self.enabled:
            return
        good = torch.where(finite_norm, self.good_tensor + 1, 0)
        grown = torch.where(good % self.growth_interval == 0, self.scale_tensor * 2, self.scale_tensor)
        self.scale_tensor.copy_(torch.where(finite_norm, grown, torch.clamp(self.scale_tensor / 2, min=self.min_scale)))
        self.good_tensor.copy_(good)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.scale_tensor.fill_(self.scale)
        self.good_tensor.fill_(self.good_steps)
