"""The gradient-reduction seam of the data-parallel engine (``FlatParams`` calls it per bucket).

Contract. On every rank of the dp group, in the same bucket order, once per step and bucket:
``start(bucket)`` when the bucket's main grads (``bucket.grads``, summed over micro-batches; at ZeRO >= 2
one micro-batch's, the call made once per micro-batch) are final, returning a handle with ``test()`` (drive progress, never block) and
``wait()``; ``finish(bucket)`` after which the SUM over the dp group is in place: the bucket's main grads
without ZeRO, ``bucket.slice_out`` (this rank's 1/dp block: ``slice_grad``, or where FlatParams adds it
from) with ZeRO. ``begin_step`` /
``after_step`` bracket a step; ``state_dict`` is what a checkpoint must keep for an exact resume
(error-feedback residuals, PowerSGD's Q); ``step_stats`` feeds metrics.jsonl.

``DenseReducer``: all-reduce (or ZeRO-1 reduce-scatter) in the main grads' dtype, non-blocking.
``CompressedReducer``: a compressor + error feedback + a strategy from ``exchange.py``, on the dp group
(``scope = "all"``) or, with ``scope = "inter-node"``, dense reduce-scatter inside each node, the
compressed sum across nodes on 1/L of the bucket (L ranks per node), then an all-gather inside the node.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hpctrain.compression.exchange import STRATEGIES, Stopwatch, own_block
from hpctrain.compression.memory import ErrorFeedback

if TYPE_CHECKING:
    from hpctrain.comm.collectives import Communicator


class Done:
    """The handle of a reduction already complete."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class GradReducer:
    """The replica group's gradient reduction, bucket by bucket. What the step asks of it
    (hpctrain/train/build.py, hpctrain/train/outcomes.py): whether it must learn a step's outcome
    (``after_step``) before the update runs (``outcome_before_update``) or before the next step
    (``outcome_before_next_step``; else the host may read the verdict a step late), and whether the
    optimizer takes its momentum from it (``shares_momentum``)."""
    outcome_before_update = False
    outcome_before_next_step = False
    shares_momentum = False

    def __init__(self, flat):
        self.flat, self.comm = flat, flat.dp_comm
        self.step = 0
        self.dense_bytes = self.sent_bytes = 0  # this step: what dense would send / what was sent
        self.clock = Stopwatch(flat.timer)
        self.overflow: bool | torch.Tensor = False  # a bucket had inf/NaN: False, or a device bool (float16 runs; see note_nonfinite)
        self.loss_scale = 1.0

    def begin_step(self, step: int, loss_scale: float = 1.0) -> None:
        """``loss_scale``: the factor this step's main grads carry (float16 runs; 1 otherwise)."""
        self.step, self.overflow, self.loss_scale = step, False, loss_scale
        self.dense_bytes = self.sent_bytes = 0
        self.clock.seconds = 0.0

    def note_nonfinite(self, x: torch.Tensor) -> None:
        """float16 runs (``flat.check_finite``): fold "``x`` holds inf/NaN" into ``overflow`` on the device, with
        no host read in the backward; the step's verdict turns it into an infinite norm (every rank skips)."""
        if self.flat.check_finite:
            bad = ~torch.isfinite(x).all()
            self.overflow = bad if self.overflow is False else self.overflow | bad

    def start(self, bucket):
        before = self.comm.stats.total_sent()
        handle = self._start(bucket)
        self.sent_bytes += self.comm.stats.total_sent() - before
        p, nbytes = self.comm.size, bucket.grads.nbytes
        self.dense_bytes += int(nbytes * (p - 1) / p * (1 if self.flat.zero else 2))
        return handle

    def finish(self, bucket) -> None:
        before = self.comm.stats.total_sent()
        self._finish(bucket)
        self.sent_bytes += self.comm.stats.total_sent() - before

    def after_step(self, skipped: bool, scale_ratio: float = 1.0) -> None:
        """After the optimizer decision: a skipped step's compression memory is dropped; a changed
        loss scale rescales it."""

    def step_stats(self) -> dict:
        ratio = self.dense_bytes / self.sent_bytes if self.sent_bytes else 1.0
        return {"compression_ratio": ratio, "compress_s": self.clock.seconds}

    def bind_optimizer(self, optimizer) -> None:
        """Called once the optimizer exists (a reducer that shares state with it: onebit-adam)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def signature(self) -> dict:
        """What must match for ``state_dict`` to be restored as is (see docs/compression.md)."""
        return {}

    def grads(self, bucket) -> torch.Tensor:
        return bucket.grads

    def _start(self, bucket):
        raise NotImplementedError

    def _finish(self, bucket) -> None:
        raise NotImplementedError


class DenseReducer(GradReducer):
    def _start(self, bucket):
        if self.flat.zero:
            return self.comm.reduce_scatter(bucket.slice_out, self.grads(bucket), nonblocking=True)
        return self.comm.allreduce(self.grads(bucket), nonblocking=True)

    def _finish(self, bucket) -> None:
        bucket.handle.wait()


class CompressedReducer(GradReducer):
    """``compressor`` (a ``base.Compressor``) with error feedback when ``cfg.error_feedback``."""
    outcome_before_next_step = True  # a skipped step's error memory is dropped, a new loss scale applied

    def __init__(self, flat, cfg, compressor, *, seed: int = 0, node_comms=None):
        super().__init__(flat)
        self.cfg, self.compressor, self.seed = cfg, compressor, seed
        self.dense = DenseReducer(flat)
        self.memory = ErrorFeedback() if cfg.error_feedback else None
        self.intra: Communicator | None
        self.intra, self.inter = node_comms if node_comms else (None, self.comm)
        self.strategy = STRATEGIES[compressor.strategy] if compressor is not None else None
        self._running: dict[int, Any] = {}  # bucket index -> reduction in flight (None: dense this step)

    def _dense_now(self, bucket) -> bool:
        return self.step < self.cfg.warmup_steps or bucket.size < self.cfg.min_numel or self.inter.size == 1

    def _start(self, bucket):
        if self._dense_now(bucket):
            self._running[bucket.index] = None
            return self.dense._start(bucket)
        return self._start_compressed(bucket, self.grads(bucket), slice_only=self.flat.zero)

    def _start_compressed(self, bucket, x: torch.Tensor, *, slice_only: bool):
        """The compressed sum of ``x`` (this rank's bucket-sized contribution) over the group, launched;
        ``slice_only``: only this rank's ZeRO-1 block of the sum is wanted."""
        if self.intra is not None:  # dense inside the node first: this rank sums 1/L of the bucket
            part = torch.empty(x.numel() // self.intra.size, dtype=x.dtype, device=x.device)
            self.intra.reduce_scatter(part, x)
            x = part
        self.note_nonfinite(x)
        key = f"worker/{bucket.index}"
        corrected = self.memory.corrected(key, x) if self.memory is not None else x
        assert self.strategy is not None  # a compressor was given
        reduction = self.strategy(self.inter, self.compressor, corrected, clock=self.clock,
                                  slice_only=slice_only and self.intra is None,
                                  server_memory=self.memory, server_key=f"server/{bucket.index}",
                                  key=(self.seed, self.step, bucket.index))
        if self.memory is not None:
            self.memory.remember(key, corrected, reduction.local)
        self._running[bucket.index] = reduction
        return reduction

    def _finish(self, bucket) -> None:
        reduction = self._running.pop(bucket.index)
        if reduction is None:
            return self.dense._finish(bucket)
        result = self._finish_compressed(bucket, reduction)
        if self.flat.zero:
            bucket.slice_grad.copy_(result if result.numel() == bucket.slice_grad.numel()
                                    else own_block(result, self.comm))
        else:
            self.grads(bucket).copy_(result)

    def _finish_compressed(self, bucket, reduction) -> torch.Tensor:
        """The sum of a compressed reduction: the whole bucket, or this rank's block (ZeRO-1 slice_only)."""
        result = reduction.finish()
        if self.intra is not None:
            full = torch.empty(bucket.size, dtype=result.dtype, device=result.device)
            self.intra.allgather(full, result.contiguous())
            result = full
        return result

    def after_step(self, skipped: bool, scale_ratio: float = 1.0) -> None:
        if self.memory is None:
            return
        if skipped:
            self.memory.clear()
        elif scale_ratio != 1.0:
            self.memory.rescale(scale_ratio)

    def state_dict(self):
        return dict(self.memory.residuals) if self.memory is not None else {}

    def load_state_dict(self, state):
        if self.memory is not None:
            self.memory.residuals = {k: v.to(self.flat.device) for k, v in state.items()}

    def signature(self) -> dict:
        c = self.cfg
        return {"method": c.method, "scope": c.scope, "error_feedback": c.error_feedback,
                "buckets": [(b.start, b.end) for b in self.flat.buckets], "dp": self.comm.size,
                "node_split": None if self.intra is None else [self.intra.size, self.inter.size]}
