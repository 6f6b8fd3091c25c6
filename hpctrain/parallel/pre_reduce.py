"""The deferred bucket's pre-reductions (data_parallel.py, ``FlatParams.finish_reduction``): gradients that
must be summed over ANOTHER group before the replica group's reduction.

- ``SlabSpec.partial_grad_over_tp``: sequence-parallel norm weights, LoRA's A of column-parallel and B of
  row-parallel linears, partial per tp rank: summed over **tp** in ONE all-reduce of their contiguous span
  (flat_layout.py puts them first in the deferred bucket);
- a tied embedding: stage 0's embedding and the last stage's LM-head copy exchange their gradients over **pp**
  and add them (zb-v: rank 0 holds both, added locally).
"""
from __future__ import annotations

import torch

from hpctrain.parallel.buckets import Bucket

TIED_GRAD_TAG = 23  # beside the pipeline's ACT_TAG = 21, GRAD_TAG = 22 on the same pp communicator


def pre_reduce(bucket: Bucket, offsets: dict[int, tuple[int, int]], tp_comm, pp_comm) -> None:
    """Collective over tp and/or pp: the deferred ``bucket``'s partial and tied gradients summed in place
    (``offsets``: id(parameter) -> (start in the flat buffers, elements))."""
    sum_partial_grads_over_tp(bucket, [p for p in bucket.params if p.spec.partial_grad_over_tp], offsets, tp_comm)
    tied = [p for p in bucket.params if p.spec.tied]
    if len(tied) == 2:  # zb-v: rank 0 holds the first virtual stage and the last, the original and its copy
        total = tied[0].main_grad + tied[1].main_grad
        for p in tied:
            p.main_grad.copy_(total)
    for p in tied[:1] if len(tied) == 1 else []:
        sum_tied_embedding_grad(p, pp_comm)


def sum_partial_grads_over_tp(bucket: Bucket, params: list, offsets: dict[int, tuple[int, int]], tp_comm) -> None:
    """Grads partial per TP rank (a replicated norm weight that saw S/tp tokens with sequence parallelism,
    a LoRA factor that saw 1/tp of its linear's outputs or inputs): one all-reduce over tp of their
    span of the bucket's grads (they lie next to each other at the deferred bucket's start)."""
    if not params or tp_comm is None or tp_comm.size == 1:
        return
    spans = sorted(offsets[id(p)] for p in params)
    lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
    assert sum(n for _, n in spans) == hi - lo, "partial-over-tp grads are not contiguous"
    tp_comm.allreduce(bucket.grads[lo - bucket.start:hi - bucket.start])


def sum_tied_embedding_grad(p, pp_comm) -> None:
    """Stage 0's embedding and the last stage's LM-head copy exchange grads over pp and add them."""
    peer = pp_comm.size - 1 if pp_comm.rank == 0 else 0
    theirs = torch.empty_like(p.main_grad)
    mine = p.main_grad.contiguous()  # posted together: one NCCL group, no send/recv ordering
    pp_comm.exchange([(mine, peer, TIED_GRAD_TAG)], [(theirs, peer, TIED_GRAD_TAG)]).wait()
    p.main_grad.add_(theirs)
