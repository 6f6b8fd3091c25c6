"""A fake ``cupy.cuda.nccl`` whose communicators run the collectives on host memory, for CPU tests.

The ranks of one NCCL "job" live in one process and are driven by the test one after the other (each with
its own ``FakeCuda``-made streams): a rank's call enqueues a ``Work`` on the stream it names; once every rank
has made the job's next collective (or a send meets its receive), the fake kernel runs on the buffers at
the raw pointers given (``torch.frombuffer`` over that memory: tensors made with tests/fake_cuda.py's
``as_cuda``) and the work is done, which completes the events recorded after it. It checks NCCL's contract
as the library would: the same collective, count, datatype and op on every rank, datatype and op constants
from nccl.h, a known stream, point-to-point calls of one ``exchange`` inside one group. ``calls`` keeps
every call as made: (rank, name, args).
"""
from __future__ import annotations

import ctypes
import itertools
import sys
from types import ModuleType

import torch

from fake_cuda import Work

NCCL_H_DTYPES = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4,
                 "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}
NCCL_H_OPS = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
TORCH_OF = {1: torch.uint8, 2: torch.int32, 4: torch.int64, 6: torch.float16, 7: torch.float32, 8: torch.float64,
            9: torch.bfloat16}


def memory(ptr: int, count: int, datatype: int) -> torch.Tensor:
    """``count`` elements of NCCL ``datatype`` at address ``ptr``, as a tensor sharing that memory."""
    dtype = TORCH_OF[datatype]
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class Job:
    """The ranks sharing one unique id: their pending collectives and point-to-point messages."""

    def __init__(self, size: int):
        self.size = size
        self.pending: dict[int, dict[int, tuple]] = {}  # collective number -> {rank: (name, args, work)}
        self.messages: dict[tuple[int, int], list] = {}  # (src, dst) -> unmatched sends or receives


class FakeNccl(ModuleType):
    """The module: ``install(monkeypatch)`` puts it at ``cupy.cuda.nccl`` (and a ``cupy`` package above it)."""

    def __init__(self, cuda, dtype_names=tuple(NCCL_H_DTYPES), op_names=tuple(NCCL_H_OPS)):
        super().__init__("cupy.cuda.nccl")
        for name in dtype_names:  # a cupy may lack some names (bfloat16, avg): the backend has nccl.h's values
            setattr(self, name, NCCL_H_DTYPES[name])
        for name in op_names:
            setattr(self, name, NCCL_H_OPS[name])
        self.cuda, self.jobs, self.ids = cuda, {}, itertools.count()
        self.calls: list[tuple] = []
        self.group_depth = 0
        self.groups = 0  # groupEnd calls
        self.destroyed: list[int] = []

    def install(self, monkeypatch) -> FakeNccl:
        cupy, cuda_pkg = ModuleType("cupy"), ModuleType("cupy.cuda")
        cupy.cuda, cuda_pkg.nccl = cuda_pkg, self  # type: ignore[attr-defined]
        for name, module in (("cupy", cupy), ("cupy.cuda", cuda_pkg), ("cupy.cuda.nccl", self)):
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def get_unique_id(self):
        return ("nccl-unique-id", next(self.ids))

    def groupStart(self):  # noqa: N802 - cupy's names
        self.group_depth += 1

    def groupEnd(self):  # noqa: N802
        assert self.group_depth > 0, "groupEnd without groupStart"
        self.group_depth -= 1
        self.groups += 1

    def NcclCommunicator(self, ndev: int, unique_id, rank: int):  # noqa: N802
        job = self.jobs.setdefault(unique_id, Job(ndev))
        assert job.size == ndev and 0 <= rank < ndev, (ndev, rank)
        return Communicator(self, job, rank)


