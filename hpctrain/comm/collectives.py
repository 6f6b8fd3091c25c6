"""One door to the network: collectives over torch tensors, per process group.

A ``Communicator`` wraps one mpi4py communicator (a dp, pp, tp or world group). Every call:
- picks a backend by the tensor's device and the configured choice: host tensors -> MPI, or the
  group's ``ShmRoute`` for CPU float sums when ``comm.intra_node`` gave it one (intra_node.py);
  CUDA tensors -> the group's device backend, chosen collectively by ``prepare_device``: NCCL (CuPy),
  CUDA-aware MPI, or MPI with host staging;
- is zero-copy (the tensor's own storage is the MPI/NCCL buffer; reductions are in place);
- is counted (bytes, bytes sent on the wire, calls, blocked seconds) and watched (``Watchdog``: collectives are numbered per
  group; a stalled call aborts the job with a report naming the ranks that never reached it);
- with ``check`` on (``comm.check = true``), is preceded by a fingerprint exchange: every member must
  call the same collective with the same size and type, else ``CommCheckError`` names the first
  divergence (a debugging mode: one extra small allgather per call); for ``alltoallv`` also that the
  splits agree (what rank i sends to rank j is what j expects from i).

Bytes on the wire (``OpCounter.sent``) follow the bandwidth-optimal algorithms MPI and NCCL use for
large messages, per rank of a group of p: allreduce 2(p-1)/p x n, reduce-scatter / allgather /
alltoall / broadcast (p-1)/p x n (n = the full buffer), alltoallv the rows sent to other ranks, send
n; at p = 2 that is exact for any algorithm, and tests/integration/test_two_hosts.py checks it against
a veth link's byte counters.

Blocking calls return None; ``nonblocking=True`` returns a ``Handle`` to ``wait()`` or ``test()``
(calling ``test`` between pieces of work drives MPI progress and gives overlap: see
docs/architecture.md). Ranks in ``src``/``dst``/``root`` are ranks WITHIN this group.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from hpctrain.comm.backends.mpi import MpiBackend
from hpctrain.comm.bound import BoundCalls
from hpctrain.comm.handle import Handle, _end  # noqa: F401 - _end: tests import it from here
from hpctrain.comm.persistent import Recurring
from hpctrain.comm.watchdog import IDLE, CommStats, Watchdog, clock
from hpctrain.errors import HpcTrainError

# alltoallv given ``largest_block`` sends host blocks one Isend/Irecv per peer from this size on (the default
# of comm.alltoall_by_peer_kib): faster than PyPI MPICH's Alltoallv from 128 KiB blocks at 2 ranks, while
# 64 KiB blocks at 4 ranks were slower (``hpctrain bench comm --ops alltoall``, docs/benchmarks.md)
ALLTOALL_BY_PEER_BYTES = 128 << 10

if TYPE_CHECKING:
    from hpctrain.comm.backends.nccl import NcclBackend
    from hpctrain.comm.backends.staged import HostStagedBackend
    from hpctrain.comm.watchdog import OpCounter, Slot

BACKEND_CHOICES = ("auto", "mpi", "cuda-mpi", "nccl")


class CommSetupError(HpcTrainError):
    """The requested collective backend cannot run here (no NCCL, ranks sharing a GPU, ...)."""


class CommCheckError(HpcTrainError):
    """comm.check: the members of a group called different collectives (a bug in the caller)."""


class Communicator:
    """Collectives on one group. ``members``: the world ranks of the group, in group-rank order."""

    def __init__(self, mpi_comm, name: str, members: tuple[int, ...], watchdog: Watchdog,
                 stats: CommStats, backend: str = "auto", check: bool = False):
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"unknown comm backend {backend!r}; expected one of {BACKEND_CHOICES}")
        self.mpi = mpi_comm
        self.name = name
        self.members = tuple(members)
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.watchdog = watchdog
        self.stats = stats
        self.backend_choice = backend
        # bytes sent per byte of the buffer (bandwidth-optimal algorithms; OpCounter.sent)
        self._allreduce_wire = 2 * (self.size - 1) / self.size
        self._spread_wire = (self.size - 1) / self.size  # reduce-scatter, all-gather, alltoall, broadcast
        self._host = MpiBackend(mpi_comm)
        self._bound = BoundCalls(mpi_comm)  # blocking host calls bound to their tensors (the hot path, bound.py)
        self._device: MpiBackend | HostStagedBackend | NcclBackend | None = None  # created on the first CUDA tensor (NCCL init is collective and costly)
        self.staged_because = ""  # why CUDA tensors go through host memory (prepare_device), "" when they do not
        self.shm = None  # a ShmRoute (comm.intra_node, intra_node.py): CPU float sums in shared memory
        self.recurring: list[Recurring] = []  # persistent small collectives on this group (freed at close)
        self._counters: dict[str, OpCounter] = {}  # op -> this group's OpCounter in ``stats``
        self._slots: dict[str, Slot] = {}  # op -> its watchdog slot (with its counter): blocking host calls
        self.check = check
        # alltoallv given ``largest_block``: host blocks of this many bytes or more go one Isend/Irecv per peer
        self.alltoall_by_peer_bytes = ALLTOALL_BY_PEER_BYTES
        self.trace = None  # a TraceRecorder (train.trace): every call recorded while it is active
        self.seq = self.p2p_seq = 0  # collectives / point-to-point calls started on this group (Watchdog)
        self.done_seq = 0  # the last collective completed: its number, op and clock() time
        self.done_op: str | None = None
        self.done_at: float | None = None
        watchdog.groups.append(self)

    # ---------------------------------------------------------------- backend choice
    def backend_for(self, tensor: torch.Tensor):
        if not tensor.is_cuda:
            return self._host
        if self._device is None:
            raise RuntimeError(f"group {self.name}: a CUDA tensor before prepare_device(); the grid's "
                               f"use_device() sets up the device backend of every group collectively")
        return self._device

    def prepare_device(self, device: torch.device) -> str:
        """Collective over this group: choose and create the backend for CUDA tensors; returns its name.

        ``auto``: NCCL (CuPy) when it imports and every rank of the group drives its own GPU, else MPI
        with host staging (works with any MPI and with ranks sharing a GPU). ``mpi``: host staging.
        ``cuda-mpi``: device pointers straight to a CUDA-aware MPI. ``nccl``: NCCL or a clear error.
        Must be called by every rank of the group, in the same order for every group (NCCL init is
        collective); a host ``device`` needs nothing.
        """
        if device.type != "cuda":
            return "mpi"
        if self._device is not None:
            return self._device.name
        from hpctrain.comm.backends.nccl import NcclBackend, distinct_gpus, nccl_available
        from hpctrain.comm.backends.staged import HostStagedBackend

        choice = self.backend_choice
        if choice in ("auto", "nccl"):
            ok, reason = nccl_available()
            if ok:
                ok, reason = distinct_gpus(self.mpi, device)
            if ok:
                self._device = NcclBackend(self.mpi)
            elif choice == "nccl":
                raise CommSetupError(f"parallel.backend='nccl' for group {self.name}, but {reason}; use "
                                     f"parallel.backend='auto' or 'mpi' (host staging) or one GPU per rank")
        if self._device is None:
            self._device = MpiBackend(self.mpi, cuda_aware=True) if choice == "cuda-mpi" \
                else HostStagedBackend(self.mpi)
            if choice == "auto" and self._device.name == HostStagedBackend.name:
                self.staged_because = reason  # why NCCL was not used (hpctrain/comm/staging.py warns)
            elif choice == "mpi":
                self.staged_because = "parallel.backend='mpi'"
        return self._device.name

    def close(self) -> None:
        """Release the device backend (the NCCL communicator); the MPI communicator stays the grid's."""
        if self._device is not None and hasattr(self._device, "close"):
            self._device.close()
        if self.shm is not None:  # collective over the group, like the grid's close
            self.shm.close()
        self._bound.clear()
        for slot in self._slots.values():
            self.watchdog.unslot(slot)
        self._slots = {}
        for op in self.recurring:
            op.free()
        self.recurring = []
        self._device = self.shm = None

    # ---------------------------------------------------------------- plumbing
    def _run(self, op: str, nbytes: int, nonblocking: bool, method, *args, peer=None, fingerprint=None,
             wire: float | None = None, route: str = "", splits=None):
        """Count, watch and time ``method(*args, nonblocking)`` (the hot path: attribute updates only).
        ``peer``: the group rank of a point-to-point call; ``fingerprint``: what comm.check compares;
        ``wire``: bytes sent per byte of ``nbytes`` (default (p-1)/p); ``route``: how the call travels when
        not through MPI (the shm route's name, for hang reports); ``splits``: an alltoallv's (input_splits,
        output_splits), which comm.check matches across the group."""
        counter = self._counter(op)
        sent = int(nbytes * (wire if wire is not None else (self.size - 1) / self.size))
        counter.calls += 1
        counter.bytes += nbytes
        counter.sent += sent
        if self.check and peer is None:
            self.check_same_call(op, fingerprint, splits)
        watchdog, trace = self.watchdog, self.trace
        token = watchdog.begin(op, self, nbytes, peer)
        if route:
            watchdog.set_route(token, route)
        start = time.perf_counter()
        if nonblocking:
            traced = (trace, self.name, op, nbytes, sent, start) if trace is not None and trace.active else None
            work = method(*args, True)
            if work.done:  # ran at call time (comm.intra_node's shared memory): blocked time, traced as such
                end = time.perf_counter()
                counter.seconds += end - start
                if traced is not None:
                    trace.comm(self.name, op, nbytes, sent, start, end, blocked=True)
                    traced = None
            return Handle(work, watchdog, counter, token, traced)
        work = None
        try:
            work = method(*args, False)
        finally:  # a failed call must not look stalled later
            _end(watchdog, token, work)
        end = time.perf_counter()
        counter.seconds += end - start
        if trace is not None and trace.active:
            trace.comm(self.name, op, nbytes, sent, start, end, blocked=True)
        return None

    def _host_call(self, op: str, nbytes: int, wire: float, method, *args, route: str = "") -> None:
        """``_run`` for a blocking collective on host memory with comm.check off: the hot path of every small
        collective, where each step of Python shows against MPI's own few microseconds. The same counting,
        numbering, watching and tracing as ``_run``, through the watchdog ``Slot`` this group keeps for
        ``op`` (nothing allocated or registered per call; its begin/end written out here, a call less). A call
        of the same op already in flight (another thread's) takes ``_run``."""
        slot = self._slots.get(op)
        if slot is None:
            slot = self._slots[op] = self.watchdog.slot(op, self, self._counter(op))
        call = slot.call
        if call.start != IDLE:
            return self._run(op, nbytes, False, method, *args, wire=wire, route=route)
        counter = slot.counter
        sent = int(nbytes * wire)
        counter.calls += 1
        counter.bytes += nbytes
        counter.sent += sent
        self.seq += 1
        call.seq, call.nbytes, call.route = self.seq, nbytes, route
        call.start = start = clock()  # last: a snapshot (Call.copy) reads it last
        try:
            method(*args, False)
        finally:  # a failed call must not look stalled later
            end = clock()
            call.start = IDLE
            if call.seq > self.done_seq:
                self.done_seq, self.done_op, self.done_at = call.seq, op, end
        counter.seconds += end - start
        trace = self.trace
        if trace is not None and trace.active:
            trace.comm(self.name, op, nbytes, sent, start, end, blocked=True)
        return None

    def _counter(self, op: str) -> OpCounter:
        counter = self._counters.get(op)
        if counter is None:
            counter = self._counters[op] = self.stats.ops[(self.name, op)]
        return counter

    def check_same_call(self, op: str, fingerprint, splits=None) -> None:
        """Collective (comm.check): every member must be about to make the same call; else raise
        ``CommCheckError`` on every member, naming the call and the first rank that differs. ``splits``:
        an alltoallv's (input_splits, output_splits); what rank i sends to rank j must be what j expects."""
        mine = (op, fingerprint)
        token = self.watchdog.begin(f"comm.check before {op}", self, seq=self.seq + 1)
        try:
            gathered = self.mpi.allgather((mine, None if splits is None else [list(map(int, s)) for s in splits]))
        finally:
            self.watchdog.end(token)
        where = f"comm.check: collective #{self.seq + 1} on group '{self.name}' (world ranks {list(self.members)})"
        calls = [call for call, _ in gathered]
        for group_rank, theirs in enumerate(calls):
            if theirs != calls[0]:
                raise CommCheckError(
                    f"{where}: world rank {self.members[0]} calls {_show(calls[0])}, but world rank "
                    f"{self.members[group_rank]} calls {_show(theirs)}")
        if splits is None:
            return
        for i, (sends, _) in enumerate(s for _, s in gathered):
            for j, (_, expects) in enumerate(s for _, s in gathered):
                if sends[j] != expects[i]:
                    raise CommCheckError(
                        f"{where}: {op} splits disagree: world rank {self.members[i]} sends {sends[j]} rows to world "
                        f"rank {self.members[j]}, which expects {expects[i]} from it (input_splits of every rank: "
                        f"{[s[0] for _, s in gathered]}, output_splits: {[s[1] for _, s in gathered]})")

    def _watched(self, op: str, call, *args, **kwargs):
        """A collective made outside ``_run`` (python objects, barriers), numbered and watched too."""
        if self.check:
            self.check_same_call(op, None)
        token = self.watchdog.begin(op, self)
        try:
            return call(*args, **kwargs)
        finally:
            self.watchdog.end(token)

    def _route(self, tensor: torch.Tensor, op: str, kind: str):
        """(backend, route name) for collective ``kind`` on ``tensor``: the group's shm route where it takes the
        call (comm.intra_node), else the tensor's backend (MPI, no route name)."""
        shm = self.shm
        if shm is not None and shm.takes(tensor, op, kind):
            return shm, shm.route
        return self.backend_for(tensor), ""

    # ---------------------------------------------------------------- collectives
    # The hot path first: a blocking host call with comm.check off, on tensors a ``BoundCall`` was (or can be) made
    # for (bound.py); then the ordinary way, where comm.check's fingerprint is built only when it is compared.
    def allreduce(self, tensor: torch.Tensor, op: str = "sum", nonblocking: bool = False):
        """In place: every rank's ``tensor`` becomes the sum / average / max over the group."""
        if not (nonblocking or self.check):
            bound = self._bound.get("allreduce", tensor, None, op, self.shm)
            if bound is not None:
                return self._host_call("allreduce", bound.nbytes, self._allreduce_wire, bound)
        backend, route = self._route(tensor, op, "allreduce")
        if not (nonblocking or self.check or tensor.is_cuda):
            return self._host_call("allreduce", tensor.nbytes, self._allreduce_wire, backend.allreduce, tensor, op,
                                   route=route)
        return self._run("allreduce", tensor.nbytes, nonblocking, backend.allreduce, tensor, op,
                         fingerprint=(op, tensor.dtype, tensor.numel()), wire=self._allreduce_wire, route=route)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       nonblocking: bool = False):
        """``input`` (size*n elements, block r for group rank r) reduced; block ``self.rank`` -> ``output`` (n)."""
        if not (nonblocking or self.check):
            bound = self._bound.get("reduce_scatter", output, input, op, self.shm)
            if bound is not None:
                return self._host_call("reduce_scatter", bound.nbytes, self._spread_wire, bound)
        backend, route = self._route(input, op, "reduce_scatter")
        if not (nonblocking or self.check or input.is_cuda):
            return self._host_call("reduce_scatter", input.nbytes, self._spread_wire, backend.reduce_scatter,
                                   output, input, op, route=route)
        return self._run("reduce_scatter", input.nbytes, nonblocking, backend.reduce_scatter, output, input, op,
                         fingerprint=(op, input.dtype, input.numel()), route=route)

    def allgather(self, output: torch.Tensor, input: torch.Tensor | None = None, nonblocking: bool = False):
        """``output`` (size*n elements) gets every rank's ``input`` (n) in group-rank order.
        ``input=None``: in place, this rank's block of ``output`` already holds its contribution."""
        if not (nonblocking or self.check):
            bound = self._bound.get("allgather", output, input, None, self.shm)
            if bound is not None:
                return self._host_call("allgather", bound.nbytes, self._spread_wire, bound)
        backend, route = self._route(output, "sum", "allgather")
        if not (nonblocking or self.check or output.is_cuda):
            return self._host_call("allgather", output.nbytes, self._spread_wire, backend.allgather, output, input,
                                   route=route)
        return self._run("allgather", output.nbytes, nonblocking, backend.allgather, output, input,
                         fingerprint=(output.dtype, output.numel()), route=route)

    def alltoall(self, output: torch.Tensor, input: torch.Tensor, nonblocking: bool = False):
        """``input`` (size*n elements): block j goes to group rank j; ``output`` (size*n): block j came
        from group rank j. Any dtype (raw data movement: compressed payloads are uint8)."""
        if input.numel() != output.numel() or input.numel() % self.size:
            raise ValueError(f"alltoall: input {input.numel()} and output {output.numel()} elements must be "
                             f"equal and divisible by the group size {self.size}")
        backend = self.backend_for(input)
        return self._run("alltoall", input.nbytes, nonblocking, backend.alltoall, output, input,
                         fingerprint=(input.dtype, input.numel()))

    def alltoallv(self, output: torch.Tensor, output_splits, input: torch.Tensor, input_splits,
                  nonblocking: bool = False, largest_block: int | None = None):
        """Uneven all-to-all over rows (dim 0). ``input`` (sum(input_splits), *row): its first
        ``input_splits[0]`` rows go to group rank 0, the next ``input_splits[1]`` to rank 1, and so on;
        ``output`` (sum(output_splits), *row) receives ``output_splits[i]`` rows from group rank i, in rank
        order. Splits are sequences of ``size`` ints (0 allowed); ``row`` and dtype are the same on every rank.
        The splits must agree: ``input_splits[j]`` here == ``output_splits[self.rank]`` on rank j
        (``alltoall_splits`` derives output_splits from input_splits). comm.check verifies that; without it
        MPI reports a piece longer than its receiver expects (truncation), not a shorter one.
        ``largest_block``: the most rows ANY rank of the group sends to any one rank in this call, where the
        caller knows it (the same number on every rank: the expert dispatcher gathers every rank's counts).
        Host tensors whose largest block is ``alltoall_by_peer_bytes`` (comm.alltoall_by_peer_kib) or more go block by block,
        one Isend/Irecv per peer, faster than MPICH's Alltoallv; without it, one Alltoallv."""
        size, shape = self.size, input.shape
        row = shape[1:]
        if (len(input_splits) != size or len(output_splits) != size or not shape or not output.shape
                or input.dtype != output.dtype or row != output.shape[1:]
                or sum(input_splits) != shape[0] or sum(output_splits) != output.shape[0]
                or min(input_splits) < 0 or min(output_splits) < 0):
            raise ValueError(_bad_splits(self, output, output_splits, input, input_splits))
        rows = shape[0]
        backend = self.backend_for(input)
        method = backend.alltoallv
        by_peer = getattr(backend, "alltoallv_by_peer", None)
        if (largest_block is not None and by_peer is not None and not input.is_cuda  # row: the same everywhere
                and largest_block * math.prod(row) * input.element_size() >= self.alltoall_by_peer_bytes):
            method = by_peer
        return self._run("alltoallv", input.nbytes, nonblocking, method, output, output_splits, input,
                         input_splits, fingerprint=(input.dtype, row, method is by_peer),
                         wire=(rows - input_splits[self.rank]) / rows if rows else 0.0,
                         splits=(input_splits, output_splits) if self.check else None)

    def alltoall_splits(self, input_splits) -> list[int]:
        """Collective: the ``output_splits`` that go with this rank's ``input_splits`` in ``alltoallv``
        (entry i: the rows group rank i sends here), by one alltoall of ``size`` int64s on the host."""
        if len(input_splits) != self.size:
            raise ValueError(f"alltoall_splits: {len(input_splits)} splits for a group of {self.size} ranks")
        output = torch.empty(self.size, dtype=torch.int64)
        self.alltoall(output, torch.tensor(input_splits, dtype=torch.int64))
        return output.tolist()

    def broadcast(self, tensor: torch.Tensor, root: int = 0, nonblocking: bool = False):
        """In place: every rank's ``tensor`` becomes group rank ``root``'s."""
        if not (nonblocking or self.check):
            bound = self._bound.get("broadcast", tensor, None, root, None)
            if bound is not None:
                return self._host_call("broadcast", bound.nbytes, self._spread_wire, bound)
        backend = self.backend_for(tensor)
        if not (nonblocking or self.check or tensor.is_cuda):
            return self._host_call("broadcast", tensor.nbytes, self._spread_wire, backend.broadcast, tensor, root)
        return self._run("broadcast", tensor.nbytes, nonblocking, backend.broadcast, tensor, root,
                         fingerprint=(root, tensor.dtype, tensor.numel()))

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, nonblocking: bool = False):
        backend = self.backend_for(tensor)
        return self._run("send", tensor.nbytes, nonblocking, backend.send, tensor, dst, tag, peer=dst, wire=1.0)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, nonblocking: bool = False):
        """Receive into ``tensor`` (its shape and dtype must match the sender's)."""
        backend = self.backend_for(tensor)
        return self._run("recv", tensor.nbytes, nonblocking, backend.recv, tensor, src, tag, peer=src, wire=0.0)

    def exchange(self, sends=(), recvs=()) -> Handle:
        """Post sends ``[(tensor, dst, tag)]`` and receives ``[(tensor, src, tag)]`` together; one handle.

        On NCCL they form one group (ncclGroupStart/End), so two neighbours that send to each other at
        the same time cannot deadlock; on MPI they are non-blocking calls waited together. The pipeline
        executor posts each schedule step's communication through this.
        """
        first = (list(sends) + list(recvs))[0][0]
        backend = self.backend_for(first)
        sent = sum(t.nbytes for t, _, _ in sends)
        nbytes = sent + sum(t.nbytes for t, _, _ in recvs)
        peer = (list(recvs) + list(sends))[0][1]  # the report names the rank it waits on first
        return self._run("exchange", nbytes, True, lambda _nb: backend.exchange(sends, recvs), peer=peer,
                         wire=sent / nbytes if nbytes else 0.0)

    def isend(self, tensor, dst, tag=0) -> Handle:
        return self.send(tensor, dst, tag, nonblocking=True)

    def irecv(self, tensor, src, tag=0) -> Handle:
        return self.recv(tensor, src, tag, nonblocking=True)

    def recurring_allreduce(self, tensor: torch.Tensor, op: str = "sum") -> Recurring:
        """Collective to build: ``tensor`` (fixed storage) summed / maxed over the group by each call of
        the returned op, through an MPI-4 persistent request (the small-message path, persistent.py)."""
        return Recurring(self, tensor, "allreduce", op=op)

    def recurring_broadcast(self, tensor: torch.Tensor, root: int = 0) -> Recurring:
        """Collective to build: each call of the returned op broadcasts ``tensor`` from group rank ``root``."""
        return Recurring(self, tensor, "broadcast", root=root)

    def barrier(self) -> None:
        self._watched("barrier", self.mpi.Barrier)

    def drain(self) -> None:
        """Blocks until every member has arrived (an MPI barrier), counted, watched and traced as op ``drain``
        (time blocked on this group): the pipeline's drain, where a stage that has finished its schedule waits
        for the others to finish theirs."""
        if self.check:
            self.check_same_call("drain", None)
        self._host_call("drain", 0, 0.0, lambda _nonblocking: self.mpi.Barrier())

    # ---------------------------------------------------------------- small python objects
    def allgather_object(self, obj) -> list:
        """Pickled allgather for small metadata (not for tensors)."""
        return self._watched("allgather_object", self.mpi.allgather, obj)

    def gather_object(self, obj, root: int = 0) -> list | None:
        return self._watched("gather_object", self.mpi.gather, obj, root=root)

    def broadcast_object(self, obj, root: int = 0):
        return self._watched("broadcast_object", self.mpi.bcast, obj, root=root)

    def watched(self, op: str):
        """``with comm.watched("mpio write"):`` a collective section made by another library on
        ``self.mpi`` (parallel HDF5), numbered and watched like one call."""
        return _WatchedSection(self, op)

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank}/{self.size}, members={list(self.members)})"


