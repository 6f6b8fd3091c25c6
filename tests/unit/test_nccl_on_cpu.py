"""The NCCL backend (hpctrain/comm/backends/nccl.py) on a CPU: its work objects, its calls into a fake
``cupy.cuda.nccl`` (tests/fake_nccl.py: two ranks in one process, the kernels run on host memory), its stream
and event protocol (tests/fake_cuda.py), the unique id's broadcast, and a ``Communicator`` over MPI.COMM_SELF
whose watchdog polls the NCCL work's event from its own thread, under the rank's GPU. tests/gpu/ runs the
same code on GPUs."""
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from fake_cuda import FakeCuda, Work, as_cuda
from fake_nccl import NCCL_H_DTYPES, NCCL_H_OPS, FakeNccl
from hpctrain.comm.backends.nccl import NcclBackend, NcclWork, distinct_gpus, nccl_available
from hpctrain.comm.collectives import Communicator
from hpctrain.comm.watchdog import CommStats, Watchdog


class FakeMpi:
    """Rank ``rank`` of ``size`` ranks driven in one process; ``board`` carries the broadcast object."""

    def __init__(self, rank, size, board, gathered=None):
        self.rank, self.size, self.board, self.gathered = rank, size, board, gathered

    def Get_rank(self):  # noqa: N802
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.size

    def bcast(self, obj, root=0):
        if self.rank == root:
            self.board["bcast"] = obj
        return self.board["bcast"]

    def allgather(self, obj):
        return self.gathered if self.gathered is not None else [obj] * self.size


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda(index=2).install(monkeypatch)


@pytest.fixture
def nccl(cuda, monkeypatch):  # an older cupy: no bfloat16 nor avg names, the backend falls back to nccl.h
    names = [n for n in NCCL_H_DTYPES if n != "NCCL_BFLOAT16"]
    return FakeNccl(cuda, dtype_names=names, op_names=[n for n in NCCL_H_OPS if n != "NCCL_AVG"]).install(monkeypatch)


def two_ranks():
    board = {}
    return [NcclBackend(FakeMpi(rank, 2, board)) for rank in (0, 1)]


def test_work_follows_its_event_and_is_polled_under_the_ranks_gpu(cuda):
    kernel, side = Work("allReduce"), torch.cuda.Stream()
    side.queued.append(kernel)
    event = torch.cuda.Event()
    event.record(side)
    keep = torch.ones(3)
    work = NcclWork(event, keepalive=keep)  # on a GPU, set_device(2) was made by bind_device
    assert not hasattr(work, "__dict__") and work.device == 2
    assert not work.test() and work.keepalive is keep and not work.done  # queued: not done, buffers held
    assert ("wait_event", "compute", event.id) not in cuda.log
    seen = []
    poll = threading.Thread(target=lambda: seen.append(work.device_done()), name="hpctrain-watchdog")
    poll.start()
    poll.join()
    assert seen == [False] and cuda.log[-1] == ("query", event.id, "hpctrain-watchdog", 2)  # GPU 2, not 0
    kernel.done = True
    assert work.test() and work.done and work.keepalive is None  # the compute stream waits; buffers released
    assert cuda.log.count(("wait_event", "compute", event.id)) == 1
    work.wait()
    assert cuda.log.count(("wait_event", "compute", event.id)) == 1  # idempotent
    assert work.device_done()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_collectives_of_two_ranks_equal_the_reference(nccl, dtype):
    b0, b1 = two_ranks()
    assert b0.comm.job is b1.comm.job and b0.size == 2  # one unique id, made once on rank 0
    assert b0.side is not b1.side

    def pair(*shape, base=0):
        return [torch.arange(base, base + torch.Size(shape).numel()).reshape(shape).to(dtype) * (r + 1)
                for r in range(2)]

    x = pair(6)
    ref = x[0] + x[1]
    got = [as_cuda(t.clone()) for t in x]
    b0.allreduce(got[0])
    b1.allreduce(got[1])
    assert all(torch.equal(g, ref) for g in got)
    ops = ["max"] + (["avg"] if dtype.is_floating_point else [])
    for op in ops:
        got = [as_cuda(t.clone()) for t in x]
        b0.allreduce(got[0], op=op)
        b1.allreduce(got[1], op=op)
        want = torch.maximum(x[0], x[1]) if op == "max" else (x[0] + x[1]) / 2
        assert all(torch.equal(g, want.to(dtype)) for g in got), op
    # the test keeps every buffer alive until both ranks have called: on a GPU a blocking call's buffers may go
    # once the compute stream waits for the kernel; here the "kernel" runs when the last rank calls
    outs, ins = [as_cuda(torch.zeros(3, dtype=dtype)) for _ in range(2)], [as_cuda(t.clone()) for t in x]
    b0.reduce_scatter(outs[0], ins[0])
    b1.reduce_scatter(outs[1], ins[1])
    assert torch.equal(outs[0], ref[:3]) and torch.equal(outs[1], ref[3:])
    gathered = [as_cuda(torch.zeros(12, dtype=dtype)) for _ in range(2)]
    ins = [as_cuda(t) for t in x]
    b0.allgather(gathered[0], ins[0])
    b1.allgather(gathered[1], ins[1])
    assert all(torch.equal(g, torch.cat(x)) for g in gathered)
    inplace = [as_cuda(torch.cat([x[0][:3], torch.zeros(3, dtype=dtype)])),
               as_cuda(torch.cat([torch.zeros(3, dtype=dtype), x[1][3:]]))]  # each rank's block at its place
    b0.allgather(inplace[0])
    b1.allgather(inplace[1])
    assert all(torch.equal(g, torch.cat([x[0][:3], x[1][3:]])) for g in inplace)
    sent = [as_cuda(t.clone()) for t in x]
    b0.broadcast(sent[0], root=1)
    b1.broadcast(sent[1], root=1)
    assert all(torch.equal(s, x[1]) for s in sent)
    outs = [as_cuda(torch.zeros(6, dtype=dtype)) for _ in range(2)]
    b0.alltoall(outs[0], ins[0])
    b1.alltoall(outs[1], ins[1])
    assert torch.equal(outs[0], torch.cat([x[0][:3], x[1][:3]]))  # block j of every input to rank j
    assert torch.equal(outs[1], torch.cat([x[0][3:], x[1][3:]]))


