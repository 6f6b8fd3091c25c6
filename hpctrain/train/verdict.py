"""The step's verdict on the training device: one world reduction, the decisions on the device, a late host read.

``StepVerdict`` owns the step's small reduction: a float64 vector on the training device, ``[loss,
grad_norm^2, stop slots...]`` (the slots: hpctrain/train/stop.py's one-hot ``STOP_SLOTS``), summed over the
world by one ``Recurring`` all-reduce (a CUDA vector: the group's device backend, NCCL, stream-ordered, no
host read; a host vector: an MPI persistent request). Each rank puts in its share: the loss where it is
counted (tp rank 0 of the last pipeline stage: the world sum is the sum over the replicas dp x cp), its
counted part of the squared gradient norm (``FlatOptimizer.grad_norm_sq_tensor``), its stop request.

``decide`` computes from the reduced values, on the device and so identically on every rank: the gradient
norm, the clip x loss-scale coefficient (a float64 multiplier for ``FlatOptimizer.step``), the skip flag
(``found_inf``: a non-finite loss or norm, or ``stopped``) and two flags that carry the guard's rules
(hpctrain/train/guard.py) while the host has not looked yet: a bad step with ``nonfinite = "stop"``, or
more than ``max_skipped_steps`` consecutive counted skips (a float16 overflow counts only at the minimum
loss scale: guard.py), sets ``stopped``, and every later update is skipped on
the device until the host reads the verdict and stops the run; float16's loss scale moves on the device
(``DynamicLossScaler.update_on_device``). ``start_read`` copies [loss, grad_norm, skipped, loss scale,
stop slots] to (pinned) host memory without blocking and records an event; ``read`` waits on it.
The trainer reads at once or one step late (``Trainer.readback``); the host guard then judges the same
values and must reach the device's skip decision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpctrain.train.stop import STOP_SLOTS, reason_from_slots, stop_slot

LOSS, NORM_SQ, SLOTS = 0, 1, 2  # the reduced vector: loss, squared gradient norm, then the stop slots


@dataclass
class Reading:
    """What the host learns of one step (the same on every rank)."""
    loss: float  # the global mean token loss
    grad_norm: float  # inf when not finite
    skipped: bool  # the device skipped the update
    scale: float  # the loss scale after this step (float16; else 1)
    stop: str  # the agreed stop request ("" when none)


class StepVerdict:
    """Built collectively over ``world`` (a Communicator: one persistent all-reduce on ``device``)."""

    def __init__(self, world, device: torch.device, *, clip: float, nonfinite: str, max_skipped_steps: int,
                 scaler_enabled: bool):
        self.vector = torch.zeros(SLOTS + STOP_SLOTS, dtype=torch.float64, device=device)
        self._sum = world.recurring_allreduce(self.vector)
        self.clip = torch.tensor(float(clip), dtype=torch.float64, device=device) if clip > 0 else None
        self.stop_on_bad, self.max_skipped_steps = nonfinite == "stop", max_skipped_steps
        self.scaler_enabled = scaler_enabled
        self.stopped = torch.zeros((), dtype=torch.bool, device=device)  # sticky: the run must stop
        self.skips = torch.zeros((), dtype=torch.int64, device=device)  # consecutive skipped steps
        self.summary = torch.zeros(4 + STOP_SLOTS, dtype=torch.float64, device=device)
        self.host = torch.zeros(4 + STOP_SLOTS, dtype=torch.float64, pin_memory=device.type == "cuda")
        self.event: torch.cuda.Event | None = None

    def reduce(self, loss_share, norm_sq_share, request: str, overflow: bool | torch.Tensor) -> None:
        """Collective over the world: this rank's shares (0-d tensors or floats) summed into ``vector``.
        ``overflow`` (False, True or a device bool): a compressor dropped inf/NaN (the norm is made inf: every
        rank skips)."""
        v = self.vector
        v.zero_()
        _put(v[LOSS], loss_share)
        if isinstance(overflow, torch.Tensor):
            norm_sq_share = torch.where(overflow, float("inf"), norm_sq_share)
        _put(v[NORM_SQ], float("inf") if overflow is True else norm_sq_share)
        slot = stop_slot(request)
        if slot is not None:
            v[SLOTS + slot].fill_(1.0)
        self._sum()

    def decide(self, scaler) -> tuple[torch.Tensor | float, torch.Tensor]:
        """On the device: (the gradient coefficient, float64 0-d: clip / (norm + 1e-6) capped at 1, over the
        float16 loss scale; the number 1.0 without clipping and loss scale, so the fused AdamW does not rewrite
        the gradients; found_inf, float32 0-d: 1.0 skips the update). Updates the sticky flags, the
        ``scaler``'s device scale (float16: an overflow halves it) and the summary."""
        loss, norm_sq = self.vector[LOSS], self.vector[NORM_SQ]
        finite_loss, finite_norm = torch.isfinite(loss), torch.isfinite(norm_sq)
        grad_norm = torch.where(finite_norm, norm_sq.sqrt(), float("inf"))
        skip_now = ~(finite_loss & finite_norm)
        bad = ~finite_loss if self.scaler_enabled else skip_now  # float16: an overflow is the scaler's, not bad
        skip = skip_now | self.stopped
        counted = skip_now  # guard.py's rule: a float16 overflow above the minimum scale is the scaler's search
        if self.scaler_enabled:
            counted = ~finite_loss | (skip_now & (scaler.scale_tensor <= scaler.min_scale))
        self.skips.copy_(torch.where(counted, self.skips + 1, torch.where(skip_now, self.skips, 0)))
        self.stopped.logical_or_((bad & self.stop_on_bad) | (self.skips > self.max_skipped_steps))
        coef = 1.0 if self.clip is None else torch.clamp(torch.div(self.clip, grad_norm + 1e-6), max=1.0)
        if self.scaler_enabled:
            coef = coef / scaler.scale_tensor
            scaler.update_on_device(finite_norm)
        self.summary[0], self.summary[1], self.summary[2] = loss, grad_norm, skip
        self.summary[3] = scaler.scale_tensor
        self.summary[4:] = self.vector[SLOTS:]
        return coef, skip.to(torch.float32)

    def start_read(self) -> None:
        """Queue the summary's copy to the host (no wait on CUDA)."""
        self.host.copy_(self.summary, non_blocking=True)
        if self.summary.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def judge(self, metrics, guard, scaler, reducer):
        """Read the last ``start_read`` into ``metrics`` (loss, grad_norm, skipped, loss_scale): the host ``guard``
        judges the agreed values as the device did (and moves the float16 ``scaler``), the ``reducer`` learns
        the outcome. Returns (the guard's Verdict, the agreed stop request)."""
        reading, old_scale = self.read(), scaler.scale
        verdict = guard.judge(metrics.step, reading.loss, reading.grad_norm, scaler)
        if verdict.skip != reading.skipped or scaler.scale != reading.scale:
            raise RuntimeError(f"step {metrics.step}: the device's verdict (skip {reading.skipped}, loss scale "
                               f"{reading.scale}) is not the host's (skip {verdict.skip}, {scaler.scale})")
        reducer.after_step(verdict.skip, scaler.scale / old_scale)
        metrics.loss, metrics.grad_norm, metrics.skipped = reading.loss, reading.grad_norm, verdict.skip
        metrics.loss_scale = scaler.scale
        return verdict, reading.stop

    def read(self) -> Reading:
        """The values of the last ``start_read`` (waits for its copy)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        values = self.host.tolist()
        return Reading(values[0], values[1], values[2] > 0, values[3], reason_from_slots(values[4:]))


def _put(element: torch.Tensor, value) -> None:
    """``element`` (a 0-d view) = ``value`` without a host wait: a tensor is copied on the device, a Python
    number filled in (``v[i] = 0.0`` would lift it into a host tensor and copy that over: a synchronous
    host-to-device copy on a GPU)."""
    if isinstance(value, torch.Tensor):
        element.copy_(value)
    else:
        element.fill_(value)
