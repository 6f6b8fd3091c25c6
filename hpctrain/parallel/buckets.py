"""Buckets: runs of a stage's flat parameter (and gradient) buffers that move as one, and what places a
parameter's bytes in them. Shared by the trainable ``FlatParams`` (hpctrain/parallel/data_parallel.py) and
the frozen ``FrozenSlices`` (zero/frozen_slices.py); ZeRO-3's ``ParamGather`` (zero/gather.py) gathers and frees them.

Words (docs/architecture.md): a bucket's **slice** is one replica rank's 1/dp of it (ZeRO); a **piece** is one
parameter's part of a flat range. A parameter's ``.data`` is a view of its bucket's ``param_values``; at
ZeRO-3 that storage exists only while the unit is gathered (``allocate`` / ``free``), and the rank keeps
``param_slice``. ``place_params`` gives the parameters their initial values: copied when a parameter has
storage, else drawn from its ``InitRule`` (hpctrain/parallel/param_init.py) directly into what this rank
keeps, so a parameter built on the meta device is never held whole by a rank that keeps only a slice.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from hpctrain.parallel.param_init import fill_, has_storage


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


@dataclass(eq=False)  # compared by identity
class Bucket:
    """A run of the flat buffers, [start, end) (padded to a multiple of dp), reduced as one.

    ``grads``: its main grads [size] (a view of ``FlatParams.grad_buffer`` at zero <= 1; at zero >= 2 a
    tensor of its own, freed between micro-batches except in the deferred bucket). ``param_values``: its
    parameters [size] (a view of ``param_buffer`` at zero <= 2; at zero 3 a tensor of its own that holds
    the gathered unit while it runs, ``sliced``). ``param_slice``: zero 3, this rank's 1/dp of ``param_values``, kept
    between steps. ``slice_grad``: zero >= 1, this rank's reduced 1/dp of ``grads``; ``slice_out``: where the
    running reduce-scatter writes (``slice_grad``, or ``incoming`` when earlier micro-batches' sum is there)."""
    start: int  # range in the flat buffers
    end: int  # padded end
    params: list = field(default_factory=list)
    deferred: bool = False
    pending: int = 0
    handle: Any = None  # the reducer's reduction in flight (test/wait), None when idle
    slice_grad: torch.Tensor | None = None  # ZeRO: this rank's reduced slice
    index: int = 0  # position in FlatParams.buckets, + its first_index (the reducer's and ZeRO-3's key)
    grads: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    param_values: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    param_slice: torch.Tensor | None = None
    slice_out: torch.Tensor | None = None
    incoming: torch.Tensor | None = None
    launches: int = 0  # zero >= 2: reductions started this step (decided by the hooks alone: the same on every rank)

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def sliced(self) -> bool:
        """zero 3: ``param_values`` is gathered only while its unit runs (this rank keeps ``param_slice``)."""
        return self.param_slice is not None

    @property
    def per_microbatch(self) -> bool:
        """Reduced after every micro-batch's backward (zero >= 2, not the deferred bucket)."""
        return self.incoming is not None


def allocate(tensor: torch.Tensor) -> None:
    """Give ``tensor`` (which owns its storage, offset 0) back its storage after ``free``; contents undefined."""
    storage = tensor.untyped_storage()
    if storage.size() == 0:
        storage.resize_(tensor.numel() * tensor.element_size())


def free(tensor: torch.Tensor) -> None:
    """Drop ``tensor``'s storage (views of it stay valid objects, and see it again after ``allocate``).
    Never call ``.numpy()`` on a view of it: numpy pins a storage's size (copy first)."""
    tensor.untyped_storage().resize_(0)


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() > 0


@contextmanager
def gather_whole(buckets: list[Bucket], dp_comm):
    """Collective over ``dp_comm`` (None: one rank): each sliced bucket of ``buckets`` not gathered now gets
    its whole ``param_values`` from the ranks' slices (blocking all-gathers), freed again on exit."""
    taken = [b for b in buckets if b.sliced and not is_allocated(b.param_values)]
    for b in taken:
        assert b.param_slice is not None  # a sliced bucket
        allocate(b.param_values)
        if dp_comm is not None and dp_comm.size > 1:
            dp_comm.allgather(b.param_values, b.param_slice)
        else:
            b.param_values.copy_(b.param_slice)
    try:
        yield
    finally:
        for b in taken:
            free(b.param_values)


def sliced_pieces(bucket: Bucket, offsets: dict, dp_rank: int, dp_size: int) -> list[tuple[ParamPiece, int]]:
    """(piece, at) for every run of parameter elements in this rank's slice of ``bucket`` (1/dp of it):
    elements [piece.param_lo, piece.param_hi) of the parameter's flattened slab lie at [at, at + length) of
    ``bucket.param_slice``. ``offsets``: id(parameter) -> (start in the flat order, elements). Padding has no
    piece."""
    share = bucket.size // dp_size
    lo, hi = bucket.start + dp_rank * share, bucket.start + (dp_rank + 1) * share
    found = []
    for p in bucket.params:
        offset, n = offsets[id(p)]
        overlap = intersect(offset, offset + n, lo, hi)
        if overlap:
            found.append((ParamPiece(p, overlap[0], overlap[1], overlap[0] - offset), overlap[0] - lo))
    return found


@torch.no_grad()
def place_params(bucket: Bucket, offsets: dict, dp_rank: int, dp_size: int) -> None:
    """Point every parameter of ``bucket`` into its ``param_values`` (``p.data`` becomes a view), record its
    (start, elements) in ``offsets`` (keyed by id), and give it its initial values. A parameter with storage
    is copied; one without (built on the meta device: ``param_init.give_storage``) is drawn from its rule. A
    sliced bucket (ZeRO-3: ``param_slice``) keeps only this rank's slice: drawn straight into it when no
    parameter has storage (the whole unit is never written), else copied out of the whole, which is then freed."""
    with_storage = any(has_storage(p) for p in bucket.params)
    whole = bucket.param_slice is None or with_storage
    if bucket.param_slice is not None:
        allocate(bucket.param_values)  # the views need their storage to exist (untouched unless copied into)
        if whole:
            bucket.param_values.zero_()  # its padding is part of a slice
    offset = bucket.start
    for p in bucket.params:
        n = p.numel()
        view = bucket.param_values[offset - bucket.start:offset - bucket.start + n].view_as(p)
        if whole and has_storage(p):
            view.copy_(p.data)
        elif whole:
            fill_(view, p.spec, p.init)
        p.data = view
        offsets[id(p)] = (offset, n)
        offset += n
    if bucket.param_slice is None:
        return
    share = bucket.size // dp_size
    if whole:
        bucket.param_slice.copy_(bucket.param_values[dp_rank * share:(dp_rank + 1) * share])
    else:
        for piece, at in sliced_pieces(bucket, offsets, dp_rank, dp_size):
            spec, rule = piece.param.spec, piece.param.init  # type: ignore[attr-defined]  # (parallel/param_init.py)
            fill_(bucket.param_slice[at:at + piece.flat_hi - piece.flat_lo], spec, rule, lo=piece.param_lo)
    free(bucket.param_values)


def buckets_holding(bucket_of: dict[int, Bucket], params) -> list[Bucket]:
    """The buckets of ``bucket_of`` (``id(param)`` -> bucket) holding any of ``params``, in first-use order."""
    found: list[Bucket] = []
    for p in params:
        bucket = bucket_of.get(id(p))
        if bucket is not None and bucket not in found:
            found.append(bucket)
    return found


@contextmanager
def all_gathered(parts):
    """Every part's ``gathered()`` entered in order (collective over each part's group), left in reverse."""
    with ExitStack() as stack:
        for part in parts:
            stack.enter_context(part.gathered())
        yield
