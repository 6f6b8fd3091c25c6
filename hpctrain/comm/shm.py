"""Node-local collectives through an MPI-3 shared-memory window (training uses them: intra_node.py).

``ShmCollectives(comm)`` is built collectively by every member of ``comm`` (a ``Communicator`` whose
ranks all live on one node). It allocates one window with ``MPI.Win.Allocate_shared`` on the node
communicator (``Split_type(COMM_TYPE_SHARED)``); every rank owns a slot of ``2 x capacity_bytes``
and maps every peer's slot as a numpy view (``Win.Shared_query``: no copies through MPI).

Operations on contiguous host (CPU) torch tensors of a numpy dtype (not bfloat16: numpy cannot add it),
worked on through their numpy views (a numpy call costs ~0.5 us, a torch call ~3 us), in place, any
length (tensors larger than ``capacity_bytes`` go through the window in portions of that size):
- ``reduce_scatter(output, input)``: each rank copies ``input`` into its slot; after a barrier, rank r
  sums ITS block reading every peer's slot in rank order 0..n-1 (``(s0 + s1) + s2 ...``);
- ``allgather(output, input)``: each rank copies ``input`` into its slot, then reads every peer's;
- ``allreduce(tensor)``: both: rank r sums its slice (length // n, balanced), publishes the sum in its
  slot, and every rank copies the published slices. Each element is summed once, by one rank, in a
  fixed order, so the result is bit-identical on every rank and from step to step.

Synchronisation: a barrier (arrival counters in the window's header, spun on: 0.5 us at 2 ranks, or
MPI ``Barrier`` on the node communicator: 2.2 us) fenced by ``Win.Sync()`` inside one passive
``Lock_all`` epoch (the MPI-3 shared-memory model). Each slot has two halves used alternately, so the
barrier that opens call k+1 also proves every peer finished reading call k's half: two barriers per
allreduce, one per reduce_scatter / allgather. Every call is registered with the group's watchdog as
one collective (``shm allreduce #k on group ...``), so a stopped rank is named in a hang report; each rank
also publishes in its header the number of the call it is in (``enter``), so a peer's report can tell a
rank stopped inside the exchange from one that never entered it (``progress``, hang_report.py).
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from hpctrain.comm.shm_memory import populate
from hpctrain.errors import HpcTrainError
from hpctrain.runtime.faults import FaultInjector

# the torch dtypes the shared-memory collectives sum (numpy has no bfloat16)
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    t: np.dtype(n) for t, n in ((torch.float64, "float64"), (torch.float32, "float32"), (torch.float16, "float16"),
                                (torch.int64, "int64"), (torch.int32, "int32"), (torch.int8, "int8"),
                                (torch.uint8, "uint8"))}

if TYPE_CHECKING:
    from hpctrain.comm.watchdog import OpCounter

SHM_OPS = ("allreduce", "reduce_scatter", "allgather")
ALIGN = 64  # bytes: slots and halves start on a cache line


class ShmUnavailable(HpcTrainError):
    """Shared-memory collectives cannot run for this group (it spans nodes, or no shared window)."""


class ShmSpansNodes(ShmUnavailable):
    """The group spans nodes (the hierarchical scheme, hierarchical.py, may still serve it)."""


def _faulty(sync, fault: FaultInjector):
    """``sync`` followed by ``fault.hit("shm", N)`` at this rank's N-th barrier: it arrived (the peers go on to
    the next barrier and wait there), then it stops, stalls or dies inside the exchange."""
    count = [0]

    def sync_then_fault() -> None:
        sync()
        count[0] += 1
        fault.hit("shm", count[0])
    return sync_then_fault


def _slice(length: int, n: int, j: int) -> tuple[int, int]:
    """Balanced contiguous slice j of n over ``length`` elements (odd lengths allowed)."""
    return length * j // n, length * (j + 1) // n


class ShmCollectives:
    """Shared-memory allreduce / reduce_scatter / allgather over ``comm`` (collective to build and close).

    ``capacity_bytes``: bytes per rank per half (rounded up to 64); a larger tensor goes through in
    portions of this size. The default 256 KiB keeps a portion cache-resident between the copy-in and the
    peers' reads: at 2 ranks on this machine 16 MiB allreduce takes 1.1 ms with 256 KiB portions,
    3.7 ms with 16 MiB ones (MPI: 2.9).
    ``barrier``: "flags" (arrival counters in the window, spun on) or "mpi" (``Barrier`` on the node).
    Raises ``ShmUnavailable`` (the same on every rank) when the group spans nodes or the window
    cannot be allocated or backed with memory (a full or tiny /dev/shm: shm_memory.py).
    """

    kind = "shm"  # grid.intra_node's name for this route (hierarchical.py's is "shm-hierarchical")

    def __init__(self, comm, capacity_bytes: int = 256 << 10, barrier: str = "flags"):
        from mpi4py import MPI

        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.capacity = -(-int(capacity_bytes) // ALIGN) * ALIGN
        self.node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        spans = comm.mpi.allreduce(int(self.node.Get_size() != comm.size), op=MPI.MAX)
        if spans:
            self.node.Free()
            raise ShmSpansNodes(f"shared-memory collectives on group '{comm.name}' (world ranks "
                                 f"{list(comm.members)}): the group spans nodes; shm needs all its ranks on one node")
        self.win, reason = None, ""
        try:
            self.win = MPI.Win.Allocate_shared(ALIGN + 2 * self.capacity, 1, comm=self.node)
        except MPI.Exception as e:  # no shared memory here (a container without /dev/shm, an MPI without it)
            reason = e.Get_error_string().strip() or str(e)
        else:  # the window's file is sparse: back this rank's part now, or fail here rather than SIGBUS later
            own, _ = self.win.Shared_query(self.rank)
            reason = populate(own.address, ALIGN + 2 * self.capacity)
        reason = next((r for r in comm.mpi.allgather(reason) if r), "")
        if reason:
            if self.win is not None:
                self.win.Free()
            self.node.Free()
            raise ShmUnavailable(f"shared-memory collectives on group '{comm.name}': cannot allocate a shared "
                                 f"window of {ALIGN + 2 * self.capacity} bytes per rank ({reason})")
        assert self.win is not None  # allocated on every rank: none gave a reason
        self.win.Lock_all(MPI.MODE_NOCHECK)
        # per group rank: its slot (uint8, both halves); in its header its barrier count and the sequence
        # number of the call it is in (``enter``; read by a peer's hang report: ``progress``)
        self.slots, self.arrivals, self.entries = [], [], []
        for j in range(self.size):
            buf, _ = self.win.Shared_query(j)
            memory = np.frombuffer(  # type: ignore[call-overload]  # numpy's stub lacks mpi4py's buffer type
                buf, dtype=np.uint8, count=ALIGN + 2 * self.capacity)
            self.arrivals.append(memory[:8].view(np.int64))
            self.entries.append(memory[8:16].view(np.int64))
            self.slots.append(memory[ALIGN:])
        self.arrivals[self.rank][0] = self.entries[self.rank][0] = 0
        self._arrived = 0  # barriers this rank has entered
        self._peers = [self.arrivals[j] for j in range(self.size) if j != self.rank]
        self.barrier = barrier
        self._sync = self._flag_barrier if barrier == "flags" else self._mpi_barrier
        fault = FaultInjector.from_env(comm.members[comm.rank])
        if fault.phase == "shm":  # test-only: this rank stops or stalls after its N-th barrier (faults.py)
            self._sync = _faulty(self._sync, fault)
        self.node.Barrier()  # every counter is zero before anyone counts
        self._half = 0
        self._counters: dict[str, OpCounter] = {}

    # ---------------------------------------------------------------- plumbing
    def enter(self, seq: int) -> None:
        """Publish in this rank's header that it is in the group's collective number ``seq`` (the watchdog's)."""
        self.entries[self.rank][0] = seq

    def progress(self) -> tuple[list[int], list[int], int, int] | None:
        """From the window, which a stopped peer cannot hide: (the call each group rank last entered, the
        barriers each has arrived at, the barrier this rank is in or last left, this rank); None after
        ``close`` or with the MPI barrier (no arrival counts)."""
        if self.win is None or self.barrier != "flags":
            return None
        return ([int(e[0]) for e in self.entries], [int(a[0]) for a in self.arrivals], self._arrived, self.rank)

    def _views(self, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """The next half of every slot as ``count`` elements of ``dtype`` (switches halves)."""
        start = self._half * self.capacity
        self._half ^= 1
        end = start + count * dtype.itemsize
        return [slot[start:end].view(dtype) for slot in self.slots]

    def _mpi_barrier(self) -> None:
        """Every rank's writes to its slot are visible to every peer (a memory barrier + node barrier)."""
        assert self.win is not None, "shm collectives used after close()"
        self.win.Sync()
        self.node.Barrier()
        self.win.Sync()

    def _flag_barrier(self) -> None:
        """The same through the window: publish this rank's arrival count, spin until every peer's has
        reached it (``Win.Sync`` is the memory fence around it). Spins ~50 us, then yields the core,
        then sleeps 50 us per check (an oversubscribed node, or a peer stuck: the watchdog reports it)."""
        assert self.win is not None, "shm collectives used after close()"
        self.win.Sync()
        self._arrived += 1
        target = self._arrived
        self.arrivals[self.rank][0] = target
        spins = 0
        for counter in self._peers:
            while counter[0] < target:
                spins += 1
                if spins > 200:
                    if spins > 2000:
                        time.sleep(50e-6)
                    else:
                        os.sched_yield()
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
        self.entries[self.rank][0] = self.comm.seq  # ``enter``: the call number begin gave it
        start = time.perf_counter()
        try:
            body(*args)
        finally:
            watchdog.end(token)
            counter.seconds += time.perf_counter() - start

    def _elements(self, array: np.ndarray) -> int:
        return max(1, self.capacity // array.itemsize)

    @staticmethod
    def _array(tensor: torch.Tensor, what: str) -> np.ndarray:
        """The flat numpy view of ``tensor``, over its address (numpy: about 5x less per-call overhead than
        torch ops); not ``Tensor.numpy()``, which would pin the storage's size (ZeRO frees and re-allocates
        bucket storage, hpctrain/parallel/data_parallel.py). The array holds the tensor (a worker thread may
        run the call after the caller dropped it), not its storage's size: the caller must not free the
        storage while the call runs."""
        dtype = _NUMPY_DTYPES.get(tensor.dtype)
        if tensor.is_cuda or dtype is None or not tensor.is_contiguous():
            raise ValueError(f"shm {what}: contiguous host tensors of a numpy dtype only (got {tensor.dtype} "
                             f"on {tensor.device}, contiguous={tensor.is_contiguous()})")
        if tensor.numel() == 0:
            return np.empty(0, dtype=dtype)
        memory = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
        memory.tensor = tensor  # type: ignore[attr-defined]  # the array keeps the tensor alive (comm.shm_progress=thread runs it later)
        return np.frombuffer(memoryview(memory).cast("B"), dtype=dtype)

    # ---------------------------------------------------------------- collectives
    def allreduce(self, tensor: torch.Tensor) -> None:
        """In place: every rank's ``tensor`` (any shape) becomes the sum over the group, summed in rank order."""
        self._watched("shm allreduce", tensor.nbytes, self._allreduce, self._array(tensor, "allreduce"))

    def _allreduce(self, flat: np.ndarray) -> None:
        if self.size == 1:
            return
        step = self._elements(flat)
        for off in range(0, flat.size, step):
            x = flat[off:off + step]
            views = self._views(x.dtype, x.size)
            np.copyto(views[self.rank], x)
            self._sync()
            lo, hi = _slice(x.size, self.size, self.rank)
            if hi > lo:
                mine = x[lo:hi]
                np.add(views[0][lo:hi], views[1][lo:hi], out=mine)
                for j in range(2, self.size):
                    np.add(mine, views[j][lo:hi], out=mine)
                np.copyto(views[self.rank][lo:hi], mine)
            self._sync()
            for j in range(self.size):
                if j != self.rank:
                    lo, hi = _slice(x.size, self.size, j)
                    np.copyto(x[lo:hi], views[j][lo:hi])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``input`` (size*m elements, block r for group rank r) summed over the group; block ``rank`` -> ``output`` (m)."""
        if input.numel() != self.size * output.numel() or input.dtype != output.dtype:
            raise ValueError(f"shm reduce_scatter: input has {input.numel()} {input.dtype} elements, expected "
                             f"{self.size} x {output.numel()} {output.dtype}")
        self._watched("shm reduce_scatter", input.nbytes, self._reduce_scatter,
                      self._array(output, "reduce_scatter"), self._array(input, "reduce_scatter"))

    def _reduce_scatter(self, output: np.ndarray, input: np.ndarray) -> None:
        n, m = self.size, output.size
        if n == 1:
            np.copyto(output, input)
            return
        blocks = input.reshape(n, m)
        step = max(1, self._elements(input) // n)
        for off in range(0, m, step):
            c = min(step, m - off)
            views = [v.reshape(n, c) for v in self._views(input.dtype, n * c)]
            np.copyto(views[self.rank], blocks[:, off:off + c])
            self._sync()
            out = output[off:off + c]
            np.add(views[0][self.rank], views[1][self.rank], out=out)
            for j in range(2, n):
                np.add(out, views[j][self.rank], out=out)

    def allgather(self, output: torch.Tensor, input: torch.Tensor | None = None) -> None:
        """``output`` (size*m elements) gets every rank's ``input`` (m) in group-rank order.
        ``input=None``: in place, this rank's block of ``output`` already holds its contribution."""
        if output.numel() % self.size or (input is not None and (input.numel() * self.size != output.numel()
                                                                 or input.dtype != output.dtype)):
            raise ValueError(f"shm allgather: output has {output.numel()} {output.dtype} elements, not "
                             f"{self.size} x the input")
        blocks = self._array(output, "allgather").reshape(self.size, -1)
        in_place = input is None
        source = blocks[self.rank] if input is None else self._array(input, "allgather")
        self._watched("shm allgather", output.nbytes, self._allgather, blocks, source, in_place)

    def _allgather(self, blocks: np.ndarray, source: np.ndarray, in_place: bool) -> None:
        m = blocks.shape[1]
        step = self._elements(source)
        for off in range(0, m, step):
            c = min(step, m - off)
            views = self._views(source.dtype, c)
            np.copyto(views[self.rank], source[off:off + c])
            self._sync()
            for j in range(self.size):
                if j != self.rank or not in_place:
                    np.copyto(blocks[j, off:off + c], views[j])

    def close(self) -> None:
        """Collective: free the window and the node communicator (idempotent)."""
        if self.win is None:
            return
        self.slots = []
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()
        self.win = None
