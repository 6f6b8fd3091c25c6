"""Blocking host collectives bound to their tensors: the hot path of a call repeated on the same buffers.

A training step makes the same collectives on the same tensors again and again (a ZeRO bucket, a norm,
the loss). At 64 KiB, MPI needs 20-50 us on one node, and every step of Python before it shows: choosing
the backend and the route, describing the buffers to MPI (each read of a torch tensor's attribute costs
about 60 ns). A ``BoundCall`` does that once per group, collective and tensors, and keeps the mpi4py call
with its buffer specs; a later call with the same tensors checks that they are still what it was built
for and calls MPI (docs/benchmarks.md, "Small messages").

Contract:
- bound: blocking calls on host tensors with comm.check off, of allreduce / reduce-scatter (``op`` sum
  or max, not 16-bit: those need no work after MPI), allgather and broadcast (any MPI type), that the
  group's shared-memory route (comm.intra_node) does not take; anything else returns None here and goes
  the ordinary way. Both ways count, number, watch and trace the call alike (``Communicator._host_call``);
- "the same tensors": the same Python objects (held by weak references: a bound call keeps no tensor
  alive) at the same storage address, with the same size, dtype and contiguity, the same ``op`` / root,
  and the same shm route object. Anything else binds anew (a storage freed and re-allocated, as ZeRO-3's
  gathered buckets are, is a new binding);
- at most ``LIMIT`` bound calls per group and collective; the table is emptied when full (temporaries).
"""
from __future__ import annotations

import weakref

import torch
from mpi4py import MPI

from hpctrain.comm.backends.mpi import _HALF, _PLAIN_OPS, host_buffer

LIMIT = 64  # bound calls per group and collective


class BoundCall:
    """``fn(*args)``: one mpi4py call on the storage of ``first`` (and ``second``), for ``nbytes`` of payload.
    Called as ``bound(nonblocking)`` (the flag is ignored: always blocking), like a backend method."""

    __slots__ = ("key", "route", "first", "first_ptr", "first_nbytes", "second", "second_ptr", "second_nbytes",
                 "dtype", "fn", "args", "nbytes")

    def __init__(self, key, route, first: torch.Tensor, second: torch.Tensor | None, fn, args: tuple, nbytes: int):
        self.key, self.route, self.fn, self.args, self.nbytes = key, route, fn, args, nbytes
        self.first, self.first_ptr, self.first_nbytes = weakref.ref(first), first.data_ptr(), first.nbytes
        self.dtype = first.dtype
        if second is None:
            self.second = None
        else:
            self.second, self.second_ptr, self.second_nbytes = weakref.ref(second), second.data_ptr(), second.nbytes

    def matches(self, first: torch.Tensor, second: torch.Tensor | None, key, route) -> bool:
        if (self.first() is not first or first.data_ptr() != self.first_ptr or first.nbytes != self.first_nbytes
                or first.dtype is not self.dtype or not first.is_contiguous() or key != self.key
                or route is not self.route):
            return False
        if second is None:
            return self.second is None
        return (self.second is not None and self.second() is second and second.data_ptr() == self.second_ptr
                and second.nbytes == self.second_nbytes and second.dtype is self.dtype and second.is_contiguous())

    def __call__(self, nonblocking: bool = False) -> None:
        self.fn(*self.args)


class BoundCalls:
    """One group's bound calls: ``get`` finds (or makes) the ``BoundCall`` for a call, or says None."""

    def __init__(self, mpi_comm):
        self.mpi = mpi_comm
        self.size = mpi_comm.Get_size()
        self._tables: dict[str, dict[int, BoundCall]] = {
            "allreduce": {}, "reduce_scatter": {}, "allgather": {}, "broadcast": {}}

    def get(self, kind: str, first: torch.Tensor, second: torch.Tensor | None, key, route) -> BoundCall | None:
        """The bound call ``kind`` (allreduce: ``first`` in place, ``key`` the op; reduce_scatter: ``first``
        the output, ``second`` the input, ``key`` the op; allgather: ``first`` the output, ``second`` the
        input or None (in place); broadcast: ``first``, ``key`` the root), or None where it cannot be bound.
        ``route``: the group's ShmRoute (or None): a call it takes is not bound."""
        table = self._tables[kind]
        bound = table.get(id(first))
        if bound is not None and bound.matches(first, second, key, route):
            return bound
        bound = self._bind(kind, first, second, key, route)
        if bound is not None:
            if len(table) >= LIMIT:
                table.clear()
            table[id(first)] = bound
        return bound

    def clear(self) -> None:
        for table in self._tables.values():
            table.clear()

    def _bind(self, kind, first, second, key, route) -> BoundCall | None:
        if first.is_cuda or (second is not None and (second.is_cuda or second.dtype is not first.dtype)):
            return None
        if not first.is_contiguous() or (second is not None and not second.is_contiguous()):
            return None  # the ordinary path raises its error
        mpi = self.mpi
        if kind == "allreduce":
            plain = _PLAIN_OPS.get(key)
            if plain is None or first.dtype in _HALF or (route is not None and route.takes(first, key, kind)):
                return None
            return BoundCall(key, route, first, None, mpi.Allreduce, (MPI.IN_PLACE, host_buffer(first), plain),
                             first.nbytes)
        if kind == "reduce_scatter":
            plain = _PLAIN_OPS.get(key)
            if (plain is None or first.dtype in _HALF or second.numel() != first.numel() * self.size
                    or (route is not None and route.takes(second, key, kind))):
                return None
            return BoundCall(key, route, first, second, mpi.Reduce_scatter_block,
                             (host_buffer(second), host_buffer(first), plain), second.nbytes)
        if kind == "allgather":
            if ((second is not None and second.numel() * self.size != first.numel())
                    or (route is not None and route.takes(first, "sum", kind))):
                return None
            sbuf = MPI.IN_PLACE if second is None else host_buffer(second)
            return BoundCall(key, route, first, second, mpi.Allgather, (sbuf, host_buffer(first)), first.nbytes)
        return BoundCall(key, route, first, None, mpi.Bcast, (host_buffer(first), key), first.nbytes)
