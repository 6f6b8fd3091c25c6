"""The step's verdict on the training device: one world reduction, the decisions on the device, a late host read.

``StepVerdict`` owns the step's small reduction: a float64 vector on the training device, ``[loss,
grad_norm^2, stop slots...]`` (the slots: hpctrain/train/stop.py's one-hot ``STOP_SLOTS``), summed over the
world by one ``Recurring`` all-reduce (a CUDA vector: the group's device backend, NCCL, stream-ordered, no
host read; a host vector: an MPI persistent request). Each rank puts in its share: the loss where it is
counted (tp rank 0 of the last pipeline stage: the world sum is the sum over the replicas dp x cp), its
counted part of the squared gradient norm (``FlatOptimizer.grad_norm_sq_tensor``), its stop request.

``decide`` makes THE decisions of the step, on the device and so identically on every rank; nothing on
the host decides them again:

- the gradient norm and the clip x loss-scale coefficient (a float64 multiplier for ``FlatOptimizer.step``);
- skip (``found_inf``): a non-finite loss or norm, or the run already stopped;
- float16's loss scale (``DynamicLossScaler.update_on_device``): an overflow halves it, down to its minimum;
- stop (sticky; every later update is skipped until the host reads it and ends the run): a bad step (a
  non-finite loss; without float16 also a non-finite norm) with ``train.nonfinite = "stop"``, or more than
  ``max_skipped_steps`` consecutive counted skips. A float16 overflow counts only when the step ran at the
  minimum scale: above it the skip is the scaler's search, so any initial ``train.loss_scale`` recovers (as
  in Megatron-LM and DeepSpeed), and such a skip neither counts nor ends a run of counted skips.

``start_read`` copies the step's summary (``Reading``'s fields) to (pinned) host memory without blocking and
records an event; ``read`` waits on it. When the host reads is ``StepOutcomes``' business
(hpctrain/train/outcomes.py); what it prints about a stop, guard.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpctrain.train.stop import STOP_SLOTS, reason_from_slots, stop_slot

LOSS, NORM_SQ, SLOTS = 0, 1, 2  # the reduced vector: loss, squared gradient norm, then the stop slots
SUMMARY = 7  # the summary: loss, grad_norm, skipped, scale, good_steps, skips, stop_code; then the stop slots
# why the device stopped the run (``Reading.stop_code``; guard.py words it): 0 = it did not
NONFINITE_LOSS, NONFINITE_NORM, TOO_MANY_SKIPS = 1, 2, 3


@dataclass
class Reading:
    """What the host learns of one step (the same on every rank)."""
    loss: float  # the global mean token loss
    grad_norm: float  # inf when not finite
    skipped: bool  # the device skipped the update
    scale: float  # the loss scale after this step (float16; else 1)
    good_steps: int  # the scaler's count of good steps after this step (float16; else 0)
    skips: int  # consecutive counted skips after this step
    stop_code: int  # why the run stopped at this step: NONFINITE_LOSS, NONFINITE_NORM, TOO_MANY_SKIPS; 0: it did not
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
        self.summary = torch.zeros(SUMMARY + STOP_SLOTS, dtype=torch.float64, device=device)
        self.host = torch.zeros(SUMMARY + STOP_SLOTS, dtype=torch.float64, pin_memory=device.type == "cuda")
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
        counted = skip_now  # a float16 overflow above the minimum scale is the scaler's search: not counted
        if self.scaler_enabled:
            counted = ~finite_loss | (skip_now & (scaler.scale_tensor <= scaler.min_scale))
        self.skips.copy_(torch.where(counted, self.skips + 1, torch.where(skip_now, self.skips, 0)))
        stop_bad = bad & self.stop_on_bad
        code = torch.where(stop_bad, torch.where(finite_loss, NONFINITE_NORM, NONFINITE_LOSS),
                           torch.where(self.skips > self.max_skipped_steps, TOO_MANY_SKIPS, 0))
        code = torch.where(self.stopped, 0, code)  # stopped earlier: that step carries the reason
        self.stopped.logical_or_(code > 0)
        coef = 1.0 if self.clip is None else torch.clamp(torch.div(self.clip, grad_norm + 1e-6), max=1.0)
        if self.scaler_enabled:
            coef = coef / scaler.scale_tensor
            scaler.update_on_device(finite_norm)
        self.summary[0], self.summary[1], self.summary[2] = loss, grad_norm, skip
        self.summary[3], self.summary[4] = scaler.scale_tensor, scaler.good_tensor
        self.summary[5], self.summary[6] = self.skips, code
        self.summary[SUMMARY:] = self.vector[SLOTS:]
        return coef, skip.to(torch.float32)

    def start_read(self) -> None:
        """Queue the summary's copy to the host (no wait on CUDA)."""
        self.host.copy_(self.summary, non_blocking=True)
        if self.summary.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> Reading:
        """The values of the last ``start_read`` (waits for its copy)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        values = self.host.tolist()
        return Reading(values[0], values[1], values[2] > 0, values[3], int(values[4]), int(values[5]), int(values[6]),
                       reason_from_slots(values[SUMMARY:]))


def _put(element: torch.Tensor, value) -> None:
    """``element`` (a 0-d view) = ``value`` without a host wait: a tensor is copied on the device, a Python
    number filled in (``v[i] = 0.0`` would lift it into a host tensor and copy that over: a synchronous
    host-to-device copy on a GPU)."""
    if isinstance(value, torch.Tensor):
        element.copy_(value)
    else:
        element.fill_(value)