class Communicator:
    def __init__(self, nccl: FakeNccl, job: Job, rank: int):
        self.nccl, self.job, self.rank, self.seq = nccl, job, rank, 0

    def rank_id(self) -> int:
        return self.rank

    def destroy(self) -> None:
        self.nccl.destroyed.append(self.rank)

    def _enqueue(self, name: str, args: tuple, stream: int) -> Work:
        assert stream in self.nccl.cuda.streams, f"{name}: stream {stream} is no stream of this process"
        self.nccl.calls.append((self.rank, name, args, stream))
        work = Work(name)
        self.nccl.cuda.streams[stream].queued.append(work)
        self.nccl.cuda.log.append(("nccl", name, self.nccl.cuda.streams[stream].name))
        return work

    def _collective(self, name: str, args: tuple, stream: int) -> None:
        work = self._enqueue(name, args, stream)
        self.seq += 1
        calls = self.job.pending.setdefault(self.seq, {})
        calls[self.rank] = (name, args, work)
        if len(calls) == self.job.size:
            del self.job.pending[self.seq]
            run_collective(self.job.size, [calls[r] for r in range(self.job.size)])

    def allReduce(self, send, recv, count, datatype, op, stream):  # noqa: N802
        self._collective("allReduce", (send, recv, count, datatype, op), stream)

    def reduceScatter(self, send, recv, count, datatype, op, stream):  # noqa: N802
        self._collective("reduceScatter", (send, recv, count, datatype, op), stream)

    def allGather(self, send, recv, count, datatype, stream):  # noqa: N802
        self._collective("allGather", (send, recv, count, datatype), stream)

    def broadcast(self, send, recv, count, datatype, root, stream):
        self._collective("broadcast", (send, recv, count, datatype, root), stream)

    def send(self, buf, count, datatype, peer, stream):
        self._p2p("send", (self.rank, peer), (buf, count, datatype), stream)

    def recv(self, buf, count, datatype, peer, stream):
        self._p2p("recv", (peer, self.rank), (buf, count, datatype), stream)

    def _p2p(self, name: str, route: tuple[int, int], args: tuple, stream: int) -> None:
        work = self._enqueue(name, args + (route, self.nccl.group_depth), stream)
        queue = self.job.messages.setdefault(route, [])
        if queue and queue[0][0] != name:  # meets its counterpart: copy send -> recv
            other_name, other_args, other_work = queue.pop(0)
            (sbuf, scount, sdtype), (rbuf, rcount, rdtype) = ((args, other_args) if name == "send"
                                                               else (other_args, args))
            assert (scount, sdtype) == (rcount, rdtype), f"send {scount} x {sdtype} meets recv {rcount} x {rdtype}"
            memory(rbuf, rcount, rdtype).copy_(memory(sbuf, scount, sdtype))
            work.done = other_work.done = True
        else:
            queue.append((name, args, work))


def run_collective(size: int, calls: list[tuple]) -> None:
    """Run one collective made by every rank (``calls[r]``: rank r's (name, args, work))."""
    names = {name for name, _, _ in calls}
    assert len(names) == 1, f"ranks made different collectives at once: {names}"
    name = names.pop()
    shared = {args[2:] for _, args, _ in calls}  # count, datatype (op / root) agree on every rank
    assert len(shared) == 1, f"{name}: ranks disagree on count / datatype / op / root: {shared}"
    count, datatype, *rest = calls[0][1][2:]
    sends = [memory(args[0], count, datatype).clone() for _, args, _ in calls]
    if name in ("allReduce", "reduceScatter"):
        op = rest[0]
        stacked = torch.stack([memory(args[0], count * (size if name == "reduceScatter" else 1), datatype).clone()
                               for _, args, _ in calls])
        total = {0: stacked.sum(0), 2: stacked.max(0).values, 4: stacked.sum(0) / size}[op].to(stacked.dtype)
        for rank, (_, args, _) in enumerate(calls):
            part = total if name == "allReduce" else total[rank * count:(rank + 1) * count]
            memory(args[1], count, datatype).copy_(part)
    elif name == "allGather":
        gathered = torch.cat(sends)
        for _, args, _ in calls:
            memory(args[1], count * size, datatype).copy_(gathered)
    else:  # broadcast
        for _, args, _ in calls:
            memory(args[1], count, datatype).copy_(sends[rest[0]])
    for _, _, work in calls:
        work.done = True
