"""One door to the network: collectives over torch tensors, per process group.

A ``Communicator`` wraps one mpi4py communicator (a dp, pp, tp or world group). Every call:
- picks a backend by the tensor's device and the configured choice: host tensors -> MPI;
  CUDA tensors -> the group's device backend, chosen collectively by ``prepare_device``: NCCL (CuPy),
  CUDA-aware MPI, or MPI with host staging;
- is zero-copy (the tensor's own storage is the MPI/NCCL buffer; reductions are in place);
- is counted (bytes, calls, blocked seconds) and watched (``Watchdog``: a stalled call aborts the
  job with a message naming the op and group instead of hanging).

Blocking calls return None; ``nonblocking=True`` returns a ``Handle`` to ``wait()`` or ``test()``
(calling ``test`` between pieces of work drives MPI progress and gives overlap: see
docs/architecture.md). Ranks in ``src``/``dst``/``root`` are ranks WITHIN this group.
"""
from __future__ import annotations

import time

import torch

from hpctrain.comm.backends.mpi import MpiBackend
from hpctrain.comm.watchdog import CommStats, Watchdog
from hpctrain.errors import HpcTrainError

BACKEND_CHOICES = ("auto", "mpi", "cuda-mpi", "nccl")


class CommSetupError(HpcTrainError):
    """The requested collective backend cannot run here (no NCCL, ranks sharing a GPU, ...)."""


class Handle:
    """A non-blocking operation in flight. ``wait`` is idempotent; ``test`` never blocks."""

    __slots__ = ("_work", "_watchdog", "_counter", "_token")

    def __init__(self, work, watchdog: Watchdog, counter, token: int):
        self._work, self._watchdog, self._counter, self._token = work, watchdog, counter, token

    def test(self) -> bool:
        done = self._work.test()
        if done:
            self._watchdog.end(self._token)
        return done

    def wait(self) -> None:
        if not self._work.done:
            start = time.perf_counter()
            self._work.wait()
            self._counter.seconds += time.perf_counter() - start
        self._watchdog.end(self._token)


class Communicator:
    """Collectives on one group. ``members``: the world ranks of the group, in group-rank order."""

    def __init__(self, mpi_comm, name: str, members: tuple[int, ...], watchdog: Watchdog,
                 stats: CommStats, backend: str = "auto"):
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
        self._host = MpiBackend(mpi_comm)
        self._device = None  # created on the first CUDA tensor (NCCL init is collective and costly)
        self._counters = {}  # op -> this group's OpCounter in ``stats``

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
        if device.type != "cuda" or self._device is not None:
            return "mpi" if device.type != "cuda" else self._device.name
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
        return self._device.name

    def close(self) -> None:
        """Release the device backend (the NCCL communicator); the MPI communicator stays the grid's."""
        if self._device is not None and hasattr(self._device, "close"):
            self._device.close()
        self._device = None

    # ---------------------------------------------------------------- plumbing
    def _run(self, op: str, nbytes: int, nonblocking: bool, method, *args):
        """Count, watch and time ``method(*args, nonblocking)`` (the hot path: attribute updates only)."""
        counter = self._counters.get(op)
        if counter is None:
            counter = self._counters[op] = self.stats.ops[(self.name, op)]
        counter.calls += 1
        counter.bytes += nbytes
        watchdog = self.watchdog
        if nonblocking:
            token = watchdog.begin(op, self, nbytes)
            return Handle(method(*args, True), watchdog, counter, token)
        start = time.perf_counter()
        watchdog.blocking = (op, self, nbytes, start)
        method(*args, False)
        watchdog.blocking = None
        counter.seconds += time.perf_counter() - start
        return None

    # ---------------------------------------------------------------- collectives
    def allreduce(self, tensor: torch.Tensor, op: str = "sum", nonblocking: bool = False):
        """In place: every rank's ``tensor`` becomes the sum / average / max over the group."""
        backend = self._host if not tensor.is_cuda else self.backend_for(tensor)
        return self._run("allreduce", tensor.nbytes, nonblocking, backend.allreduce, tensor, op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       nonblocking: bool = False):
        """``input`` (size*n elements, block r for group rank r) reduced; block ``self.rank`` -> ``output`` (n)."""
        backend = self.backend_for(input)
        return self._run("reduce_scatter", input.nbytes, nonblocking, backend.reduce_scatter, output, input, op)

    def allgather(self, output: torch.Tensor, input: torch.Tensor | None = None, nonblocking: bool = False):
        """``output`` (size*n elements) gets every rank's ``input`` (n) in group-rank order.
        ``input=None``: in place, this rank's block of ``output`` already holds its contribution."""
        backend = self.backend_for(output)
        return self._run("allgather", output.nbytes, nonblocking, backend.allgather, output, input)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, nonblocking: bool = False):
        """In place: every rank's ``tensor`` becomes group rank ``root``'s."""
        backend = self.backend_for(tensor)
        return self._run("broadcast", tensor.nbytes, nonblocking, backend.broadcast, tensor, root)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, nonblocking: bool = False):
        backend = self.backend_for(tensor)
        return self._run("send", tensor.nbytes, nonblocking, backend.send, tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, nonblocking: bool = False):
        """Receive into ``tensor`` (its shape and dtype must match the sender's)."""
        backend = self.backend_for(tensor)
        return self._run("recv", tensor.nbytes, nonblocking, backend.recv, tensor, src, tag)

    def exchange(self, sends=(), recvs=()) -> Handle:
        """Post sends ``[(tensor, dst, tag)]`` and receives ``[(tensor, src, tag)]`` together; one handle.

        On NCCL they form one group (ncclGroupStart/End), so two neighbours that send to each other at
        the same time cannot deadlock; on MPI they are non-blocking calls waited together. The pipeline
        executor posts each schedule step's communication through this.
        """
        first = (list(sends) + list(recvs))[0][0]
        backend = self.backend_for(first)
        nbytes = sum(t.nbytes for t, _, _ in sends) + sum(t.nbytes for t, _, _ in recvs)
        return self._run("exchange", nbytes, True, lambda _nb: backend.exchange(sends, recvs))

    def isend(self, tensor, dst, tag=0) -> Handle:
        return self.send(tensor, dst, tag, nonblocking=True)

    def irecv(self, tensor, src, tag=0) -> Handle:
        return self.recv(tensor, src, tag, nonblocking=True)

    def barrier(self) -> None:
        token = self.watchdog.begin("barrier", self)
        self.mpi.Barrier()
        self.watchdog.end(token)

    # ---------------------------------------------------------------- small python objects
    def allgather_object(self, obj) -> list:
        """Pickled allgather for small metadata (not for tensors)."""
        token = self.watchdog.begin("allgather_object", self)
        result = self.mpi.allgather(obj)
        self.watchdog.end(token)
        return result

    def broadcast_object(self, obj, root: int = 0):
        token = self.watchdog.begin("broadcast_object", self)
        result = self.mpi.bcast(obj, root=root)
        self.watchdog.end(token)
        return result

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank}/{self.size}, members={list(self.members)})"
