"""Dynamic loss scaling for float16 training (bf16, float32 and float64 use a fixed scale of 1)."""
from __future__ import annotations

import torch


class DynamicLossScaler:
    """Halve the scale and skip the step on inf/NaN gradients; double it after ``growth_interval`` good steps.

    The decision uses the GLOBAL gradient norm (already agreed by an all-reduce), so every rank skips
    or steps together. It is made once, on the device (``update_on_device``, into ``scale_tensor``, which
    the step multiplies the loss by: no host read); the host's ``scale`` and ``good_steps`` (what checkpoints
    and metrics see) follow the device's when a step's verdict is read (``follow``).
    """

    def __init__(self, initial: float = 65536.0, growth_interval: int = 1000, enabled: bool = True,
                 min_scale: float = 1.0, device: torch.device | None = None):
        self.scale = initial if enabled else 1.0
        self.enabled, self.growth_interval, self.min_scale = enabled, growth_interval, min_scale
        self.good_steps = 0
        self.scale_tensor = torch.full((), self.scale, dtype=torch.float64, device=device)
        self.good_tensor = torch.zeros((), dtype=torch.int64, device=device)

    def follow(self, scale: float, good_steps: int) -> None:
        """The host's copy of the device's scale and good-step count, read after a step."""
        if self.enabled:
            self.scale, self.good_steps = scale, good_steps

    def update_on_device(self, finite_norm: torch.Tensor) -> None:
        """From a bool 0-d tensor (the gradient norm is finite): an overflow halves the scale (not below
        ``min_scale``) and resets the good steps; every ``growth_interval``-th good step doubles it."""
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
