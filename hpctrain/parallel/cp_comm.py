"""The communication of context parallelism: one step of the ring, on the CP group.

Ring attention (context_parallel.py) moves K/V blocks forward around the cp group (group rank r sends
to r+1 and receives from r-1, modulo cp) and, in backward, the partial dK/dV of each block after them,
until they are back with their owner. Every step is one non-blocking ``Communicator.exchange`` (a send
and a receive posted together: no deadlock on NCCL or MPI, numbered by the watchdog, so a rank that
stops inside the ring is named in the hang report); the caller computes on the block it holds while
the next one travels, calling ``RingStep.test`` between pieces of work to drive MPI progress.

Send/receive plan of one ring attention call on cp ranks (every rank, in this order):
    forward:  cp-1 passes of the packed K/V block  (tag KV_TAG)
    backward: cp-1 passes of the packed K/V block  (tag KV_TAG)
              cp   passes of the packed dK/dV block (tag GRAD_TAG), the last one home to the owner
Each pass sends to ``next_rank`` and receives from ``prev_rank``, so the plan is the same on every rank
and matches pairwise (docs/parallelism.md, "Context parallelism").
"""
from __future__ import annotations

import torch

KV_TAG = 71  # K/V blocks travelling forward
GRAD_TAG = 72  # their partial gradients travelling after them


def next_rank(comm) -> int:
    """The cp group rank this rank sends to."""
    return (comm.rank + 1) % comm.size


def prev_rank(comm) -> int:
    """The cp group rank this rank receives from."""
    return (comm.rank - 1) % comm.size


class RingStep:
    """One pass of ``tensor`` to the next rank of the ring while the previous rank's arrives.

    ``received`` is a new buffer (shape and dtype of ``tensor``: every rank of the ring sends blocks of
    one shape) filled once ``wait()`` returns. ``tensor`` must not be written before then.
    """

    __slots__ = ("received", "handle", "_sent")

    def __init__(self, comm, tensor: torch.Tensor, tag: int):
        tensor = tensor.contiguous()
        self._sent: torch.Tensor | None = tensor  # alive until the send completes
        self.received = torch.empty_like(tensor)
        self.handle = comm.exchange(sends=[(tensor, next_rank(comm), tag)],
                                    recvs=[(self.received, prev_rank(comm), tag)])

    def test(self) -> bool:
        """Drive progress (never blocks); True once both sides are done."""
        return self.handle.test()

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        self._sent = None
        return self.received


def ring_plan(rank: int, cp: int) -> list[list[tuple[str, int, int]]]:
    """The posts of one ring attention call (forward and backward) on cp rank ``rank``, in the order
    ``context_parallel.py`` issues them: ``[[("send" | "recv", peer, tag)]]``, one list per exchange, for
    ``schedules.rendezvous_completes`` (tests/unit/test_context_parallel.py records the real calls
    and compares). Backward, pass i's K/V exchange is posted before the dK/dV exchange of pass i - 1."""
    after, before = (rank + 1) % cp, (rank - 1) % cp

    def one(tag):
        return [("send", after, tag), ("recv", before, tag)]

    if cp == 1:
        return []
    forward = [one(KV_TAG) for _ in range(cp - 1)]
    backward = []
    for i in range(cp):
        if i < cp - 1:
            backward.append(one(KV_TAG))
        backward.append(one(GRAD_TAG))
    return forward + backward


def ring_step(comm, tensor: torch.Tensor, tag: int) -> RingStep | None:
    """Post one pass of the ring; None on a ring of one rank (nothing travels)."""
    if comm is None or comm.size == 1:
        return None
    return RingStep(comm, tensor, tag)