def test_point_to_point_and_grouped_exchange(nccl):
    b0, b1 = two_ranks()
    a, into = as_cuda(torch.arange(4.0)), as_cuda(torch.zeros(4))
    w_send = b0.send(a, dst=1, nonblocking=True)
    assert not w_send.test()  # the receive is not posted yet: the event stays incomplete
    b1.recv(into, src=0)
    assert torch.equal(into, torch.arange(4.0)) and w_send.test()
    mine = [as_cuda(torch.full((5,), float(r + 1))) for r in range(2)]
    theirs = [as_cuda(torch.zeros(5)) for _ in range(2)]
    works = [b.exchange([(mine[r], 1 - r, 0)], [(theirs[r], 1 - r, 0)]) for r, b in enumerate((b0, b1))]
    assert all(w.test() for w in works)  # exchange is non-blocking: done once both ranks' groups ran
    assert torch.equal(theirs[0], mine[1]) and torch.equal(theirs[1], mine[0])
    grouped = [c for c in nccl.calls if c[1] in ("send", "recv") and c[2][-1] > 0]  # made inside a group
    assert len(grouped) == 4 and nccl.group_depth == 0 and nccl.groups == 2


def test_the_call_contract_streams_pointers_constants(nccl, cuda):
    (backend,) = [NcclBackend(FakeMpi(0, 1, {}))]
    side = backend.side
    t = as_cuda(torch.ones(8, dtype=torch.bfloat16))
    cuda.log.clear()
    work = backend.allreduce(t, op="avg", nonblocking=True)
    (rank, name, args, stream), = nccl.calls
    assert (name, args, stream) == ("allReduce", (t.data_ptr(), t.data_ptr(), 8, 9, 4), side.cuda_stream)
    assert cuda.log[:3] == [("wait_stream", side.name, "compute"), ("nccl", "allReduce", side.name),
                            ("record", work.event.id, side.name)]  # after the producers, before the event
    assert ("wait_event", "compute", work.event.id) not in cuda.log  # non-blocking: the compute stream runs on
    work.wait()
    assert cuda.log[-1] == ("wait_event", "compute", work.event.id)
    out = as_cuda(torch.zeros(4, dtype=torch.float32))
    backend.allgather(out)  # in place, one rank: this rank's block is the whole buffer
    assert nccl.calls[-1][1:3] == ("allGather", (out.data_ptr(), out.data_ptr(), 4, 7))
    assert cuda.log[-1][0] == "wait_event"  # blocking: the compute stream waits at once, the host does not
    backend.broadcast(out, root=0)
    assert nccl.calls[-1][2] == (out.data_ptr(), out.data_ptr(), 4, 7, 0)
    backend.close()
    backend.close()
    assert nccl.destroyed == [0] and backend.comm is None


