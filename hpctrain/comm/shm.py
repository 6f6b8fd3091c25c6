"""Node-local collectives through an MPI-3 shared-memory window (step 1 of issue #21; not yet used by training).

``ShmCollectives(comm)`` is built collectively by every member of ``comm`` (a ``Communicator`` whose
ranks all live on one node). It allocates one window with ``MPI.Win.Allocate_shared`` on the node
communicator (``Split_type(COMM_TYPE_SHARED)``); every rank owns a slot of ``2 x capacity_bytes``
and maps every peer's slot as a numpy/torch view (``Win.Shared_query``: no copies through MPI).

Operations on host (CPU) tensors, in place, any length (tensors larger than ``capacity_bytes`` go in
chunks):
- ``reduce_scatter(output, input)``: each rank copies ``input`` into its slot; after a barrier, rank r
  sums ITS block reading every peer's slot in rank order 0..n-1 (``(s0 + s1) + s2 ...``);
- ``allgather(output, input)``: each rank copies ``input`` into its slot, then reads every peer's;
- ``allreduce(tensor)``: both: rank r sums its slice (length // n, balanced), publishes the sum in its
  slot, and every rank copies the published slices. Each element is summed once, by one rank, in a
  fixed order, so the result is bit-identical on every rank and from step to step.

Synchronisation: ``Win.Sync(); Barrier(); Win.Sync()`` on the node communicator inside one passive
``Lock_all`` epoch (the MPI-3 shared-memory model). Each slot has two halves used alternately, so the
barrier that opens call k+1 also proves every peer finished reading call k's half: two barriers per
allreduce, one per reduce_scatter / allgather. Every call is registered with the group's watchdog as
one collective (``shm allreduce #k on group ...``), so a stopped rank is named in a hang report.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from hpctrain.errors import HpcTrainError

SHM_OPS = ("allreduce", "reduce_scatter", "allgather")
ALIGN = 64  # bytes: slots and halves start on a cache line


class ShmUnavailable(HpcTrainError):
    """Shared-memory collectives cannot run for this group (it spans nodes, or no shared window)."""


def _slice(length: int, n: int, j: int) -> tuple[int, int]:
    """Balanced contiguous slice j of n over ``length`` elements (odd lengths allowed)."""
    return length * j // n, length * (j + 1) // n


class ShmCollectives:
    """Shared-memory allreduce / reduce_scatter / allgather over ``comm`` (collective to build and close).

    ``capacity_bytes``: bytes per rank per half (rounded up to 64); larger tensors are chunked.
    Raises ``ShmUnavailable`` (the same on every rank) when the group spans nodes or the window
    cannot be allocated.
    """

    def __init__(self, comm, capacity_bytes: int = 16 << 20):
        from mpi4py import MPI

        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.capacity = -(-int(capacity_bytes) // ALIGN) * ALIGN
        self.node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        spans = comm.mpi.allreduce(int(self.node.Get_size() != comm.size), op=MPI.MAX)
        if spans:
            self.node.Free()
            raise ShmUnavailable(f"shared-memory collectives on group '{comm.name}' (world ranks "
                                 f"{list(comm.members)}): the group spans nodes; shm needs all its ranks on one node")
        self.win, reason = None, ""
        try:
            self.win = MPI.Win.Allocate_shared(2 * self.capacity, 1, comm=self.node)
        except MPI.Exception as e:  # no shared memory here (a container without /dev/shm, an MPI without it)
            reason = e.Get_error_string().strip() or str(e)
        failed = comm.mpi.allreduce(int(self.win is None), op=MPI.MAX)
        if failed:
            if self.win is not None:
                self.win.Free()
            self.node.Free()
            raise ShmUnavailable(f"shared-memory collectives on group '{comm.name}': cannot allocate a shared "
                                 f"window of {2 * self.capacity} bytes per rank ({reason or 'failed on a peer rank'})")
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.slots = []  # per group rank: the uint8 torch view of its slot (both halves)
        for j in range(self.size):
            buf, _ = self.win.Shared_query(j)
            self.slots.append(torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=2 * self.capacity)))
        self._half = 0
        self._counters = {}

    # ---------------------------------------------------------------- plumbing
    def _views(self, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """The next half of every slot as ``count`` elements of ``dtype`` (switches halves)."""
        start = self._half * self.capacity
        self._half ^= 1
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return [slot[start:start + nbytes].view(dtype) for slot in self.slots]

    def _sync(self) -> None:
        """Every rank's writes to its slot are visible to every peer (a memory barrier + node barrier)."""
        self.win.Sync()
        self.node.Barrier()
        self.win.Sync()

    def _watched(self, op: str, nbytes: int, body, *args) -> None:
        """Run ``body(*args)`` as one collective on the group: counted and watched by its watchdog."""
        counter = self._counters.get(op)
        if counter is None:
            counter = self._counters[op] = self.comm.stats.ops[(self.comm.name, op)]
        counter.calls += 1
        counter.bytes += nbytes
        watchdog = self.comm.watchdog
        token = watchdog.begin(op, self.comm, nbytes)
        start = time.perf_counter()
        try:
            body(*args)
        finally:
            watchdog.end(token)
            counter.seconds += time.perf_counter() - start

    def _elements(self, tensor: torch.Tensor) -> int:
        return max(1, self.capacity // tensor.element_size())

    @staticmethod
    def _check(tensor: torch.Tensor, what: str) -> None:
        if tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError(f"shm {what}: host tensors only, contiguous (got device {tensor.device}, "
                             f"contiguous={tensor.is_contiguous()})")

    # ---------------------------------------------------------------- collectives
    def allreduce(self, tensor: torch.Tensor) -> None:
        """In place: every rank's ``tensor`` (any shape) becomes the sum over the group, summed in rank order."""
        self._check(tensor, "allreduce")
        self._watched("shm allreduce", tensor.nbytes, self._allreduce, tensor.view(-1))

    def _allreduce(self, flat: torch.Tensor) -> None:
        if self.size == 1:
            return
        step = self._elements(flat)
        for off in range(0, flat.numel(), step):
            x = flat[off:off + step]
            views = self._views(x.dtype, x.numel())
            views[self.rank].copy_(x)
            self._sync()
            lo, hi = _slice(x.numel(), self.size, self.rank)
            if hi > lo:
                mine = x[lo:hi]
                torch.add(views[0][lo:hi], views[1][lo:hi], out=mine)
                for j in range(2, self.size):
                    mine.add_(views[j][lo:hi])
                views[self.rank][lo:hi].copy_(mine)
            self._sync()
            for j in range(self.size):
                if j != self.rank:
                    lo, hi = _slice(x.numel(), self.size, j)
                    x[lo:hi].copy_(views[j][lo:hi])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``input`` (size*m elements, block r for group rank r) summed over the group; block ``rank`` -> ``output`` (m)."""
        self._check(input, "reduce_scatter")
        self._check(output, "reduce_scatter")
        if input.numel() != self.size * output.numel():
            raise ValueError(f"shm reduce_scatter: input has {input.numel()} elements, expected "
                             f"{self.size} x {output.numel()}")
        self._watched("shm reduce_scatter", input.nbytes, self._reduce_scatter, output.view(-1), input.view(-1))

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n, m = self.size, output.numel()
        if n == 1:
            output.copy_(input)
            return
        blocks = input.view(n, m)
        step = max(1, self._elements(input) // n)
        for off in range(0, m, step):
            c = min(step, m - off)
            views = [v.view(n, c) for v in self._views(input.dtype, n * c)]
            views[self.rank].copy_(blocks[:, off:off + c])
            self._sync()
            out = output[off:off + c]
            torch.add(views[0][self.rank], views[1][self.rank], out=out)
            for j in range(2, n):
                out.add_(views[j][self.rank])

    def allgather(self, output: torch.Tensor, input: torch.Tensor | None = None) -> None:
        """``output`` (size*m elements) gets every rank's ``input`` (m) in group-rank order.
        ``input=None``: in place, this rank's block of ``output`` already holds its contribution."""
        self._check(output, "allgather")
        if output.numel() % self.size or (input is not None and input.numel() * self.size != output.numel()):
            raise ValueError(f"shm allgather: output has {output.numel()} elements, not {self.size} x the input")
        blocks = output.view(self.size, -1)
        source = blocks[self.rank] if input is None else input.reshape(-1)
        self._watched("shm allgather", output.nbytes, self._allgather, blocks, source)

    def _allgather(self, blocks: torch.Tensor, source: torch.Tensor) -> None:
        m = blocks.shape[1]
        step = self._elements(source)
        for off in range(0, m, step):
            c = min(step, m - off)
            views = self._views(source.dtype, c)
            views[self.rank].copy_(source[off:off + c])
            self._sync()
            for j in range(self.size):
                if j != self.rank or source.data_ptr() != blocks[j].data_ptr():
                    blocks[j, off:off + c].copy_(views[j])

    def close(self) -> None:
        """Collective: free the window and the node communicator (idempotent)."""
        if self.win is None:
            return
        self.slots = []
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()
        self.win = None
