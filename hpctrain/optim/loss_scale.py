"""Dynamic loss scaling for float16 training (bf16, float32 and float64 use a fixed scale of 1)."""
from __future__ import annotations

import math


class DynamicLossScaler:
    """Halve the scale and skip the step on inf/NaN gradients; double it after ``growth_interval`` good steps.

    The decision uses the GLOBAL gradient norm (already agreed by an all-reduce), so every rank skips
    or steps together.
    """

    def __init__(self, initial: float = 65536.0, growth_interval: int = 1000, enabled: bool = True,
                 min_scale: float = 1.0):
        self.scale = initial if enabled else 1.0
        self.enabled, self.growth_interval, self.min_scale = enabled, growth_interval, min_scale
        self.good_steps = 0

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

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