def test_bad_input_is_refused_by_name(nccl):
    backend = NcclBackend(FakeMpi(0, 1, {}))
    with pytest.raises(TypeError, match="unsupported dtype torch.complex64"):
        backend.allreduce(as_cuda(torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(ValueError, match="contiguous CUDA tensors"):
        backend.allreduce(torch.zeros(2))  # a host tensor
    with pytest.raises(ValueError, match="contiguous CUDA tensors"):
        backend.allreduce(as_cuda(torch.zeros(4, 2).t()))
    with pytest.raises(ValueError, match="unknown reduction op 'min'"):
        backend.allreduce(as_cuda(torch.zeros(2)), op="min")
    with pytest.raises(ValueError, match="op='avg' needs a floating-point tensor"):
        backend.allreduce(as_cuda(torch.zeros(2, dtype=torch.int64)), op="avg")
    with pytest.raises(ValueError, match="reduce_scatter: input has 3 elements"):
        backend.reduce_scatter(as_cuda(torch.zeros(2)), as_cuda(torch.zeros(3)))
    with pytest.raises(ValueError, match="allgather: output has 4 elements"):
        backend.allgather(as_cuda(torch.zeros(4)), as_cuda(torch.zeros(3)))
    assert nccl.calls == []


def test_availability_and_distinct_gpus_explain_themselves(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nccl_available() == (False, "no CUDA device is visible to torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)  # import cupy raises ImportError
    ok, reason = nccl_available()
    assert not ok and reason.startswith("cupy with NCCL is not importable (ModuleNotFoundError")
    FakeNccl(cuda).install(monkeypatch)
    assert nccl_available() == (True, "")
    device = torch.device("cuda", 2)
    assert distinct_gpus(FakeMpi(0, 2, {}, gathered=[("n1", "GPU-0"), ("n1", "GPU-1")]), device) == (True, "")
    assert distinct_gpus(FakeMpi(0, 2, {}, gathered=[("n1", "GPU-0"), ("n1", "GPU-0")]), device) == \
        (False, "2 ranks of this group share GPU GPU-0 on n1")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid=""))
    mine = []
    distinct_gpus(SimpleNamespace(allgather=lambda obj: mine.append(obj) or [obj]), device)
    assert mine[0][1] == "NVIDIA H100 80GB HBM3#2"  # no uuid: the GPU's name and index


def test_a_communicator_keeps_queued_nccl_work_watched_until_its_event_completes(cuda, nccl):
    dog = Watchdog(0, timeout_s=4)  # polls every second
    comm = Communicator(MPI.COMM_SELF, "dp", (0,), dog, CommStats(), backend="nccl")
    try:
        assert comm.prepare_device(torch.device("cuda", 2)) == "nccl"
        assert comm.prepare_device(torch.device("cuda", 2)) == "nccl"  # once per group: kept
        x = as_cuda(torch.arange(4.0))
        comm.allreduce(x)  # one rank: the kernel has run, the event is complete
        assert dog.inflight() == [] and torch.equal(x, torch.arange(4.0))
        cuda.hold_events = True  # the next event does not complete: a kernel still queued (or stuck)
        comm.allreduce(x)
        cuda.hold_events = False
        (held,) = [e for e in cuda.events if e.held]
        assert [c.op for c in dog.inflight()] == ["allreduce"]  # the host returned, the device has not
        deadline = time.monotonic() + 10
        polls = []
        while not polls and time.monotonic() < deadline:
            time.sleep(0.05)
            polls = [e for e in list(cuda.log) if e[0] == "query" and e[2] == "hpctrain-watchdog"]
        assert polls and all(e[3] == 2 for e in polls)  # the watchdog thread asks under the rank's GPU
        held.held = False
        while dog.inflight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dog.inflight() == []
        handle = comm.allreduce(x, op="max", nonblocking=True)
        assert handle.test() and dog.inflight() == []
        assert comm.stats.ops[("dp", "allreduce")].calls == 3
    finally:
        comm.close()
        dog.close()
    assert nccl.destroyed == [0]

