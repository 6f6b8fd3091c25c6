"""Slab spec (``SlabSpec``): where each number of a parameter lives. One source of truth for init,
checkpoints and tests.

Every parameter carries ``param.spec``: its global name and shape, and which SLAB of it this rank
holds (a split along ``split_dim`` over the TP group, or the whole tensor when replicated).
Pipeline stages simply do not hold the parameters of other stages (except the tied embedding's
copy, marked by ``tied``). Words (one meaning each, docs/architecture.md): a **slab** is this tp
split of a parameter; a **slice** is a ZeRO-1 owner's part of the flat optimizer state
(``optim/flat.py`` ``OptimizerSlice``); a **chunk** is a sequence-parallel part of the sequence; a
**shard** is one rank's checkpoint file (``shards/shard-RRRRR.h5``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlabSpec:
    name: str  # global parameter name, e.g. "layers.3.attn.wq.weight"
    global_shape: tuple[int, ...]
    split_dim: int | None = None  # dimension split over the TP group; None = replicated over TP
    tp_rank: int = 0
    tp_size: int = 1
    sp_partial_grad: bool = False  # replicated weight whose grad is partial per TP rank (sequence parallel)
    # tied embeddings across pipeline stages (pp > 1): "original" on stage 0, "copy" on the last stage
    # (its LM head); the two grads are summed before the dp reduction; the copy is never saved or
    # counted twice. "" = not tied across stages (a tie inside one stage is one shared Parameter).
    tied: str = ""

    @property
    def tied_copy(self) -> bool:
        return self.tied == "copy"

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.split_dim is not None:
            shape[self.split_dim] //= self.tp_size
        return tuple(shape)

    def local_slices(self) -> tuple[slice, ...]:
        """Index of this rank's slab in the global tensor."""
        index = [slice(None)] * len(self.global_shape)
        if self.split_dim is not None:
            n = self.global_shape[self.split_dim] // self.tp_size
            index[self.split_dim] = slice(self.tp_rank * n, (self.tp_rank + 1) * n)
        return tuple(index)

    @property
    def replicated_over_tp(self) -> bool:
        return self.split_dim is None

    def counted_on(self, tp_rank: int) -> bool:
        """Whether the rank at ``tp_rank`` is the one that counts (grad norm) and saves (checkpoint) this
        parameter's elements among its tp group and the tied copies: never the tied copy; for
        TP-replicated weights tp rank 0 only. (The dp owner is decided by the caller's flat ranges.)"""
        return not self.tied_copy and (tp_rank == 0 or not self.replicated_over_tp)


def make_spec(name: str, global_shape, split_dim, tp_comm, **flags) -> SlabSpec:
    size = 1 if tp_comm is None else tp_comm.size
    rank = 0 if tp_comm is None else tp_comm.rank
    if split_dim is not None and global_shape[split_dim] % size:
        raise ValueError(f"{name}: dimension {split_dim} of global shape {tuple(global_shape)} is not "
                         f"divisible by tp={size}")
    return SlabSpec(name, tuple(global_shape), split_dim, rank, size, **flags)


def global_generator(seed: int, name: str) -> torch.Generator:
    """A generator that depends only on (seed, parameter name): the same numbers in every layout."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


@torch.no_grad()
def init_from_global_(param: torch.Tensor, spec: SlabSpec, seed: int, std: float | None) -> None:
    """Fill ``param`` with its slab of the GLOBAL tensor N(0, std) (std None: ones)."""
    if std is None:
        param.fill_(1.0)
        return
    full = torch.empty(spec.global_shape, dtype=torch.float64)
    full.normal_(0.0, std, generator=global_generator(seed, spec.name))
    param.copy_(full[spec.local_slices()])
