"""Data parallelism: flat parameter/gradient buffers, bucketed gradient reduction overlapped with backward,
and the ZeRO-1 slice layout. All reductions run on the DP group.

Layout. A stage's parameters are re-pointed into one flat ``param_buffer``; their gradients are
accumulated (over micro-batches) into a flat ``grad_buffer`` ("main grads": float32 for half-precision
models). Both are cut into buckets of about ``bucket_mb``, in reverse parameter order (the order
backward produces them), each padded to a multiple of dp. A rank OWNS a range of each bucket: the
whole bucket without ZeRO, its 1/dp slice with ZeRO-1. The optimizer updates owned ranges only.

Reduction. A backward hook per parameter copies its step's first grad into the main-grad view, adds later
ones (no zeroing pass: ``_settle`` zeroes what got no grad, and the padding, before a bucket is read); on the
last micro-batch, once every parameter of a bucket has reported, the bucket's non-blocking reduction
starts through ``self.reducer`` (a ``hpctrain.compression.GradReducer``: dense all-reduce SUM, or
reduce-scatter into each bucket's ``slice_grad`` with ZeRO, by default; a compressed reducer with
``[compression]``) while backward continues; hooks call ``test()`` on pending handles to drive MPI
progress. ``finish_reduction`` completes all.
Gradients are SUMMED over dp: the loss is already divided by the global token count.

Vocabulary padding. The padding rows of the embedding and LM head (``SlabSpec.padded_dim``) sit in the
buffers like any element; their grads are zero, and are set to zero again after the reduction (a lossy
compressor could make them noise), so the optimizer never moves them and the grad norm never sees them.

Deferred bucket. Grads that need a reduction over ANOTHER group first (``SlabSpec.partial_grad_over_tp``:
sequence-parallel norm weights, LoRA's A of column-parallel and B of row-parallel linears, partial per TP
rank, summed over tp in ONE all-reduce of their contiguous span; the last stage's copy of a tied
embedding: summed with stage 0 over PP) live in a last bucket that ``finish_reduction`` starts after
those pre-reductions.

Frozen parameters (a LoRA run's base weights) are not given to FlatParams: no gradient buffer, no
reduction, no optimizer state.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hpctrain.compression.reducer import DenseReducer, GradReducer
from hpctrain.profiling.timers import NULL_TIMER

TIED_GRAD_TAG = 23  # beside the pipeline's ACT_TAG = 21, GRAD_TAG = 22 on the same pp communicator


def intersect(lo: int, hi: int, start: int, end: int) -> tuple[int, int] | None:
    """The overlap of flat ranges [lo, hi) and [start, end), or None: the one range helper."""
    a, b = max(lo, start), min(hi, end)
    return (a, b) if a < b else None


@dataclass(frozen=True)
class ParamPiece:
    """The part of parameter ``param`` that lies in flat [flat_lo, flat_hi); ``param_lo`` is where that
    part starts inside the parameter's own flattened slab (so param elements [param_lo, param_hi))."""

    param: torch.nn.Parameter
    flat_lo: int
    flat_hi: int
    param_lo: int

    @property
    def param_hi(self) -> int:
        return self.param_lo + self.flat_hi - self.flat_lo


@dataclass
class Bucket:
    start: int  # range in the flat buffers
    end: int  # padded end
    params: list = field(default_factory=list)
    deferred: bool = False
    pending: int = 0
    handle: Any = None  # the reducer's reduction in flight (test/wait), None when idle
    slice_grad: torch.Tensor | None = None  # ZeRO: this rank's reduced slice
    index: int = 0  # position in FlatParams.buckets (the reducer's key for per-bucket state)

    @property
    def size(self) -> int:
        return self.end - self.start


