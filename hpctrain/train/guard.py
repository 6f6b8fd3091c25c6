"""The divergence guard: a non-finite loss or gradient norm is never applied, and never saved.

``DivergenceGuard.judge(loss, grad_norm, scaler)`` runs once per step on values every rank already
holds identically (the loss is agreed over pp and dp, the gradient norm is an all-reduce over the
world), so every rank reaches the same verdict without another collective:

- float16 (dynamic loss scaling): a non-finite gradient norm is the scaler's business (skip, halve
  the scale); a non-finite LOSS is divergence;
- float32 / bfloat16 / float64 (no scaler): a non-finite loss or gradient norm is divergence (clipping
  would turn inf into NaN: coefficient clip / inf = 0, times inf);
- divergence with ``train.nonfinite = "stop"`` (default): the update is skipped and the run stops
  without saving (exit ``DIVERGED_EXIT``); with ``"skip"``: the update is skipped and training goes on;
- more than ``train.max_skipped_steps`` consecutive skipped steps stop the run the same way (a float16 run
  whose scale reached its minimum and still overflows would otherwise skip forever). A float16 overflow
  counts only when the step ran at the scaler's minimum scale (``min_scale``, 1): above it the skip halves
  the scale and is the scaler's search, so any initial ``train.loss_scale`` recovers (as Megatron-LM and
  DeepSpeed); such a skip neither counts nor ends a run of counted skips.

Megatron-LM's ``check_for_nan_in_loss_and_grad`` stops on a NaN; this guard also keeps the bad state
out of checkpoints (the run saves nothing after it) and the checkpoint writers refuse non-finite data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DIVERGED_EXIT = 4  # the run diverged (non-finite loss/gradients, or too many skipped steps): nothing saved


@dataclass
class Verdict:
    skip: bool  # do not apply this step's update
    stop: str | None = None  # why the run must stop now ("non-finite loss", ...), else None
    detail: str = ""  # for the user: "step N: what was seen"


class DivergenceGuard:
    def __init__(self, mode: str = "stop", max_skipped_steps: int = 20):
        self.mode, self.max_skipped_steps = mode, max_skipped_steps
        self.consecutive_skips = 0

    def judge(self, step: int, loss: float, grad_norm: float, scaler) -> Verdict:
        """The verdict for ``step`` (1-based); updates ``scaler`` (float16) exactly once."""
        bad = None
        if not math.isfinite(loss):
            bad = ("non-finite loss", f"loss = {loss}")
        at_minimum = scaler.enabled and scaler.scale <= scaler.min_scale  # the scale this step ran with
        overflow = scaler.update(grad_norm) if scaler.enabled else False  # the scaler's skip: not divergence
        if bad is None and not scaler.enabled and not math.isfinite(grad_norm):
            bad = ("non-finite gradient norm", f"gradient norm = {grad_norm}")
        skip = overflow or bad is not None
        if bad is not None or (overflow and at_minimum):  # the same rule as StepVerdict.decide (verdict.py)
            self.consecutive_skips += 1
        elif not skip:
            self.consecutive_skips = 0
        if bad is not None and self.mode == "stop":
            return Verdict(True, bad[0], f"step {step}: {bad[0]} ({bad[1]})")
        if self.consecutive_skips > self.max_skipped_steps:
            why = (f"float16 loss scale {scaler.scale:g} (its minimum) and the gradients still overflow"
                   if overflow and bad is None else (bad or ("", ""))[1])
            return Verdict(True, "too many skipped steps",
                           f"step {step}: {self.consecutive_skips} consecutive steps skipped, more than "
                           f"train.max_skipped_steps = {self.max_skipped_steps} (the last: {why})")
        return Verdict(skip, None, bad[1] if bad else "")
