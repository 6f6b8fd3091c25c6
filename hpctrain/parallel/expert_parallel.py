"""Expert parallelism: the (token, choice) rows of an MoE layer travel to the ep rank that holds their expert
and back, by all-to-all on the ep group (``Dispatcher``), with its autograd op beside it.

An ep group is ``parallel.ep`` consecutive ranks of the replica group (dp x cp; hpctrain/comm/grid.py):
rank r of it holds experts [r E/ep, (r + 1) E/ep) of every MoE layer (``Experts.first``, ``count``). Every
rank routes its own tokens; the rows bound for each expert are sent to its holder (dispatch), computed
there as one batch with the rows of every other rank of the group, and sent back (combine). Backward runs
the same two all-to-alls the other way. Expert gradients are then partial per holder: they are summed over
the replicas that hold the same experts (the ``ep_replica`` group), the rest of the model over dp x cp.

    op               forward                         backward
    all_to_all_rows  rows -> their ranks (alltoallv)  grads back the same way reversed

Every rank gathers every rank's per-expert counts (one small all-gather), so each knows the largest block
of the call: large blocks then go one Isend/Irecv per peer on host tensors (Communicator.alltoallv).
"""
from __future__ import annotations

import time

import torch


def _traced_alltoallv(comm, out, recv, rows, send, largest: int | None, label: str) -> None:
    """``comm.alltoallv``; with a trace recording, also a span ``label`` on the "moe all-to-all" track (the
    Communicator's own event says only "alltoallv on ep")."""
    trace = comm.trace
    start = time.perf_counter()
    comm.alltoallv(out, recv, rows, send, largest_block=largest)
    if trace is not None and trace.active:
        trace.span(label, "moe all-to-all", start, time.perf_counter(), rows=int(rows.shape[0]))


class _AllToAllRows(torch.autograd.Function):
    """rows [sum(send), D] cut into ``send[j]`` rows for rank j -> [sum(recv), D], ``recv[i]`` from rank i."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], largest: int | None, comm, label: str):
        ctx.send, ctx.recv, ctx.largest, ctx.comm, ctx.label = send, recv, largest, comm, label
        rows = rows.contiguous()
        out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
        _traced_alltoallv(comm, out, recv, rows, send, largest, label)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        _traced_alltoallv(ctx.comm, out, ctx.send, grad, ctx.recv, ctx.largest, ctx.label + " (backward)")
        return out, None, None, None, None, None


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], comm, label: str = "",
                    largest: int | None = None) -> torch.Tensor:
    """Differentiable Alltoallv of ``rows`` on ``comm`` (module docstring); ``label`` names it in a trace.
    ``largest``: the largest block of any rank in this call, the same on every rank (or None)."""
    return _AllToAllRows.apply(rows, send, recv, largest, comm, label)


class Dispatcher:
    """Takes an MoE layer's rows to this ep group's experts and back. ``comm``: the ep group (None or size 1:
    every expert is local, no communication)."""

    def __init__(self, comm, num_experts: int, name: str = ""):
        self.comm = comm if comm is not None and comm.size > 1 else None
        self.name = name  # the layer's (``layers.N.moe``): the trace's spans say which layer dispatches
        self.num_experts = num_experts
        self.per_rank = num_experts // (1 if self.comm is None else self.comm.size)

    def run(self, rows: torch.Tensor, expert: torch.Tensor, experts) -> torch.Tensor:
        """rows [N, D] and their global expert ids ``expert`` [N] (sorted ascending) -> the experts' outputs
        [N, D] in the same order (partial over tp). ``experts``: this rank's ``Experts`` module. Talks on ep:
        one all-gather of the per-expert counts, two all-to-alls of the rows (forward), two of their gradients."""
        counts = torch.bincount(expert, minlength=self.num_experts)
        if self.comm is None:
            return experts(rows, counts)
        ep = self.comm.size
        sent_counts = counts.view(ep, self.per_rank).cpu()  # [to rank, its local expert]
        every = torch.empty((ep,) + sent_counts.shape, dtype=sent_counts.dtype)  # [from rank, to rank, expert]
        self.comm.allgather(every, sent_counts)
        got_counts = every[:, self.comm.rank]  # [from rank, my local expert]
        blocks = every.sum(2)  # [from rank, to rank]: rows per block
        send, recv, largest = blocks[self.comm.rank].tolist(), blocks[:, self.comm.rank].tolist(), int(blocks.max())
        arrived = all_to_all_rows(rows, send, recv, self.comm, f"{self.name} dispatch", largest)  # by source, by expert
        local = torch.repeat_interleave(torch.arange(self.per_rank).repeat(ep), got_counts.reshape(-1))
        order = torch.argsort(local.to(rows.device), stable=True)  # expert-major, then source
        computed = experts(arrived[order], got_counts.sum(0).to(rows.device), got_counts)  # by expert, by source
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_rows(computed[back], recv, send, self.comm, f"{self.name} combine", largest)
