"""MPI backend: host tensors by address (zero-copy, explicit MPI datatypes), device tensors through
CUDA-aware MPI (``__cuda_array_interface__``); ``staged.py`` wraps it for CUDA tensors on plain MPI.

Contract for every method: tensors are contiguous, ``op`` is "sum" | "avg" | "max", and the
operation runs on ``self.comm`` (one mpi4py communicator = one process group). Non-blocking calls return
a work object with ``test()`` and ``wait()``; blocking calls return None when done.

MPI has no bfloat16 (and float16 is optional in MPI 4), so half-precision REDUCTIONS go through a
float32 staging copy: the sum is computed in float32 and rounded to the half type once, at the end,
which is also more accurate than reducing in half precision. Half-precision DATA MOVEMENT
(allgather, broadcast, send/recv) needs no arithmetic and moves the raw 16-bit words, zero-copy.
"""
from __future__ import annotations

import math
from itertools import accumulate

import torch
from mpi4py import MPI

_HALF = frozenset((torch.bfloat16, torch.float16))  # a set: membership is a hash, not dtype __eq__ calls
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}
_PLAIN_OPS = {"sum": MPI.SUM, "max": MPI.MAX}  # nothing to do after MPI (no averaging), for non-16-bit types


_MPI_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int64: MPI.INT64_T,
              torch.int32: MPI.INT32_T, torch.int16: MPI.INT16_T, torch.uint8: MPI.UINT8_T,
              torch.int8: MPI.INT8_T, torch.bool: MPI.C_BOOL,
              torch.bfloat16: MPI.INT16_T, torch.float16: MPI.INT16_T}  # 16-bit floats: raw words


def mpi_buffer(tensor: torch.Tensor):
    """A zero-copy buffer over ``tensor``'s storage that mpi4py accepts, without building a numpy view
    (that costs microseconds per call): host memory by address and an explicit MPI datatype; a CUDA
    tensor as itself (``__cuda_array_interface__``, for CUDA-aware MPI)."""
    if not tensor.is_contiguous():
        raise ValueError(f"collectives need contiguous tensors (zero-copy); got strides {tensor.stride()}")
    if tensor.is_cuda:
        tensor = tensor.detach()
        return tensor.view(torch.int16) if tensor.dtype in _HALF else tensor
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes), _MPI_TYPES[tensor.dtype]]


def host_buffer(tensor: torch.Tensor) -> list:
    """``mpi_buffer`` of a tensor known to be on the host (the hot path's, one check fewer)."""
    if not tensor.is_contiguous():
        raise ValueError(f"collectives need contiguous tensors (zero-copy); got strides {tensor.stride()}")
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes), _MPI_TYPES[tensor.dtype]]


def mpi_layout(splits, row: int) -> tuple:
    """(counts, displacements) in elements of consecutive pieces of ``splits[j]`` rows of ``row`` elements."""
    counts = splits if row == 1 else [n * row for n in splits]
    return counts, list(accumulate(counts[:-1], initial=0))


def mpi_vbuffer(tensor: torch.Tensor, layout: tuple) -> list:
    """``mpi_buffer`` for the v-collectives: [buffer, (counts, displacements), datatype]."""
    if tensor.is_cuda or not tensor.is_contiguous():  # CUDA-aware MPI: the tensor itself; or mpi_buffer's error
        return [mpi_buffer(tensor), layout, _MPI_TYPES[tensor.dtype]]  # 16-bit floats: raw words either way
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes), layout, _MPI_TYPES[tensor.dtype]]


ALLTOALL_TAG = 32_011  # below the 32767 every MPI must allow; pipeline exchanges use small tags


def _truncated(exc, output_splits) -> RuntimeError:
    """MPICH says only "see the MPI_ERROR field in MPI_Status": name the likely cause."""
    return RuntimeError(f"alltoallv: MPI failed ({exc.Get_error_string()}): more rows came from some rank than "
                        f"output_splits {list(output_splits)} expect? (comm.check = true names the ranks whose "
                        f"splits disagree)")


class _Requests:
    """Several MPI requests behind one ``Test``/``Wait`` (an MpiWork's request)."""

    __slots__ = ("requests",)

    def __init__(self, requests):
        self.requests = requests

    def Test(self) -> bool:  # noqa: N802 (mpi4py's names)
        return MPI.Request.Testall(self.requests)

    def Wait(self) -> None:  # noqa: N802
        MPI.Request.Waitall(self.requests)


class MpiWork:
    """A pending MPI operation; ``finish`` runs once, after completion (averaging, half copy-back).

    ``keepalive`` holds the TENSORS until completion: the MPI buffers are raw addresses, so a temporary
    tensor (``y.detach().contiguous()`` handed to isend) would otherwise be freed and its memory reused
    while MPI still reads or writes it."""

    __slots__ = ("request", "finish", "keepalive", "done")

    def __init__(self, request, finish=None, keepalive=None):
        self.request, self.finish, self.keepalive = request, finish, keepalive
        self.done = False

    def test(self) -> bool:
        if not self.done and self.request.Test():
            self._complete()
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.request.Wait()
            self._complete()

    def _complete(self) -> None:
        self.done = True
        if self.finish is not None:
            self.finish()
        self.keepalive = None


