"""1-bit Adam (Tang et al., arXiv 2102.02888; DeepSpeed's OnebitAdam): AdamW's MOMENTUM is what is
compressed, after ``compression.warmup_steps`` of dense AdamW, with the second moment frozen.

Per bucket, over the replica group of size p (grid.replica_axis), after the warm-up (the optimizer has
made ``warmup_steps`` steps; with ZeRO-1 too):

  c_r   = beta1 m / p + (1 - beta1) g_r / S       this rank's share of the new momentum (g_r: its own
                                                  unreduced main grads, S: the loss scale; sum_r c_r is
                                                  AdamW's  beta1 m + (1 - beta1) g  for the summed g)
  m'    = sum_r onebit(c_r + worker error)        compressed all-to-all (sign + a scale per 2048 values), each
                                                  chunk's sum re-compressed with the SERVER error and
                                                  all-gathered (exchange.AlltoallSum, never slice-only):
                                                  the same bits on every rank, also with ZeRO-1
  grads = S (m' - beta1 m) / (1 - beta1)          the gradient m' implies (for the norm, the non-finite
                                                  check and metrics; clipping does not apply)

``after_step`` commits m' into the optimizer's momentum (``FlatOptimizer.full_momentum``: the whole
bucket on every rank, ZeRO-1 included) unless the step was skipped; the optimizer then updates the
parameters from it and the frozen variance (``FlatOptimizer``, ``frozen_adam_update_``). Vocabulary
and bucket padding are masked out of m' (1 bit cannot say zero). Error buffers are in momentum units
(the loss scale never enters them): ``worker/<bucket>`` (bucket-sized) and ``server/<bucket>`` (this
rank's chunk), checkpoint state like every method's. The momentum and variance are AdamW's own state.
"""
from __future__ import annotations

from typing import Any

import torch

from hpctrain.compression.reducer import CompressedReducer


class OneBitAdamReducer(CompressedReducer):
    def __init__(self, flat, cfg, compressor, *, seed: int = 0, node_comms=None):
        super().__init__(flat, cfg, compressor, seed=seed, node_comms=node_comms)
        self.optimizer: Any = None  # optim's FlatOptimizer (bind_optimizer): a layer above, not imported
        self.pending: dict[int, torch.Tensor] = {}  # bucket index -> m' of this step, until after_step
        self.synced = False  # the full momentum is the same on every rank (ZeRO-1: gathered once)
        self.masks = {b.index: self._real_elements(b) for b in flat.buckets}

    def _real_elements(self, bucket) -> torch.Tensor:
        """1 on the bucket's parameter elements, 0 on vocabulary and bucket padding."""
        flat = self.flat
        mask = torch.zeros(bucket.size, dtype=flat.grad_dtype, device=flat.device)
        for lo, hi in flat.param_ranges(bucket.start, bucket.end, lambda p: True):
            mask[lo:hi] = 1
        for lo, hi in flat.padding_ranges(bucket.start, bucket.end):
            mask[lo:hi] = 0
        return mask

    outcome_before_update = True  # it commits (or drops) its averaged momentum before the optimizer runs
    shares_momentum = True  # the optimizer takes the momentum this reducer averaged (``momentum_from_reducer``)

    def bind_optimizer(self, optimizer) -> None:
        self.optimizer = optimizer

    @property
    def compressing(self) -> bool:
        """After the warm-up: the optimizer has made ``warmup_steps`` (dense AdamW) steps."""
        return self.optimizer is not None and self.optimizer.step_count >= self.cfg.warmup_steps

    def _dense_now(self, bucket) -> bool:
        return not self.compressing

    def begin_step(self, step: int, loss_scale: float = 1.0) -> None:
        super().begin_step(step, loss_scale)
        self.pending.clear()
        if self.compressing and not self.synced:
            self._sync_momentum()

    def _sync_momentum(self) -> None:
        """ZeRO-1: each rank's optimizer updated (or loaded) only its block of the momentum; all-gather the
        blocks once (at the freeze, or the first step after a resume), in place, over the replica group."""
        if self.flat.zero:
            for bucket in self.flat.buckets:
                self.comm.allgather(self.optimizer.full_momentum[bucket.index], None)
        self.synced = True

    def _start(self, bucket):
        if self._dense_now(bucket):
            return super()._start(bucket)
        beta1, p = self.optimizer.cfg.beta1, self.comm.size
        momentum = self.optimizer.full_momentum[bucket.index].to(self.flat.grad_dtype)
        with self.clock:
            share = momentum * (beta1 / p) + self.grads(bucket) * ((1 - beta1) / self.loss_scale)
        return self._start_compressed(bucket, share, slice_only=False)

    def _finish(self, bucket) -> None:
        reduction = self._running.pop(bucket.index)
        if reduction is None:
            return self.dense._finish(bucket)
        averaged = self._finish_compressed(bucket, reduction) * self.masks[bucket.index]
        beta1 = self.optimizer.cfg.beta1
        momentum = self.optimizer.full_momentum[bucket.index]
        implied = (averaged - beta1 * momentum.to(averaged.dtype)) * (self.loss_scale / (1 - beta1))
        self.grads(bucket).copy_(implied)
        if self.flat.zero:
            n = bucket.size // self.comm.size
            bucket.slice_grad.copy_(implied[self.comm.rank * n:(self.comm.rank + 1) * n])
        self.pending[bucket.index] = averaged

    def after_step(self, skipped: bool, scale_ratio: float = 1.0) -> None:
        """Commit this step's averaged momentum (a skipped step drops it and the error buffers). The error
        buffers are in momentum units: a new loss scale leaves them alone."""
        if skipped:
            if self.memory is not None:
                self.memory.clear()
        else:
            for index, averaged in self.pending.items():
                self.optimizer.full_momentum[index].copy_(averaged)
        self.pending.clear()
