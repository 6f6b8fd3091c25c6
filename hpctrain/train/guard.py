"""What the user reads when the device stopped a diverging run: the words of hpctrain/train/verdict.py's rules.

The rules themselves (skip a non-finite step, stop with ``train.nonfinite = "stop"``, stop after more than
``train.max_skipped_steps`` consecutive counted skips, float16 overflows counted only at the minimum loss
scale) run once, on the device, in ``StepVerdict.decide``; the host reads the outcome and only words it
here. Megatron-LM's ``check_for_nan_in_loss_and_grad`` stops on a NaN; hpctrain also keeps the bad state
out of checkpoints (the run saves nothing after it: exit ``DIVERGED_EXIT``) and the checkpoint writers
refuse non-finite data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.train.verdict import NONFINITE_LOSS, NONFINITE_NORM, TOO_MANY_SKIPS, Reading
from hpctrain.exit_codes import DIVERGED as DIVERGED_EXIT

REASONS = {NONFINITE_LOSS: "non-finite loss", NONFINITE_NORM: "non-finite gradient norm",
           TOO_MANY_SKIPS: "too many skipped steps"}


@dataclass(frozen=True)
class Divergence:
    """Why the run stopped at ``step``: ``stop`` is one of ``REASONS``' values (metrics.jsonl's stop event
    "reason"), ``detail`` the one line for the user ("step N: what was seen")."""
    step: int
    stop: str
    detail: str


def divergence(step: int, reading: Reading, max_skipped_steps: int, scaler_enabled: bool) -> Divergence | None:
    """The stop that the device decided at ``step`` (1-based), worded; None when it did not stop the run."""
    if not reading.stop_code:
        return None
    reason = REASONS[reading.stop_code]
    if not math.isfinite(reading.loss):  # what was non-finite
        seen = f"loss = {reading.loss}"
    elif not scaler_enabled:
        seen = f"gradient norm = {reading.grad_norm}"
    else:
        seen = f"float16 loss scale {reading.scale:g} (its minimum) and the gradients still overflow"
    if reading.stop_code == TOO_MANY_SKIPS:
        return Divergence(step, reason, f"step {step}: {reading.skips} consecutive steps skipped, more than "
                                        f"train.max_skipped_steps = {max_skipped_steps} (the last: {seen})")
    return Divergence(step, reason, f"step {step}: {reason} ({seen})")