class _WatchedSection:
    def __init__(self, comm: Communicator, op: str):
        self.comm, self.op = comm, op

    def __enter__(self):
        self.token = self.comm.watchdog.begin(self.op, self.comm)
        return self

    def __exit__(self, *exc):
        self.comm.watchdog.end(self.token)
        return False


def _bad_splits(comm: Communicator, output, output_splits, input, input_splits) -> str:
    """The message for ``alltoallv`` arguments that cannot go together (checked on this rank alone)."""
    head = f"alltoallv on group '{comm.name}' (rank {comm.rank} of {comm.size})"
    if len(input_splits) != comm.size or len(output_splits) != comm.size:
        return (f"{head}: input_splits has {len(input_splits)} entries and output_splits {len(output_splits)}; "
                f"expected one per rank ({comm.size})")
    if min(input_splits) < 0 or min(output_splits) < 0:
        return f"{head}: negative split in input_splits {list(input_splits)} or output_splits {list(output_splits)}"
    if input.dim() == 0 or output.dim() == 0 or input.dtype != output.dtype or input.shape[1:] != output.shape[1:]:
        return (f"{head}: input {input.dtype} {tuple(input.shape)} and output {output.dtype} {tuple(output.shape)} "
                f"must have at least one dimension, the same dtype and the same trailing dims (one row)")
    return (f"{head}: input_splits {list(input_splits)} add up to {sum(input_splits)} rows, input has "
            f"{input.shape[0]}; output_splits {list(output_splits)} add up to {sum(output_splits)}, output has "
            f"{output.shape[0]}")


def _show(call) -> str:
    op, fingerprint = call
    return op + (f" {fingerprint}" if fingerprint is not None else "")
