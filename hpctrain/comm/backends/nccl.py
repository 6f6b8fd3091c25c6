"""NCCL backend through CuPy: one ``cupy.cuda.nccl.NcclCommunicator`` per process group.

The NCCL unique id is created on the group's rank 0 and broadcast over the group's MPI
communicator (no TCP store). Stream semantics, with no host synchronisation anywhere: each group has
its own communication stream; a call first makes that stream wait for everything enqueued so far on
the CURRENT torch stream (so it reads finished inputs), enqueues the NCCL kernel there and records a
CUDA event. A blocking call makes the current stream wait on the event at once; a non-blocking one
returns a work object whose ``wait`` does so and whose ``test`` queries the event. Compute issued
between the call and ``wait`` overlaps the communication. Tensors are kept alive until ``wait``.

Contract as in the MPI backend: contiguous tensors, ``op`` "sum" | "avg" | "max"; same-rank indices.
"""
from __future__ import annotations

import math
import socket

import torch

# ncclDataType_t and ncclRedOp_t values from nccl.h (stable ABI); cupy exposes most as NCCL_* names.
# Public: tests check them against nccl.h and cupy. torch dtype / op -> (NCCL name, nccl.h value).
NCCL_DTYPES = {torch.float32: ("NCCL_FLOAT32", 7), torch.float64: ("NCCL_FLOAT64", 8),
               torch.float16: ("NCCL_FLOAT16", 6), torch.bfloat16: ("NCCL_BFLOAT16", 9),
               torch.int64: ("NCCL_INT64", 4), torch.int32: ("NCCL_INT32", 2), torch.uint8: ("NCCL_UINT8", 1)}
NCCL_OPS = {"sum": ("NCCL_SUM", 0), "max": ("NCCL_MAX", 2), "avg": ("NCCL_AVG", 4)}


def nccl_available() -> tuple[bool, str]:
    """(available, reason) — reason explains why not, for skips and error messages."""
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception as exc:  # ImportError, or CUDA/NCCL library load errors
        return False, f"cupy with NCCL is not importable ({exc.__class__.__name__}: {exc})"
    return True, ""


def distinct_gpus(mpi_comm, device) -> tuple[bool, str]:
    """Collective over ``mpi_comm``: (True, "") when every rank drives a different GPU, else (False, why).

    NCCL refuses two ranks of one communicator on the same GPU; ranks are compared by device UUID."""
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "")) or f"{torch.cuda.get_device_name(device)}#{device.index}"
    seen = mpi_comm.allgather((socket.gethostname(), uuid))
    if len(set(seen)) == len(seen):
        return True, ""
    host, gpu = next(x for x in seen if seen.count(x) > 1)
    return False, f"{seen.count((host, gpu))} ranks of this group share GPU {gpu} on {host}"


def nccl_constant(module, table, key):
    """The NCCL constant for ``key`` in ``table`` (NCCL_DTYPES or NCCL_OPS): ``module``'s attribute of that
    name (e.g. ``cupy.cuda.nccl``), else nccl.h's value."""
    name, value = table[key]
    return getattr(module, name, value)


class NcclWork:
    """A call's completion: ``event`` (recorded on the group's stream after the NCCL kernel); ``keepalive``:
    the tensors it reads and writes, held until ``wait`` has ordered the compute stream after it."""

    __slots__ = ("event", "keepalive", "done", "device")

    def __init__(self, event, keepalive=None):
        self.event, self.keepalive, self.done = event, keepalive, False
        self.device = torch.cuda.current_device()  # the rank's GPU, for queries from other threads

    def test(self) -> bool:
        if not self.done and self.event.query():
            self.wait()
        return self.done

    def device_done(self) -> bool:
        """True once the NCCL kernel has run on the GPU (the watchdog polls this: ``Watchdog.end_when``). Asked on
        the watchdog's thread, under the rank's device: a thread without one would open a CUDA context on GPU 0."""
        with torch.cuda.device(self.device):
            return self.event.query()

    def wait(self) -> None:
        if not self.done:
            torch.cuda.current_stream().wait_event(self.event)
            self.done, self.keepalive = True, None


