"""Host-staged backend: CUDA tensors through plain (not CUDA-aware) MPI, via pinned host copies.

The portable path for device tensors: it works with any MPI (the PyPI MPICH wheel included) and
with several ranks on one GPU, where NCCL refuses to run. Each call copies the device tensor into a
pinned host buffer (one ``synchronize`` of the current stream: MPI reads memory, not streams), runs
the host MPI operation on it, and copies the result back with a non-blocking host-to-device copy
ordered on the current stream. It costs two PCIe copies per call, so NCCL or CUDA-aware MPI are
faster where they work; ``parallel.backend = "mpi"`` or the ``auto`` fallback select it.

Contract as in the MPI backend (``mpi.py``): contiguous tensors, ``op`` "sum" | "avg" | "max",
group-local ranks; non-blocking calls return a work object whose ``wait`` completes the copy back.
"""
from __future__ import annotations

import torch

from hpctrain.comm.backends.mpi import GroupWork, MpiBackend


class StagedWork:
    """A host MPI work followed by the copy back to the device."""

    __slots__ = ("inner", "finish", "done")

    def __init__(self, inner, finish=None):
        self.inner, self.finish, self.done = inner, finish, inner is None

    def test(self) -> bool:
        if not self.done and self.inner.test():
            self._complete()
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.inner.wait()
            self._complete()

    def _complete(self) -> None:
        self.done = True
        if self.finish is not None:
            self.finish()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)  # device -> pinned host; synchronous
    return host


class HostStagedBackend:
    """Collectives on CUDA tensors of one group, staged through host memory and ``mpi_comm``."""

    name = "mpi-staged"

    def __init__(self, mpi_comm):
        self.host = MpiBackend(mpi_comm)
        self.size = self.host.size

    @staticmethod
    def _done(host_work, device_out, host_out, nonblocking):
        def finish():
            device_out.copy_(host_out, non_blocking=True)  # stream-ordered: later kernels see it

        if not nonblocking:
            finish()
            return None
        return StagedWork(host_work, finish)

    def allreduce(self, tensor, op="sum", nonblocking=False):
        host = _to_host(tensor)
        return self._done(self.host.allreduce(host, op, nonblocking), tensor, host, nonblocking)

    def reduce_scatter(self, output, input, op="sum", nonblocking=False):
        host_in = _to_host(input)
        host_out = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        work = self.host.reduce_scatter(host_out, host_in, op, nonblocking)
        return self._done(work, output, host_out, nonblocking)

    def allgather(self, output, input=None, nonblocking=False):
        host_out = _to_host(output) if input is None else torch.empty(output.shape, dtype=output.dtype,
                                                                      pin_memory=True)
        host_in = None if input is None else _to_host(input)
        work = self.host.allgather(host_out, host_in, nonblocking)
        return self._done(work, output, host_out, nonblocking)

    def alltoall(self, output, input, nonblocking=False):
        host_out = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        work = self.host.alltoall(host_out, _to_host(input), nonblocking)
        return self._done(work, output, host_out, nonblocking)

    def alltoallv(self, output, output_splits, input, input_splits, nonblocking=False):
        host_out = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        work = self.host.alltoallv(host_out, output_splits, _to_host(input), input_splits, nonblocking)
        return self._done(work, output, host_out, nonblocking)

    def broadcast(self, tensor, root=0, nonblocking=False):
        host = _to_host(tensor)
        return self._done(self.host.broadcast(host, root, nonblocking), tensor, host, nonblocking)

    def send(self, tensor, dst, tag=0, nonblocking=False):
        work = self.host.send(_to_host(tensor), dst, tag, nonblocking)  # the work keeps the host copy alive
        return StagedWork(work) if nonblocking else None

    def recv(self, tensor, src, tag=0, nonblocking=False):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return self._done(self.host.recv(host, src, tag, nonblocking), tensor, host, nonblocking)

    def exchange(self, sends, recvs):
        """Post every send and receive at once; one work that completes them all (see ``Communicator``)."""
        works = [self.send(t, peer, tag, True) for t, peer, tag in sends]
        works += [self.recv(t, peer, tag, True) for t, peer, tag in recvs]
        return GroupWork(works)

    def barrier(self):
        self.host.barrier()

