"""Slab spec (``SlabSpec``): where each number of a parameter lives. One source of truth for init,
checkpoints and tests.

Every parameter carries ``param.spec``: its global name and shape, and which SLAB of it this rank
holds (a split along ``split_dim`` over the TP group, or the whole tensor when replicated).
Pipeline stages simply do not hold the parameters of other stages (except the tied embedding's
copy, marked by ``tied``). Words (one meaning each, docs/architecture.md): a **slab** is this tp
split of a parameter; a **slice** is a ZeRO-1 owner's part of the flat optimizer state
(``optim/flat.py`` ``OptimizerSlice``); a **piece** is one parameter's part of an owned flat range (what a
checkpoint box is made of); a **shard** is one rank's checkpoint file (``shards/shard-RRRRR.h5``).

Padding (the vocabulary, docs/parallelism.md): ``global_shape`` is always the TRUE tensor (what
checkpoints and exports hold); ``padded_dim`` is the split dimension's length over all tp ranks when it is
longer. Rank r then holds padded rows [r n, (r+1) n) (``local_shape``), of which the ones below the true
length are real: a prefix of its slab (``valid_local()``), at ``local_slices()`` of the global tensor;
the last rank(s) may hold fewer, or none. The padding rows are zero and stay zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlabSpec:
    name: str  # global parameter name, e.g. "layers.3.attn.wq.weight"
    global_shape: tuple[int, ...]
    split_dim: int | None = None  # dimension split over the TP group; None = replicated over TP
    tp_rank: int = 0
    tp_size: int = 1
    # a weight replicated over TP whose grad is a partial sum per TP rank (summed over tp before the dp
    # reduction): sequence-parallel norms and position table; LoRA's A of a column-parallel linear, B of a
    # row-parallel one (parallel/lora.py)
    partial_grad_over_tp: bool = False
    # tied embeddings across pipeline stages (pp > 1): "original" on stage 0, "copy" on the last stage
    # (its LM head); the two grads are summed before the dp reduction; the copy is never saved or
    # counted twice. "" = not tied across stages (a tie inside one stage is one shared Parameter).
    tied: str = ""
    # length of ``split_dim`` over all tp ranks, padding included (only the vocabulary's dim 0 is ever
    # padded); None = global_shape[split_dim], no padding
    padded_dim: int | None = None
    # an MoE layer's experts split over the ep group (hpctrain/parallel/expert_parallel.py): this rank holds
    # experts [first, first + count) of dim 0 (the experts' dim); None = all of them
    experts: tuple[int, int] | None = None

    def __post_init__(self):
        if self.padded_dim is not None and (self.split_dim != 0 or self.padded_dim < self.global_shape[0]):
            raise ValueError(f"{self.name}: padding is along the split dim 0 and not shorter than "
                             f"{self.global_shape}, got split_dim={self.split_dim}, padded_dim={self.padded_dim}")

    @property
    def tied_copy(self) -> bool:
        return self.tied == "copy"

    @property
    def split_length(self) -> int:
        """Length of ``split_dim`` over all tp ranks, padding included."""
        assert self.split_dim is not None, f"{self.name} is not split over tp"
        return self.padded_dim if self.padded_dim is not None else self.global_shape[self.split_dim]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's slab (padding rows included)."""
        shape = list(self.global_shape)
        if self.split_dim is not None:
            shape[self.split_dim] = self.split_length // self.tp_size
        if self.experts is not None:
            shape[0] = self.experts[1]
        return tuple(shape)

    def _real_rows(self) -> tuple[int, int]:
        """Global [start, stop) of this rank's real (non-padding) indices along ``split_dim``."""
        assert self.split_dim is not None, f"{self.name} is not split over tp"
        n, true = self.split_length // self.tp_size, self.global_shape[self.split_dim]
        return min(self.tp_rank * n, true), min((self.tp_rank + 1) * n, true)

    def local_slices(self) -> tuple[slice, ...]:
        """Index in the global tensor of this rank's real elements (its whole slab without padding)."""
        index = [slice(None)] * len(self.global_shape)
        if self.split_dim is not None:
            index[self.split_dim] = slice(*self._real_rows())
        if self.experts is not None:
            index[0] = slice(self.experts[0], self.experts[0] + self.experts[1])
        return tuple(index)

    def valid_local(self) -> tuple[slice, ...]:
        """Index in the local slab of its real elements (a prefix along ``split_dim``; all of it unpadded)."""
        index = [slice(None)] * len(self.global_shape)
        if self.split_dim is not None:
            start, stop = self._real_rows()
            index[self.split_dim] = slice(0, stop - start)
        if self.experts is not None:
            index[0] = slice(0, self.experts[1])
        return tuple(index)

    @property
    def valid_shape(self) -> tuple[int, ...]:
        """Shape of this rank's real elements (``local_shape`` without padding rows; 0 rows possible)."""
        shape = list(self.local_shape)
        if self.split_dim is not None:
            start, stop = self._real_rows()
            shape[self.split_dim] = stop - start
        return tuple(shape)  # (an expert split is never padded)

    @property
    def valid_numel(self) -> int:
        """Number of real elements: the first ``valid_numel`` of the flattened slab (C order)."""
        n = 1
        for d in self.valid_shape:
            n *= d
        return n

    @property
    def replicated_over_tp(self) -> bool:
        return self.split_dim is None

    def counted_on(self, tp_rank: int) -> bool:
        """Whether the rank at ``tp_rank`` is the one that counts (grad norm) and saves (checkpoint) this
        parameter's elements among its tp group and the tied copies: never the tied copy; for
        TP-replicated weights tp rank 0 only. (The dp owner is decided by the caller's flat ranges.)"""
        return not self.tied_copy and (tp_rank == 0 or not self.replicated_over_tp)


def make_spec(name: str, global_shape, split_dim, tp_comm, padded_dim: int | None = None, **flags) -> SlabSpec:
    """The spec of ``name`` on this rank of ``tp_comm``; ``padded_dim``: dim 0 padded to that length."""
    size = 1 if tp_comm is None else tp_comm.size
    rank = 0 if tp_comm is None else tp_comm.rank
    if padded_dim == global_shape[0]:
        padded_dim = None
    if split_dim is not None:
        length = padded_dim if padded_dim is not None else global_shape[split_dim]
        if length % size:
            raise ValueError(f"{name}: dimension {split_dim} of global shape {tuple(global_shape)} (padded to "
                             f"{length}) is not divisible by tp={size}")
    return SlabSpec(name, tuple(global_shape), split_dim, rank, size, padded_dim=padded_dim, **flags)
