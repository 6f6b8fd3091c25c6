"""ZeRO-3 for the parameters that do not train (a LoRA run's frozen base): sharded over the replica group like
the trainable ones, gathered only while their unit runs.

Each unit's frozen parameters (``gather.unit_params(stages, trainable=False)``: the frozen ones a unit uses, a
shared one in its first unit) become one gather-only ``Bucket``: no gradient, no reduction, no optimizer
state. ``param_slice``: this rank's 1/dp of the unit (padded to a multiple of dp), a view of ``slices``, the
one buffer kept between steps; ``param_values``: the whole unit, which every parameter's ``.data`` views,
allocated only while ``ParamGather`` (gather.py) holds the unit gathered. Bucket indices continue after the
trainable ``FlatParams``' buckets, so the gatherer keys both alike.

With expert parallelism the routed experts' frozen weights are sharded over their own group (the replicas
holding the same experts, ``ep_replica``): a ``FrozenSlices`` of their own, presented with the dense one's as
one by ``FrozenGroup`` (below ZeRO-3, or without frozen parameters, a group of none: the base is whole on
every replica).

Checkpoints read and write the frozen base through ``pieces`` (the parameter elements this rank keeps), as
they do the trainable slices: the base is never gathered for a save or a load. Collective only in
``gathered`` (over the replica group ``dp_comm``).
"""
from __future__ import annotations

import torch

from hpctrain.parallel.buckets import (Bucket, ParamPiece, all_gathered, buckets_holding, free, gather_whole, place_params,
                                      sliced_pieces)


class FrozenSlices:
    """The gather-only buckets of ``units`` (lists of frozen parameters, in forward order) over ``dp_comm``
    (the replica group, dp x cp); ``first_index``: the first bucket's ``index`` (after the trainable ones)."""

    def __init__(self, units: list[list], dp_comm, first_index: int):
        self.dp_comm = dp_comm
        self.dp_size = 1 if dp_comm is None else dp_comm.size
        self.dp_rank = 0 if dp_comm is None else dp_comm.rank
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}  # id(parameter) -> its bucket
        self._offsets: dict[int, tuple[int, int]] = {}  # id(parameter) -> (start in the flat order, elements)
        start = 0
        for members in units:
            if members:
                size = -(-sum(p.numel() for p in members) // self.dp_size) * self.dp_size
                self.buckets.append(Bucket(start, start + size, list(members), index=first_index + len(self.buckets)))
                start += size
        params = [p for b in self.buckets for p in b.params]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"zero 3: the frozen parameters have several dtypes {sorted(map(str, dtypes))}")
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        self.slices = torch.zeros(start // self.dp_size, dtype=dtype, device=device)
        at = 0
        for b in self.buckets:
            share = b.size // self.dp_size
            b.param_slice = self.slices[at:at + share]
            b.param_values = torch.empty(b.size, dtype=dtype, device=device)
            free(b.param_values)  # storage only while gathered
            at += share
            place_params(b, self._offsets, self.dp_rank, self.dp_size)
            self.bucket_of.update((id(p), b) for p in b.params)

    def buckets_of(self, params) -> list[Bucket]:
        """The buckets holding any of ``params``, in first-use order."""
        return buckets_holding(self.bucket_of, params)

    def pieces(self) -> list[tuple[ParamPiece, int, int]]:
        """(piece, k, at) for every run of parameter elements this rank keeps: elements [piece.param_lo,
        piece.param_hi) of the parameter's flattened local slab lie at [at, at + length) of
        ``buckets[k].param_slice``. Padding has no piece."""
        return [(piece, k, at) for k, b in enumerate(self.buckets)
                for piece, at in sliced_pieces(b, self._offsets, self.dp_rank, self.dp_size)]

    def memory_bytes(self) -> int:
        """The frozen parameter bytes this rank keeps between steps (its slices)."""
        return self.slices.nbytes

    def gathered(self):
        """Collective over the replica group: every frozen unit gathered (the whole local base readable, as
        ``FlatParams.gathered`` makes the trainable one), freed again on exit."""
        return gather_whole(self.buckets, self.dp_comm)


class FrozenGroup:
    """``FrozenSlices``-like view of none, one or two (``parts``: the dense one over the replica group, the
    experts' over ep_replica), their bucket indices consecutive: the calls the gatherer and the checkpoint
    use, to each."""

    def __init__(self, parts: list[FrozenSlices]):
        self.parts = parts
        self.buckets = [b for f in parts for b in f.buckets]
        self.bucket_of = {k: v for f in parts for k, v in f.bucket_of.items()}

    def buckets_of(self, params) -> list[Bucket]:
        """The buckets holding any of ``params``, in first-use order."""
        return buckets_holding(self.bucket_of, params)

    def pieces(self) -> list[tuple[ParamPiece, int, int]]:
        """``FrozenSlices.pieces`` of every part, ``k`` indexing ``buckets`` (all parts' in order)."""
        found, first = [], 0
        for f in self.parts:
            found += [(piece, first + k, at) for piece, k, at in f.pieces()]
            first += len(f.buckets)
        return found

    def memory_bytes(self) -> int:
        return sum(f.memory_bytes() for f in self.parts)

    def gathered(self):
        """Collective over each part's group: every frozen unit gathered, freed again on exit."""
        return all_gathered(self.parts)
