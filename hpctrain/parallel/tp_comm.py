"""Autograd communication ops of tensor (and sequence) parallelism, all on the TP group.

Activations are sequence-first ``[S, B, D]`` so sequence-parallel splits are along dim 0, which is
contiguous: all-gather and reduce-scatter then work on the tensor's own storage.

    op                     forward                      backward
    copy_to_tp             identity                     allreduce(grad)
    reduce_from_tp         allreduce(x)                 identity
    gather_seq             all-gather on dim 0 (SP)     reduce-scatter on dim 0
    reduce_scatter_seq     reduce-scatter on dim 0 (SP) all-gather on dim 0
    max_over_tp            allreduce(x, max)            none (a detached shift)
"""
from __future__ import annotations

import torch


def _allgather_dim0(x: torch.Tensor, comm) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((comm.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.allgather(out, x)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, comm) -> torch.Tensor:
    if x.shape[0] % comm.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp={comm.size} "
                         f"(sequence parallelism needs train.seq_len % tp == 0)")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // comm.size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, x)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.allreduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        x = x.contiguous().clone()
        comm.allreduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _allgather_dim0(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.comm), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_dim0(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _allgather_dim0(grad, ctx.comm), None


def _skip(comm) -> bool:
    return comm is None or comm.size == 1


def _tp_collective(op, x, comm):
    """``op.apply(x, comm)``; under torch.compile run eagerly (its mpi4py calls cannot be traced): a graph
    break by design (hpctrain/models/compile.py). Decorated lazily: torch._dynamo costs a second to import."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(op.apply, reason="tp collective (mpi4py)")(x, comm)
    return op.apply(x, comm)


def copy_to_tp(x, comm):
    return x if _skip(comm) else _tp_collective(_CopyToTP, x, comm)


def reduce_from_tp(x, comm):
    return x if _skip(comm) else _tp_collective(_ReduceFromTP, x, comm)


def gather_seq(x, comm):
    return x if _skip(comm) else _tp_collective(_GatherSeq, x, comm)


def reduce_scatter_seq(x, comm):
    return x if _skip(comm) else _tp_collective(_ReduceScatterSeq, x, comm)


def _allreduce_max(x: torch.Tensor, comm) -> torch.Tensor:
    x = x.detach().contiguous().clone()
    comm.allreduce(x, op="max")
    return x


def max_over_tp(x, comm):
    """The elementwise max of ``x`` over the tp group, detached (a shift no gradient flows through, as the
    vocab-parallel cross-entropy's running max); under torch.compile run eagerly, like the ops above."""
    if _skip(comm):
        return x.detach()
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_allreduce_max, reason="tp collective (mpi4py)")(x, comm)
    return _allreduce_max(x, comm)
