"""Recurring small collectives, built once per buffer: the lean path for the calls a step repeats.

Every training step makes the same tiny collectives on buffers of a fixed shape: the loss agreement
(float64 [1]: broadcast over pp, sum over dp), the gradient norm (float64 [1], sum over the world),
the stop agreement (int32 [1], max over the world). At this size the MPI library needs a few
microseconds, and every piece of per-call Python shows: choosing a backend, describing the buffer to
MPI, allocating the watchdog's record (``Communicator.allreduce``: ~2 us over the raw mpi4py call).
A ``Recurring`` op does that work once: it binds an MPI-4 persistent request (``Allreduce_init`` /
``Bcast_init``, so MPI also chooses its algorithm once) to the tensor's storage, a watchdog ``Slot``
and the group's counters; each call is ``Start`` + ``Wait`` between the slot's begin and end
(docs/benchmarks.md, "Small messages": faster than a plain ``Allreduce`` from mpi4py).

Contract:
- the tensor keeps its storage: write the values INTO it (``t.fill_(x)``, ``t[0] = x``), never rebind;
- building is collective over the group (every member, same order, like a collective); so is each call,
  numbered on the group like any other collective (a stalled one is named in the hang report);
- host tensors of a 32/64-bit MPI type; ops "sum" and "max". A CUDA tensor, ``comm.check`` on, or an
  MPI without persistent collectives gets the group's ordinary call instead (same result, usual cost);
- ``free()`` releases the request (local); ``Communicator.close()`` frees its group's Recurring ops.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from hpctrain.comm.backends.mpi import mpi_buffer
from hpctrain.comm.watchdog import clock as _clock

_OPS = {"sum": MPI.SUM, "max": MPI.MAX}
_HOST_TYPES = frozenset((torch.float32, torch.float64, torch.int32, torch.int64))


def persistent_supported() -> bool:
    """Whether this MPI has persistent collectives (MPI >= 4.0 and mpi4py exposes them)."""
    return MPI.Get_version() >= (4, 0) and hasattr(MPI.Comm, "Allreduce_init")


class Recurring:
    """One fixed-buffer collective on ``comm`` (a Communicator), called as ``op()`` (see the module doc).

    ``kind``: "allreduce" (``op`` "sum" | "max") or "broadcast" (from group rank ``root``)."""

    __slots__ = ("comm", "tensor", "kind", "lean", "_request", "_fallback", "_slot", "_counter", "_nbytes",
                 "_sent")

    def __init__(self, comm, tensor: torch.Tensor, kind: str, op: str = "sum", root: int = 0):
        if kind not in ("allreduce", "broadcast"):
            raise ValueError(f"Recurring: kind {kind!r}; expected allreduce or broadcast")
        if kind == "allreduce" and op not in _OPS:
            raise ValueError(f"Recurring allreduce: op {op!r}; expected one of {sorted(_OPS)}")
        self.comm, self.tensor, self.kind = comm, tensor, kind
        self.lean = (persistent_supported() and not comm.check and not tensor.is_cuda
                     and tensor.dtype in _HOST_TYPES and tensor.is_contiguous())
        self._request = None
        if kind == "allreduce":
            self._fallback = lambda: comm.allreduce(tensor, op)
        else:
            self._fallback = lambda: comm.broadcast(tensor, root)
        if not self.lean:
            return
        buf = mpi_buffer(tensor)
        mpi = comm.mpi
        if kind == "allreduce":
            self._request = comm._watched(f"{kind}_init", mpi.Allreduce_init, MPI.IN_PLACE, buf, _OPS[op])
        else:
            self._request = comm._watched(f"{kind}_init", mpi.Bcast_init, buf, root)
        self._nbytes = tensor.nbytes
        factor = 2 * (comm.size - 1) / comm.size if kind == "allreduce" else (comm.size - 1) / comm.size
        self._sent = int(tensor.nbytes * factor)
        self._counter = comm.stats.ops[(comm.name, kind)]
        self._slot = comm.watchdog.slot(kind, comm, self._counter, tensor.nbytes)
        comm.recurring.append(self)  # Communicator.close() frees it

    def __call__(self) -> None:
        if self._request is None:
            if self.lean:
                raise RuntimeError(f"Recurring {self.kind} on group '{self.comm.name}' used after free()")
            self._fallback()
            return
        slot, counter, request = self._slot, self._counter, self._request
        start = _clock()
        slot.begin(start)
        request.Start()
        request.Wait()
        end = _clock()
        slot.end(end)
        counter.calls += 1
        counter.bytes += self._nbytes
        counter.sent += self._sent
        counter.seconds += end - start
        trace = self.comm.trace
        if trace is not None and trace.active:
            trace.comm(self.comm.name, self.kind, self._nbytes, self._sent, start, end, blocked=True)

    def free(self) -> None:
        """Release the persistent request (local; idempotent)."""
        if self._request is not None:
            self._request.Free()
            self._request = None
            self.comm.watchdog.unslot(self._slot)
