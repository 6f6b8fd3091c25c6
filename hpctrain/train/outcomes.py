"""One owner of what each step came to: the device's verdict, when the host reads it, and the finished steps.

``StepOutcomes`` holds the step's ``StepVerdict`` (hpctrain/train/verdict.py: one world reduction and every
decision, on the device) and the host's side of it: the step whose verdict is still in flight
(``pending``), the steps read so far (``take_finished``), the run's stop (``diverged``: a ``Divergence``,
worded by guard.py) and the agreed stop request (``agreed_stop``). Reading a step's verdict copies the
device's loss scale into the host scaler and tells the gradient reducer whether the update was skipped.

When the host reads is decided once, by the builder asking the reducer and the optimizer
(hpctrain/train/build.py):

- ``read_before_update`` (1-bit Adam: the reducer commits its averaged momentum, or drops it, before the
  optimizer runs, and the frozen steps take the skip on the host): the verdict is read between the
  decision and the update; a skipped step runs no update;
- else the update is queued first, and the verdict is read right after it, or, where the reducer keeps no
  state that must learn of it (``may_defer``: the dense reduction), one step later with
  ``after_update(defer=True)``: the host then never waits on the device inside a step.

A stop request is answered ``lag_steps`` after the step that carried it (hpctrain/train/stop.py).
"""
from __future__ import annotations

from typing import Any

import torch

from hpctrain.train.guard import Divergence, divergence
from hpctrain.train.step_metrics import StepMetrics
from hpctrain.train.verdict import StepVerdict


class StepOutcomes:
    """Built collectively over ``world`` (the verdict's all-reduce) on ``device``. ``scaler``: the run's
    ``DynamicLossScaler``; ``reducer``: the ``GradReducer`` that learns each step's outcome (``after_step``);
    ``read_before_update``, ``may_defer``: when the host reads (the module docstring)."""

    def __init__(self, world, device: torch.device, scaler, reducer, *, read_before_update: bool, may_defer: bool,
                 clip: float, nonfinite: str, max_skipped_steps: int):
        self.verdict = StepVerdict(world, device, clip=clip, nonfinite=nonfinite,
                                   max_skipped_steps=max_skipped_steps, scaler_enabled=scaler.enabled)
        self.scaler, self.reducer, self.max_skipped_steps = scaler, reducer, max_skipped_steps
        self.read_before_update, self.may_defer = read_before_update, may_defer and not read_before_update
        self.pending: StepMetrics | None = None  # the step whose verdict is queued but not read
        self.diverged: Divergence | None = None  # the run's stop, once read (every rank alike)
        self.agreed_stop = ""  # the agreed stop request, once read
        self._finished: list[StepMetrics] = []

    @property
    def lag_steps(self) -> int:
        """Steps between a stop request's step and the step after which the run stops."""
        return 2 if self.may_defer else 1

    def decide(self, loss_share: Any, norm_sq_share: Any, stop_request: str, overflow: Any) -> tuple[Any, Any]:
        """Collective over the world: the step's reduction and decisions (``StepVerdict.reduce``, ``decide``).
        Returns (the gradient coefficient, found_inf) for the optimizer, both on the device."""
        self.verdict.reduce(loss_share, norm_sq_share, stop_request, overflow)
        return self.verdict.decide(self.scaler)

    def before_update(self, metrics: StepMetrics) -> bool:
        """With ``read_before_update``: read ``metrics``' verdict now; True if the update must not run."""
        if not self.read_before_update:
            return False
        self.verdict.start_read()
        self._read(metrics)
        return bool(metrics.skipped)

    def after_update(self, metrics: StepMetrics, defer: bool) -> None:
        """The update of ``metrics``' step is queued: finish the previous step's read (long done on the
        device: no wait in steady state) and queue this one's; read it now unless ``defer`` and ``may_defer``.
        After a stop nothing more is read: later updates were skipped on the device."""
        if self.read_before_update:
            return
        self.read_pending()
        if self.diverged is None:
            self.verdict.start_read()
            self.pending = metrics
            if not (defer and self.may_defer):
                self.read_pending()

    def read_pending(self) -> None:
        """Read the deferred step's verdict now (waits for the device); nothing once the run stopped."""
        if self.pending is not None and self.diverged is None:
            metrics, self.pending = self.pending, None
            self._read(metrics)

    def take_finished(self) -> list[StepMetrics]:
        """The steps read since the last call, in step order (the same on every rank)."""
        finished, self._finished = self._finished, []
        return finished

    def _read(self, metrics: StepMetrics) -> None:
        """``metrics``' verdict (its ``start_read``) into it; the scaler follows the device's scale, the reducer
        learns the outcome (a skipped step's compression memory dropped, a new scale applied)."""
        reading, old_scale = self.verdict.read(), self.scaler.scale
        self.scaler.follow(reading.scale, reading.good_steps)
        self.reducer.after_step(reading.skipped, self.scaler.scale / old_scale)
        metrics.loss, metrics.grad_norm, metrics.skipped = reading.loss, reading.grad_norm, reading.skipped
        metrics.loss_scale = self.scaler.scale
        self.agreed_stop = self.agreed_stop or reading.stop
        self.diverged = self.diverged or divergence(metrics.step, reading, self.max_skipped_steps,
                                                    self.scaler.enabled)
        self._finished.append(metrics)