class MpiBackend:
    """Collectives over one mpi4py communicator. ``cuda_aware``: device buffers may be passed to MPI."""

    name = "mpi"

    def __init__(self, mpi_comm, cuda_aware: bool = False):
        self.comm = mpi_comm  # an mpi4py communicator
        self.size = mpi_comm.Get_size()
        self.cuda_aware = cuda_aware

    def _ready(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            if not self.cuda_aware:
                raise RuntimeError("a CUDA tensor reached the host MPI backend; enable CUDA-aware MPI or NCCL")
            torch.cuda.current_stream(tensor.device).synchronize()  # MPI reads memory, not streams

    def _reduction(self, tensor: torch.Tensor, op: str):
        """(buffer to reduce, finish-callback or None) for an arithmetic op on ``tensor``."""
        if op not in _MPI_OPS:
            raise ValueError(f"unknown reduction op {op!r}; expected sum, avg or max")
        half = tensor.dtype in _HALF
        if not half and op != "avg":
            return tensor, None  # the common case: nothing to do afterwards
        if op == "avg" and not tensor.is_floating_point():
            raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}")
        staging = tensor.float() if half else tensor
        scale = self.size if op == "avg" else 1

        def finish():
            if scale != 1:
                staging.div_(scale)
            if staging is not tensor:
                tensor.copy_(staging)
        return staging, finish

    # The blocking host calls of a plain sum/max (no staging, nothing afterwards) go straight to MPI: they are the
    # small-message hot path, where every Python step shows against MPI's few microseconds.
    def allreduce(self, tensor, op="sum", nonblocking=False):
        plain = _PLAIN_OPS.get(op)
        if plain is not None and not nonblocking and not tensor.is_cuda and tensor.dtype not in _HALF:
            self.comm.Allreduce(MPI.IN_PLACE, host_buffer(tensor), plain)
            return None
        self._ready(tensor)
        staging, finish = self._reduction(tensor, op)
        buf = mpi_buffer(staging)
        if nonblocking:
            return MpiWork(self.comm.Iallreduce(MPI.IN_PLACE, buf, _MPI_OPS[op]), finish, staging)
        self.comm.Allreduce(MPI.IN_PLACE, buf, _MPI_OPS[op])
        if finish is not None:
            finish()
        return None

    def reduce_scatter(self, output, input, op="sum", nonblocking=False):
        """input: (size * n,) elements; output: (n,) elements, this rank's reduced block."""
        if input.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"{self.size} x {output.numel()}")
        plain = _PLAIN_OPS.get(op)
        if (plain is not None and not nonblocking and not input.is_cuda and not output.is_cuda
                and input.dtype not in _HALF and output.dtype is input.dtype):
            self.comm.Reduce_scatter_block(host_buffer(input), host_buffer(output), plain)
            return None
        self._ready(input)
        staging_in = input.float() if input.dtype in _HALF else input
        staging_out, finish = self._reduction(output, op)
        sbuf, rbuf = mpi_buffer(staging_in), mpi_buffer(staging_out)
        if nonblocking:
            req = self.comm.Ireduce_scatter_block(sbuf, rbuf, _MPI_OPS[op])
            return MpiWork(req, finish, (sbuf, rbuf, staging_in, staging_out))
        self.comm.Reduce_scatter_block(sbuf, rbuf, _MPI_OPS[op])
        if finish is not None:
            finish()
        return None

    def allgather(self, output, input=None, nonblocking=False):
        """output: (size * n,) elements. ``input`` None = in place: this rank's block of ``output``
        already holds its data (the ZeRO parameter all-gather)."""
        if input is not None and input.numel() * self.size != output.numel():
            raise ValueError(f"allgather: output has {output.numel()} elements, expected "
                             f"{self.size} x {input.numel()}")
        if not output.is_cuda and not nonblocking:
            self.comm.Allgather(MPI.IN_PLACE if input is None else mpi_buffer(input), host_buffer(output))
            return None
        self._ready(output)
        rbuf = mpi_buffer(output)
        sbuf = MPI.IN_PLACE if input is None else mpi_buffer(input)
        if nonblocking:
            return MpiWork(self.comm.Iallgather(sbuf, rbuf), None, (output, input))
        self.comm.Allgather(sbuf, rbuf)
        return None

    def alltoall(self, output, input, nonblocking=False):
        """input/output: (size * n,) elements; block j of input goes to rank j, block j of output came
        from rank j. Raw data movement (any dtype)."""
        self._ready(input)
        sbuf, rbuf = mpi_buffer(input), mpi_buffer(output)
        if nonblocking:
            return MpiWork(self.comm.Ialltoall(sbuf, rbuf), None, (input, output))
        self.comm.Alltoall(sbuf, rbuf)
        return None

    def alltoallv(self, output, output_splits, input, input_splits, nonblocking=False):
        """Rows (dim 0) ``input_splits[j]`` of ``input``, in order, go to rank j; ``output`` receives
        ``output_splits[i]`` rows from rank i, in rank order (one Alltoallv, zero-copy; any dtype)."""
        self._ready(input)
        row = math.prod(input.shape[1:])
        sends = mpi_layout(input_splits, row)
        receives = sends if output_splits is input_splits else mpi_layout(output_splits, row)
        sbuf, rbuf = mpi_vbuffer(input, sends), mpi_vbuffer(output, receives)
        if nonblocking:  # mpi4py keeps the count and displacement arrays alive with the request
            return MpiWork(self.comm.Ialltoallv(sbuf, rbuf), None, (input, output))
        try:
            self.comm.Alltoallv(sbuf, rbuf)
        except MPI.Exception as exc:
            raise _truncated(exc, output_splits) from exc
        return None

    def alltoallv_by_peer(self, output, output_splits, input, input_splits, nonblocking=False):
        """``alltoallv`` for host tensors, block by block: every Irecv posted, this rank's own block copied
        by torch, then one Isend per peer (zero-length ones too, so a piece longer than its receiver
        expects fails as in Alltoallv), all waited together. Every rank of the group must take this path
        for the same call: ``Communicator.alltoallv`` decides from ``largest_block``, the same everywhere."""
        row = math.prod(input.shape[1:])
        if not input.is_contiguous() or not output.is_contiguous():
            mpi_buffer(input if not input.is_contiguous() else output)  # raises the contiguity error
        rank, size = self.comm.Get_rank(), self.size
        row_bytes = row * input.element_size()
        sends, receives = list(accumulate(input_splits[:-1], initial=0)), list(accumulate(output_splits[:-1], initial=0))
        send_base, recv_base = input.data_ptr(), output.data_ptr()
        peers = [(rank + k) % size for k in range(1, size)]  # every receive posted before any send
        requests = [self.comm.Irecv([MPI.buffer.fromaddress(recv_base + receives[src] * row_bytes,
                                                            output_splits[src] * row_bytes), MPI.BYTE],
                                    src, ALLTOALL_TAG) for src in reversed(peers)]
        requests += [self.comm.Isend([MPI.buffer.fromaddress(send_base + sends[dst] * row_bytes,
                                                             input_splits[dst] * row_bytes), MPI.BYTE],
                                     dst, ALLTOALL_TAG) for dst in peers]
        if input_splits[rank] != output_splits[rank]:
            MPI.Request.Waitall(requests)
            raise RuntimeError(f"alltoallv: this rank sends itself {input_splits[rank]} rows but expects "
                               f"{output_splits[rank]} (input_splits {list(input_splits)}, output_splits "
                               f"{list(output_splits)})")
        mine = input_splits[rank]
        output[receives[rank]:receives[rank] + mine].copy_(input[sends[rank]:sends[rank] + mine])
        work = MpiWork(_Requests(requests), None, (input, output))
        if nonblocking:
            return work
        try:
            work.wait()
        except MPI.Exception as exc:
            raise _truncated(exc, output_splits) from exc
        return None

    def broadcast(self, tensor, root=0, nonblocking=False):
        self._ready(tensor)
        buf = mpi_buffer(tensor)
        if nonblocking:
            return MpiWork(self.comm.Ibcast(buf, root), None, tensor)
        self.comm.Bcast(buf, root)
        return None

    def send(self, tensor, dst, tag=0, nonblocking=False):
        self._ready(tensor)
        buf = mpi_buffer(tensor)
        if nonblocking:
            return MpiWork(self.comm.Isend(buf, dst, tag), None, tensor)
        self.comm.Send(buf, dst, tag)
        return None

    def recv(self, tensor, src, tag=0, nonblocking=False):
        self._ready(tensor)
        buf = mpi_buffer(tensor)
        if nonblocking:
            return MpiWork(self.comm.Irecv(buf, src, tag), None, tensor)
        self.comm.Recv(buf, src, tag)
        return None

    def exchange(self, sends, recvs):
        """Post every send ``(tensor, dst, tag)`` and receive ``(tensor, src, tag)`` at once; one work for all."""
        return GroupWork([self.send(t, peer, tag, True) for t, peer, tag in sends]
                         + [self.recv(t, peer, tag, True) for t, peer, tag in recvs])

    def barrier(self):
        self.comm.Barrier()


class GroupWork:
    """Several works completed together (the point-to-point exchange of a pipeline step)."""

    __slots__ = ("works", "done")

    def __init__(self, works):
        self.works, self.done = list(works), not works

    def test(self) -> bool:
        if not self.done:
            self.done = all([w.test() for w in self.works])  # a list: test every one (drives progress)
        return self.done

    def wait(self) -> None:
        if not self.done:
            for w in self.works:
                w.wait()
            self.done = True