class FlatParams:
    """Flat buffers, buckets and the DP gradient reducer of one pipeline stage's parameters.

    Everything is fixed at construction: ``timer`` (the trainer's PhaseTimer), ``check_finite`` (float16
    runs: compressed reducers flag inf/NaN as ``GradReducer.overflow``) and ``reducer``, built LAST by
    ``make_reducer(self)`` once the buffers, buckets and timer exist (default: the dense reducer; the
    Trainer passes one of ``hpctrain.compression.build_reducer``)."""

    def __init__(self, params: list, dp_comm, *, tp_comm=None, pp_comm=None, bucket_mb: float = 25.0, zero: bool = False,
                 grad_dtype: torch.dtype | None = None, timer=NULL_TIMER, check_finite: bool = False,
                 make_reducer: Callable[[FlatParams], GradReducer] = DenseReducer):
        self.params, self.dp_comm, self.tp_comm, self.pp_comm, self.zero = list(params), dp_comm, tp_comm, pp_comm, zero
        self.timer, self.check_finite = timer, check_finite
        self.dp_size = 1 if dp_comm is None else dp_comm.size
        self.dp_rank = 0 if dp_comm is None else dp_comm.rank
        param_dtype = self.params[0].dtype
        self.grad_dtype = grad_dtype or (torch.float32 if param_dtype in (torch.float16, torch.bfloat16)
                                         else param_dtype)
        self.buckets = self._make_buckets(bucket_mb * 2**20 / torch.empty((), dtype=self.grad_dtype).element_size())
        total = self.buckets[-1].end if self.buckets else 0
        self.device = device = self.params[0].device  # buffers live where the parameters are
        self.param_buffer = torch.zeros(total, dtype=param_dtype, device=device)
        self.grad_buffer = torch.zeros(total, dtype=self.grad_dtype, device=device)
        self._offsets, self.bucket_of = {}, {}
        for bucket in self.buckets:
            offset = bucket.start
            for p in bucket.params:
                n = p.numel()
                view = self.param_buffer[offset:offset + n].view_as(p)
                view.copy_(p.data)
                p.data = view
                p.main_grad = self.grad_buffer[offset:offset + n].view_as(p)
                self._offsets[id(p)] = (offset, n)
                self.bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
                offset += n
            if zero:
                bucket.slice_grad = torch.zeros(bucket.size // self.dp_size, dtype=self.grad_dtype, device=device)
        self.last_microbatch = False
        self._unwritten: set[int] = set(self._offsets)  # ids of the parameters with no grad yet this step
        # each bucket's padding past its parameters, [lo, hi) in the flat buffers (only with dp > 1)
        self._bucket_padding = {b.index: (b.start + sum(p.numel() for p in b.params), b.end) for b in self.buckets}
        # vocabulary padding rows inside the owned ranges: their reduced grads are zeroed (a lossy
        # compressor, e.g. onebit, may turn the zeros into noise), so they stay zero and never count
        self._owned_padding = [(b, lo, hi, pads) for b, lo, hi in self.owned_ranges()
                               if (pads := self.padding_ranges(lo, hi))]
        self.reducer = make_reducer(self)  # last: it reads the buckets, buffers and timer

    def _make_buckets(self, bucket_elems: float) -> list[Bucket]:
        def needs_pre_reduction(p):
            return p.spec.partial_grad_over_tp or bool(p.spec.tied)

        ordered = list(reversed(self.params))
        regular = [p for p in ordered if not needs_pre_reduction(p)]
        # the grads partial over tp first: one contiguous span, summed by one all-reduce (_pre_reduce)
        deferred = sorted((p for p in ordered if needs_pre_reduction(p)), key=lambda p: not p.spec.partial_grad_over_tp)
        buckets: list[Bucket] = []
        start = 0
        groups: list[tuple[list, bool]] = []
        current: list = []
        for p in regular:
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_elems:
                groups.append((current, False))
                current = []
        if current:
            groups.append((current, False))
        if deferred:
            groups.append((deferred, True))
        for members, is_deferred in groups:
            n = sum(p.numel() for p in members)
            padded = -(-n // self.dp_size) * self.dp_size
            buckets.append(Bucket(start, start + padded, members, is_deferred, index=len(buckets)))
            start += padded
        return buckets

    # ---------------------------------------------------------------- one step
    def start_step(self) -> None:
        """Reset bucket readiness; every parameter's next grad is its first of the step (copied, not added:
        the main grads are not zeroed, ``_settle`` zeroes what got no grad before a reduction reads it)."""
        self.last_microbatch = False
        self._unwritten = set(self._offsets)
        for bucket in self.buckets:
            bucket.pending, bucket.handle = len(bucket.params), None

    def _on_grad_ready(self, p) -> None:
        if id(p) in self._unwritten:  # the step's first grad: the same values as 0 + grad
            self._unwritten.discard(id(p))
            p.main_grad.copy_(p.grad)
        else:
            p.main_grad.add_(p.grad)
        p.grad = None
        if not self.last_microbatch:
            return
        bucket = self.bucket_of[id(p)]
        if not bucket.deferred:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)
        self.progress()

    def progress(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.test()

    def _settle(self, bucket: Bucket) -> None:
        """Before anything reads the bucket: zero the main grads of its parameters with no grad this step and its
        padding (a compressed reducer writes the whole bucket). Idempotent."""
        for p in bucket.params:
            if id(p) in self._unwritten:
                self._unwritten.discard(id(p))
                p.main_grad.zero_()
        lo, hi = self._bucket_padding[bucket.index]
        if lo < hi:
            self.grad_buffer[lo:hi].zero_()

    def _launch(self, bucket: Bucket) -> None:
        self._settle(bucket)
        if self.dp_size == 1:
            if self.zero:
                assert bucket.slice_grad is not None  # ZeRO: every bucket has its slice
                bucket.slice_grad.copy_(self.grad_buffer[bucket.start:bucket.end])
            return
        bucket.handle = self.reducer.start(bucket)

    def finish_reduction(self) -> None:
        """After the last micro-batch's backward: pre-reduce deferred grads, reduce them, wait for all."""
        for bucket in self.buckets:
            if bucket.deferred:
                self._settle(bucket)
                self._pre_reduce(bucket)
                self._launch(bucket)
            elif bucket.handle is None and bucket.pending > 0:
                self._launch(bucket)  # a bucket whose hooks did not all fire (unused parameters)
        for bucket in self.buckets:
            if bucket.handle is not None:
                self.reducer.finish(bucket)
        for bucket, start, end, pads in self._owned_padding:
            grad = self.owned_grad(bucket, start, end)
            for lo, hi in pads:
                grad[lo:hi].zero_()

    def _pre_reduce(self, bucket: Bucket) -> None:
        self._sum_partial_grads_over_tp([p for p in bucket.params if p.spec.partial_grad_over_tp])
        for p in bucket.params:
            if p.spec.tied:
                self._sum_tied_embedding_grad(p)

    def _sum_partial_grads_over_tp(self, params: list) -> None:
        """Grads partial per TP rank (a replicated norm weight that saw S/tp tokens with sequence parallelism,
        a LoRA factor that saw 1/tp of its linear's outputs or inputs): one all-reduce over tp of their
        span of the grad buffer (they lie next to each other at the deferred bucket's start)."""
        if not params or self.tp_comm is None or self.tp_comm.size == 1:
            return
        spans = sorted(self._offsets[id(p)] for p in params)
        lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
        assert sum(n for _, n in spans) == hi - lo, "partial-over-tp grads are not contiguous"
        self.tp_comm.allreduce(self.grad_buffer[lo:hi])

    def _sum_tied_embedding_grad(self, p) -> None:
        """Stage 0's embedding and the last stage's LM-head copy exchange grads over pp and add them."""
        peer = self.pp_comm.size - 1 if self.pp_comm.rank == 0 else 0
        theirs = torch.empty_like(p.main_grad)
        mine = p.main_grad.contiguous()  # posted together: one NCCL group, no send/recv ordering
        self.pp_comm.exchange([(mine, peer, TIED_GRAD_TAG)], [(theirs, peer, TIED_GRAD_TAG)]).wait()
        p.main_grad.add_(theirs)

    # ---------------------------------------------------------------- what this rank owns
    def owned_ranges(self) -> list[tuple[Bucket, int, int]]:
        """(bucket, start, end) in the flat buffers that this rank's optimizer updates."""
        if not self.zero:
            return [(b, b.start, b.end) for b in self.buckets]
        ranges = []
        for b in self.buckets:
            n = b.size // self.dp_size
            ranges.append((b, b.start + self.dp_rank * n, b.start + (self.dp_rank + 1) * n))
        return ranges

    def owned_grad(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        if self.zero:
            assert bucket.slice_grad is not None  # ZeRO: every bucket has its slice
            return bucket.slice_grad
        return self.grad_buffer[start:end]

    def gather_params(self) -> None:
        """ZeRO-1: after the owned ranges were updated, all-gather parameters in place over dp."""
        if not self.zero or self.dp_size == 1:
            return
        handles = [self.dp_comm.allgather(self.param_buffer[b.start:b.end], None, nonblocking=True)
                   for b in self.buckets]
        for h in handles:
            h.wait()

    def offset_of(self, p) -> tuple[int, int]:
        """(start in the flat buffers, number of elements) of parameter ``p``."""
        return self._offsets[id(p)]

    def pieces(self, start: int, end: int) -> list[ParamPiece]:
        """The pieces of parameters inside flat [start, end), in flat order (padding has no piece)."""
        found = []
        for p in self.params:
            offset, n = self._offsets[id(p)]
            overlap = intersect(offset, offset + n, start, end)
            if overlap:
                found.append(ParamPiece(p, overlap[0], overlap[1], overlap[0] - offset))
        return sorted(found, key=lambda piece: piece.flat_lo)

    def padding_ranges(self, start: int, end: int) -> list[tuple[int, int]]:
        """Sub-ranges of flat [start, end), relative to ``start``, holding vocabulary padding rows (the slab
        elements from ``spec.valid_numel`` on: never trained, never saved)."""
        ranges = []
        for piece in self.pieces(start, end):
            first_pad = max(piece.param_lo, piece.param.spec.valid_numel)  # type: ignore[attr-defined]  # the SlabSpec hpctrain attaches (parallel/slab.py)
            if first_pad < piece.param_hi:
                ranges.append((piece.flat_lo + first_pad - piece.param_lo - start, piece.flat_hi - start))
        return ranges

    def param_ranges(self, start: int, end: int, predicate) -> list[tuple[int, int]]:
        """Sub-ranges of flat [start, end), relative to ``start``, covered by parameters where ``predicate``
        holds (padding excluded; adjacent ranges merged)."""
        ranges: list[tuple[int, int]] = []
        for piece in self.pieces(start, end):
            if predicate(piece.param):
                lo, hi = piece.flat_lo - start, piece.flat_hi - start
                if ranges and ranges[-1][1] == lo:
                    ranges[-1] = (ranges[-1][0], hi)
                else:
                    ranges.append((lo, hi))
        return ranges