class NcclBackend:
    """Collectives over one group's GPUs; ``mpi_comm`` is that group's MPI communicator (bootstrap only)."""

    name = "nccl"

    def __init__(self, mpi_comm):
        from cupy.cuda import nccl

        self._nccl = nccl
        self.size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
        unique_id = nccl.get_unique_id() if rank == 0 else None
        unique_id = mpi_comm.bcast(unique_id, root=0)
        self.comm = nccl.NcclCommunicator(self.size, unique_id, rank)
        self.side = torch.cuda.Stream()  # on the current device, which bind_device has set

    def _dtype(self, tensor):
        if tensor.dtype not in NCCL_DTYPES:
            raise TypeError(f"NCCL backend: unsupported dtype {tensor.dtype}")
        if not tensor.is_contiguous() or tensor.device.type != "cuda":
            raise ValueError("NCCL backend needs contiguous CUDA tensors")
        return nccl_constant(self._nccl, NCCL_DTYPES, tensor.dtype)

    def _op(self, op, tensor):
        if op not in NCCL_OPS:
            raise ValueError(f"unknown reduction op {op!r}; expected sum, avg or max")
        if op == "avg" and not tensor.is_floating_point():
            raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}")
        return nccl_constant(self._nccl, NCCL_OPS, op)

    def _stream(self):
        """This group's communication stream, ordered after all work enqueued so far on the current
        (compute) stream: the collective sees its producers' results, yet backward keeps computing
        while it runs (that is what makes bucketed reductions overlap on GPUs)."""
        self.side.wait_stream(torch.cuda.current_stream())
        return self.side.cuda_stream

    def _work(self, nonblocking, keepalive):
        """An event after the call on the side stream; blocking calls make the compute stream wait at
        once (no host synchronisation), non-blocking ones when the handle is waited."""
        event = torch.cuda.Event()
        event.record(self.side)
        work = NcclWork(event, keepalive)
        if not nonblocking:
            work.wait()
        return work

    def allreduce(self, tensor, op="sum", nonblocking=False):
        ptr = tensor.data_ptr()
        self.comm.allReduce(ptr, ptr, tensor.numel(), self._dtype(tensor), self._op(op, tensor), self._stream())
        return self._work(nonblocking, tensor)

    def reduce_scatter(self, output, input, op="sum", nonblocking=False):
        if input.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"{self.size} x {output.numel()}")
        self.comm.reduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), self._dtype(output),
                                self._op(op, output), self._stream())
        return self._work(nonblocking, (input, output))

    def allgather(self, output, input=None, nonblocking=False):
        count = output.numel() // self.size
        if input is None:  # in place: NCCL accepts sendbuff == recvbuff + rank * count
            send_ptr = output.data_ptr() + self.comm.rank_id() * count * output.element_size()
        else:
            if input.numel() * self.size != output.numel():
                raise ValueError(f"allgather: output has {output.numel()} elements, expected "
                                 f"{self.size} x {input.numel()}")
            send_ptr = input.data_ptr()
        self.comm.allGather(send_ptr, output.data_ptr(), count, self._dtype(output), self._stream())
        return self._work(nonblocking, (input, output))

    def alltoall(self, output, input, nonblocking=False):
        """Block j of ``input`` to rank j, block j of ``output`` from rank j: one NCCL group of
        send/recv pairs (NCCL has no all-to-all primitive; this is how its docs build one)."""
        nccl, stream = self._nccl, self._stream()
        count, dtype = input.numel() // self.size, self._dtype(input)
        step = count * input.element_size()
        nccl.groupStart()
        try:
            for peer in range(self.size):
                self.comm.send(input.data_ptr() + peer * step, count, dtype, peer, stream)
                self.comm.recv(output.data_ptr() + peer * step, count, dtype, peer, stream)
        finally:
            nccl.groupEnd()
        return self._work(nonblocking, (input, output))

    def alltoallv(self, output, output_splits, input, input_splits, nonblocking=False):
        """``input_splits[j]`` rows (dim 0) of ``input``, in order, to rank j; ``output_splits[i]`` rows from
        rank i into ``output``, in rank order: one NCCL group of send/recv pairs, empty pieces left out (on
        both sides, as the splits agree)."""
        nccl, stream, dtype = self._nccl, self._stream(), self._dtype(input)
        if self._dtype(output) != dtype:
            raise TypeError(f"alltoallv: input {input.dtype} and output {output.dtype} differ")
        row = math.prod(input.shape[1:])
        step = row * input.element_size()
        nccl.groupStart()
        try:
            sent = received = 0
            for peer in range(self.size):
                if input_splits[peer]:
                    self.comm.send(input.data_ptr() + sent * step, input_splits[peer] * row, dtype, peer, stream)
                if output_splits[peer]:
                    self.comm.recv(output.data_ptr() + received * step, output_splits[peer] * row, dtype, peer,
                                   stream)
                sent, received = sent + input_splits[peer], received + output_splits[peer]
        finally:
            nccl.groupEnd()
        return self._work(nonblocking, (input, output))

    def broadcast(self, tensor, root=0, nonblocking=False):
        ptr = tensor.data_ptr()
        self.comm.broadcast(ptr, ptr, tensor.numel(), self._dtype(tensor), root, self._stream())
        return self._work(nonblocking, tensor)

    def send(self, tensor, dst, tag=0, nonblocking=False):
        self.comm.send(tensor.data_ptr(), tensor.numel(), self._dtype(tensor), dst, self._stream())
        return self._work(nonblocking, tensor)

    def recv(self, tensor, src, tag=0, nonblocking=False):
        self.comm.recv(tensor.data_ptr(), tensor.numel(), self._dtype(tensor), src, self._stream())
        return self._work(nonblocking, tensor)

    def exchange(self, sends, recvs):
        """All sends ``(tensor, dst, tag)`` and receives ``(tensor, src, tag)`` in ONE NCCL group
        (ncclGroupStart/End): they progress together, so neighbours that send to each other at the same
        schedule step (1F1B's steady state) cannot deadlock, as two ungrouped sends on one stream would."""
        nccl, stream = self._nccl, self._stream()
        nccl.groupStart()
        try:
            for tensor, peer, _ in sends:
                self.comm.send(tensor.data_ptr(), tensor.numel(), self._dtype(tensor), peer, stream)
            for tensor, peer, _ in recvs:
                self.comm.recv(tensor.data_ptr(), tensor.numel(), self._dtype(tensor), peer, stream)
        finally:
            nccl.groupEnd()
        return self._work(True, (sends, recvs))

    def close(self) -> None:
        """Destroy the NCCL communicator (at exit; a later call on this backend fails)."""
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
