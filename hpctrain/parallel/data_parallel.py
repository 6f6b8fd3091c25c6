"""Data parallelism: flat parameter/gradient buffers, bucketed gradient reduction overlapped with backward,
and the ZeRO-1 shard layout. All reductions run on the DP group.

Layout. A stage's parameters are re-pointed into one flat ``param_buffer``; their gradients are
accumulated (over micro-batches) into a flat ``grad_buffer`` ("main grads": float32 for half-precision
models). Both are cut into buckets of about ``bucket_mb``, in reverse parameter order (the order
backward produces them), each padded to a multiple of dp. A rank OWNS a range of each bucket: the
whole bucket without ZeRO, its 1/dp slice with ZeRO-1. The optimizer updates owned ranges only.

Reduction. A backward hook per parameter adds its grad into the main-grad view; on the last
micro-batch, once every parameter of a bucket has reported, the bucket's non-blocking reduction
starts (all-reduce SUM, or reduce-scatter into ``shard_grads`` with ZeRO) while backward continues;
hooks call ``test()`` on pending handles to drive MPI progress. ``finish_reduction`` waits for all.
Gradients are SUMMED over dp: the loss is already divided by the global token count.

Deferred bucket. Grads that need a reduction over ANOTHER group first (sequence-parallel norm weights:
partial per TP rank; the last stage's copy of a tied embedding: summed with stage 0 over PP) live in
a last bucket that ``finish_reduction`` starts after those pre-reductions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    start: int  # range in the flat buffers
    end: int  # padded end
    params: list = field(default_factory=list)
    deferred: bool = False
    pending: int = 0
    handle: object = None
    shard_grad: torch.Tensor | None = None  # ZeRO: this rank's reduced slice

    @property
    def size(self) -> int:
        return self.end - self.start


class FlatParams:
    """Flat buffers, buckets and the DP gradient reducer of one pipeline stage's parameters."""

    def __init__(self, params: list, dp_comm, *, tp_comm=None, pp_comm=None, bucket_mb: float = 25.0, zero: bool = False,
                 grad_dtype: torch.dtype | None = None):
        self.params, self.dp_comm, self.tp_comm, self.pp_comm, self.zero = list(params), dp_comm, tp_comm, pp_comm, zero
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
        self.offsets, self.bucket_of = {}, {}
        for bucket in self.buckets:
            offset = bucket.start
            for p in bucket.params:
                n = p.numel()
                view = self.param_buffer[offset:offset + n].view_as(p)
                view.copy_(p.data)
                p.data = view
                p.main_grad = self.grad_buffer[offset:offset + n].view_as(p)
                self.offsets[id(p)] = (offset, n)
                self.bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
                offset += n
            if zero:
                bucket.shard_grad = torch.zeros(bucket.size // self.dp_size, dtype=self.grad_dtype, device=device)
        self.last_microbatch = False

    def _make_buckets(self, bucket_elems: float) -> list[Bucket]:
        def needs_pre_reduction(p):
            return p.spec.sp_partial_grad or (p.spec.tied_copy or self._is_tied_original(p))

        ordered = list(reversed(self.params))
        regular = [p for p in ordered if not needs_pre_reduction(p)]
        deferred = [p for p in ordered if needs_pre_reduction(p)]
        buckets, start = [], 0
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
            buckets.append(Bucket(start, start + padded, members, is_deferred))
            start += padded
        return buckets

    def _is_tied_original(self, p) -> bool:
        """Stage 0's embedding when the last stage holds a tied copy (pp > 1)."""
        return bool(getattr(p, "tied_with_last_stage", False))

    # ---------------------------------------------------------------- one step
    def start_step(self) -> None:
        """Zero the main grads; reset bucket readiness."""
        self.grad_buffer.zero_()
        self.last_microbatch = False
        for bucket in self.buckets:
            bucket.pending, bucket.handle = len(bucket.params), None

    def _on_grad_ready(self, p) -> None:
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

    def _launch(self, bucket: Bucket) -> None:
        if self.dp_size == 1:
            if self.zero:
                bucket.shard_grad.copy_(self.grad_buffer[bucket.start:bucket.end])
            return
        grads = self.grad_buffer[bucket.start:bucket.end]
        if self.zero:
            bucket.handle = self.dp_comm.reduce_scatter(bucket.shard_grad, grads, nonblocking=True)
        else:
            bucket.handle = self.dp_comm.allreduce(grads, nonblocking=True)

    def finish_reduction(self) -> None:
        """After the last micro-batch's backward: pre-reduce deferred grads, reduce them, wait for all."""
        for bucket in self.buckets:
            if bucket.deferred:
                self._pre_reduce(bucket)
                self._launch(bucket)
            elif bucket.handle is None and bucket.pending > 0:
                self._launch(bucket)  # a bucket whose hooks did not all fire (unused parameters)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()

    def _pre_reduce(self, bucket: Bucket) -> None:
        for p in bucket.params:
            if p.spec.sp_partial_grad and self.tp_comm is not None and self.tp_comm.size > 1:
                self.tp_comm.allreduce(p.main_grad)
            if p.spec.tied_copy or self._is_tied_original(p):
                peer = self.pp_comm.size - 1 if self.pp_comm.rank == 0 else 0
                theirs = torch.empty_like(p.main_grad)
                mine = p.main_grad.contiguous()  # posted together: one NCCL group, no send/recv ordering
                self.pp_comm.exchange([(mine, peer, 11)], [(theirs, peer, 11)]).wait()
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
        return bucket.shard_grad if self.zero else self.grad_buffer[start:end]

    def gather_params(self) -> None:
        """ZeRO-1: after the owned ranges were updated, all-gather parameters in place over dp."""
        if not self.zero or self.dp_size == 1:
            return
        handles = [self.dp_comm.allgather(self.param_buffer[b.start:b.end], None, nonblocking=True)
                   for b in self.buckets]
        for h in handles:
            h.wait()

    def param_ranges(self, start: int, end: int, predicate) -> list[tuple[int, int]]:
        """Sub-ranges of flat [start, end), relative to ``start``, covered by parameters where ``predicate``
        holds (padding excluded; adjacent ranges merged)."""
        ranges: list[tuple[int, int]] = []
        for p in sorted(self.params, key=lambda q: self.offsets[id(q)][0]):
            offset, n = self.offsets[id(p)]
            lo, hi = max(offset, start), min(offset + n, end)
            if lo < hi and predicate(p):
                if ranges and ranges[-1][1] == lo - start:
                    ranges[-1] = (ranges[-1][0], hi - start)
                else:
                    ranges.append((lo - start, hi - start))
        return ranges
