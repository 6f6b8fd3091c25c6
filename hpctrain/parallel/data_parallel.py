"""Data parallelism: flat parameter/gradient buffers, bucketed gradient reduction overlapped with backward,
and the ZeRO slice layout (stages 1-3). All reductions run on the DP group (the replica group, dp x cp).
How the buckets and buffers are cut: flat_layout.py; the deferred bucket's pre-reductions over tp and pp:
pre_reduce.py.

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

ZeRO. Stage 1: a rank owns 1/dp of every bucket (its optimizer state) and receives that slice of the
reduced gradients; ``gather_params`` all-gathers the updated parameters. Stage 2: each bucket (but the
deferred one) has its own gradient storage, taken when a micro-batch's first gradient reaches it and
given back once that micro-batch's reduce-scatter is done (``allocate`` / ``free``): a reduce-scatter
per micro-batch, summed into the slice. Stage 3: also the parameters, per unit (one bucket each, built
from ``units``); a rank keeps its ``param_slice`` and hpctrain/parallel/zero/gather.py gathers the unit around
its forward and backward. What to communicate is decided by the hooks alone, never by when a reduction
happened to complete (completion times differ between ranks; a decision taken from them once posted a
reduce-scatter on some ranks only).

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

import torch

from hpctrain.compression.reducer import DenseReducer, GradReducer
from hpctrain.parallel.buckets import Bucket, ParamPiece, allocate, free, gather_whole, intersect, place_params
from hpctrain.parallel.flat_layout import make_buckets, make_storage
from hpctrain.parallel.pre_reduce import pre_reduce
from hpctrain.profiling.timers import NULL_TIMER


class FlatParams:
    """Flat buffers, buckets and the replica group's gradient reducer of one pipeline stage's parameters.

    Everything is fixed at construction: ``zero`` (the ZeRO stage 0-3), ``units`` (zero 3: the parameter
    groups gathered together, in forward order; each becomes one bucket), ``timer`` (the trainer's
    PhaseTimer), ``check_finite`` (float16 runs: compressed reducers flag inf/NaN as
    ``GradReducer.overflow``) and ``reducer``, built LAST by ``make_reducer(self)`` once the buffers,
    buckets and timer exist (default: the dense reducer; the Trainer passes one of
    ``hpctrain.compression.build_reducer``). ``on_backward_done(bucket)``: zero 3's gatherer
    (hpctrain/parallel/zero/gather.py) is told when a bucket's micro-batch grads are complete. ``first_index``: the
    first bucket's ``index`` (the experts' FlatParams continues after the dense one's: ZeRO-3's gatherer keys
    the buckets of both by it)."""

    def __init__(self, params: list, dp_comm, *, tp_comm=None, pp_comm=None, bucket_mb: float = 25.0,
                 zero: int = 0, units: list[list] | None = None, grad_dtype: torch.dtype | None = None,
                 timer=NULL_TIMER, check_finite: bool = False,
                 make_reducer: Callable[[FlatParams], GradReducer] = DenseReducer, first_index: int = 0):
        self.params, self.dp_comm, self.tp_comm, self.pp_comm = list(params), dp_comm, tp_comm, pp_comm
        self.zero_stage = int(zero)
        self.zero = self.zero_stage >= 1  # optimizer state sharded: each rank owns 1/dp of every bucket
        self.timer, self.check_finite = timer, check_finite
        self.on_backward_done: Callable[[Bucket], None] | None = None
        self.dp_size = 1 if dp_comm is None else dp_comm.size
        self.dp_rank = 0 if dp_comm is None else dp_comm.rank
        self.param_dtype = param_dtype = self.params[0].dtype
        self.grad_dtype = grad_dtype or (torch.float32 if param_dtype in (torch.float16, torch.bfloat16)
                                         else param_dtype)
        self.device = device = self.params[0].device  # buffers live where the parameters are
        self.first_index = first_index
        self.buckets = make_buckets(self.params, self.dp_size,
                                    bucket_mb * 2**20 / torch.empty((), dtype=self.grad_dtype).element_size(),
                                    units if self.zero_stage == 3 else None, first_index)
        self.param_buffer, self.grad_buffer = make_storage(self.buckets, self.dp_size, self.zero_stage,
                                                           self.param_dtype, self.grad_dtype, device)
        self._offsets: dict[int, tuple[int, int]] = {}  # id(parameter) -> (start in the flat buffers, elements)
        self.bucket_of: dict[int, Bucket] = {}
        for bucket in self.buckets:
            # zero 3: this rank's slice kept (drawn, or copied), the whole freed until gathered
            place_params(bucket, self._offsets, self.dp_rank, self.dp_size)
            if bucket.per_microbatch:
                allocate(bucket.grads)  # for the views (untouched), then free until a micro-batch's grads come
            for p in bucket.params:
                offset, n = self._offsets[id(p)]
                p.main_grad = bucket.grads[offset - bucket.start:offset - bucket.start + n].view_as(p)
                self.bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            if bucket.per_microbatch:
                free(bucket.grads)
        self.last_microbatch = False
        self._unwritten: set[int] = set(self._offsets)  # ids of the parameters with no grad since their bucket's last read
        # each bucket's padding past its parameters, [lo, hi) in the flat buffers (only with dp > 1)
        self._bucket_padding = {b.index: (b.start + sum(p.numel() for p in b.params), b.end) for b in self.buckets}
        # vocabulary padding rows inside the owned ranges: their reduced grads are zeroed (a lossy
        # compressor, e.g. onebit, may turn the zeros into noise), so they stay zero and never count
        self._owned_padding = [(b, lo, hi, pads) for b, lo, hi in self.owned_ranges()
                               if (pads := self.padding_ranges(lo, hi))]
        self.reducer = make_reducer(self)  # last: it reads the buckets, buffers and timer

    # ---------------------------------------------------------------- one step
    def start_step(self) -> None:
        """Reset bucket readiness; every parameter's next grad is its first of the step (copied, not added:
        the main grads are not zeroed, ``_settle`` zeroes what got no grad before a reduction reads it)."""
        self.last_microbatch = False
        self._unwritten = set(self._offsets)
        for bucket in self.buckets:
            bucket.pending, bucket.handle, bucket.launches = len(bucket.params), None, 0

    def _on_grad_ready(self, p) -> None:
        bucket = self.bucket_of[id(p)]
        if bucket.per_microbatch and bucket.pending == len(bucket.params):  # its first grad this micro-batch
            self._open(bucket)
        if id(p) in self._unwritten:  # the first grad since the bucket was last read: the same values as 0 + grad
            self._unwritten.discard(id(p))
            p.main_grad.copy_(p.grad)
        else:
            p.main_grad.add_(p.grad)
        p.grad = None
        if bucket.per_microbatch or (self.last_microbatch and not bucket.deferred):
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)
        self.progress()

    def _open(self, bucket: Bucket) -> None:
        """zero >= 2: before a micro-batch's grads land in ``bucket``: the last reduction is done, its
        storage is there."""
        if bucket.handle is not None:
            self._complete(bucket)
        allocate(bucket.grads)

    def progress(self) -> None:
        """Complete the per-micro-batch reductions that have finished (called from every gradient hook); one rank
        in the group starts none, so nothing to scan (issue #52 item 3)."""
        if self.dp_size == 1:
            return
        for bucket in self.buckets:
            if bucket.handle is not None and bucket.handle.test() and bucket.per_microbatch:
                self._complete(bucket)

    def _settle(self, bucket: Bucket) -> None:
        """Before anything reads the bucket: zero the main grads of its parameters with no grad since it was
        last read, and its padding (a compressed reducer writes the whole bucket). Idempotent."""
        for p in bucket.params:
            if id(p) in self._unwritten:
                self._unwritten.discard(id(p))
                p.main_grad.zero_()
        lo, hi = self._bucket_padding[bucket.index]
        if lo < hi:
            bucket.grads[lo - bucket.start:hi - bucket.start].zero_()

    def _launch(self, bucket: Bucket) -> None:
        self._settle(bucket)
        if bucket.per_microbatch:  # the next micro-batch starts afresh; the sum goes to slice_grad
            bucket.pending = len(bucket.params)
            self._unwritten.update(id(p) for p in bucket.params)
            bucket.slice_out = bucket.incoming if bucket.launches else bucket.slice_grad
            if bucket.launches and bucket.incoming is not None:
                allocate(bucket.incoming)
            bucket.launches += 1
            if self.on_backward_done is not None:
                self.on_backward_done(bucket)
        if self.dp_size == 1:
            if self.zero:
                assert bucket.slice_out is not None  # ZeRO: every bucket has its slice
                bucket.slice_out.copy_(bucket.grads)
                if bucket.per_microbatch:
                    self._complete(bucket)
            return
        bucket.handle = self.reducer.start(bucket)

    def _complete(self, bucket: Bucket) -> None:
        """zero >= 2: a micro-batch's reduction of ``bucket`` is over: add it to the step's sum, free the grads.
        (Never decides what to communicate: completion times differ between ranks.)"""
        if bucket.handle is not None:
            self.reducer.finish(bucket)
            bucket.handle = None
        if bucket.slice_out is bucket.incoming and bucket.incoming is not None:
            assert bucket.slice_grad is not None
            bucket.slice_grad.add_(bucket.incoming)
            free(bucket.incoming)
            bucket.slice_out = bucket.slice_grad
        free(bucket.grads)

    def finish_reduction(self) -> None:
        """After the last micro-batch's backward: pre-reduce deferred grads, reduce them, wait for all."""
        for bucket in self.buckets:
            if bucket.deferred:
                self._settle(bucket)
                pre_reduce(bucket, self._offsets, self.tp_comm, self.pp_comm)
                self._launch(bucket)
            elif bucket.per_microbatch and (bucket.pending < len(bucket.params) or not bucket.launches):
                self._open(bucket)  # grads the hooks did not hand over (unused parameters), or none at all
                self._launch(bucket)
            elif not bucket.per_microbatch and bucket.handle is None and bucket.pending > 0:
                self._launch(bucket)  # a bucket whose hooks did not all fire (unused parameters)
        for bucket in self.buckets:
            if bucket.per_microbatch:
                if bucket.handle is not None:
                    self._complete(bucket)
            elif bucket.handle is not None:
                self.reducer.finish(bucket)
        for bucket, start, end, pads in self._owned_padding:
            grad = self.owned_grad(bucket, start, end)
            for lo, hi in pads:
                grad[lo:hi].zero_()

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
        return bucket.grads[start - bucket.start:end - bucket.start]

    def owned_params(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """The parameter values of owned range [start, end) of ``bucket``: a view of what this rank keeps."""
        if bucket.param_slice is not None:
            return bucket.param_slice
        return bucket.param_values[start - bucket.start:end - bucket.start]

    def gather_params(self) -> None:
        """ZeRO 1-3: after the owned ranges were updated, all-gather parameters in place over dp (zero 3: the
        buckets that stay whole; a sharded one is gathered when its unit next runs)."""
        if not self.zero or self.dp_size == 1:
            return
        handles = [self.dp_comm.allgather(b.param_values, None, nonblocking=True) for b in self.buckets if not b.sliced]
        for h in handles:
            h.wait()

    def gathered(self):
        """Every sharded bucket's parameters gathered (collective over dp), freed again on exit: the whole
        local model readable between steps (zero 3; nothing to do otherwise)."""
        return gather_whole(self.buckets, self.dp_comm)

    def memory_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank keeps between steps: {"params": ``param_buffer``, "grads": the main
        grads (zero <= 1: ``grad_buffer``; zero >= 2: the deferred bucket's) and the reduced slices}."""
        slices = sum(b.slice_grad.nbytes for b in self.buckets if b.slice_grad is not None)
        whole = self.grad_buffer.nbytes if self.zero_stage <= 1 else sum(b.grads.nbytes for b in self.buckets
                                                                          if b.deferred)
        return {"params": self.param_buffer.nbytes, "grads": whole + slices}

    def state_tensors(self) -> list[torch.Tensor]:
        """The model-state tensors (the buffers, every bucket's parameters, gradients and slices; at zero 3
        what is gathered now): what activation metering leaves out."""
        per_bucket = [getattr(b, k, None) for b in self.buckets for k in ("param_values", "grads", "slice_grad")]
        return [self.param_buffer, self.grad_buffer, *(t for t in per_bucket if t is not None)]

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
