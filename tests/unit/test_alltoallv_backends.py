"""``Communicator.alltoallv`` on one process: the NCCL backend's grouped send/recv on a fake NCCL (two ranks in
one process, tests/fake_nccl.py), host staging of CUDA tensors (pinning faked), arguments refused by name
before any communication, and the bytes counted. Real ranks: tests/mpi/test_alltoallv.py."""
import re

import pytest
import torch
from mpi4py import MPI

from fake_cuda import FakeCuda, as_cuda
from fake_nccl import FakeNccl
from hpctrain.comm.backends.nccl import NcclBackend
from hpctrain.comm.backends.staged import HostStagedBackend
from hpctrain.comm.collectives import Communicator
from hpctrain.comm.watchdog import CommStats, Watchdog
from test_nccl_on_cpu import FakeMpi


@pytest.fixture
def nccl(monkeypatch):
    return FakeNccl(FakeCuda(index=0).install(monkeypatch)).install(monkeypatch)


def self_comm(**kwargs) -> Communicator:
    return Communicator(MPI.COMM_SELF, "ep", (0,), Watchdog(0, timeout_s=0), CommStats(), **kwargs)


@pytest.mark.parametrize("dtype,row", [(torch.float32, ()), (torch.int64, (3,)), (torch.bfloat16, (2, 2))])
def test_nccl_sends_each_nonempty_piece_in_one_group(nccl, dtype, row):
    board = {}
    b0, b1 = (NcclBackend(FakeMpi(rank, 2, board)) for rank in (0, 1))
    splits = [[2, 3], [0, 1]]  # splits[i][j]: rows rank i sends to rank j (rank 1 sends nothing to rank 0)
    width = torch.Size(row).numel()
    ins = [as_cuda(torch.arange(sum(s) * width).reshape((sum(s),) + row).to(dtype) + 100 * i)
           for i, s in enumerate(splits)]
    outs = [as_cuda(torch.full((splits[0][j] + splits[1][j],) + row, -1).to(dtype)) for j in range(2)]
    works = [b.alltoallv(outs[r], [splits[0][r], splits[1][r]], ins[r], splits[r], nonblocking=True)
             for r, b in enumerate((b0, b1))]
    assert all(w.test() for w in works)
    assert torch.equal(outs[0], ins[0][:2])  # from rank 0 its first 2 rows, from rank 1 none
    assert torch.equal(outs[1], torch.cat([ins[0][2:], ins[1]]))
    p2p = [c for c in nccl.calls if c[1] in ("send", "recv")]
    assert len(p2p) == 6 and all(c[2][-1] == 1 for c in p2p)  # 3 pieces, each a send and a recv, grouped
    assert ("send", 2 * width) in [(c[1], c[2][1]) for c in p2p if c[0] == 0]
    assert nccl.groups == 2 and nccl.group_depth == 0


def test_nccl_refuses_different_dtypes(nccl):
    backend = NcclBackend(FakeMpi(0, 1, {}))
    with pytest.raises(TypeError, match="alltoallv: input torch.float32 and output torch.int64 differ"):
        backend.alltoallv(as_cuda(torch.zeros(2, dtype=torch.int64)), [2], as_cuda(torch.zeros(2)), [2])


def test_host_staging_copies_through_the_host_and_back(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # no pinned allocator
    backend = HostStagedBackend(MPI.COMM_SELF)
    x, out = as_cuda(torch.arange(12.0).reshape(4, 3)), as_cuda(torch.zeros(4, 3))
    assert backend.alltoallv(out, [4], x, [4]) is None
    assert torch.equal(out, x)
    out2 = as_cuda(torch.zeros(4, 3))
    work = backend.alltoallv(out2, [4], x, [4], nonblocking=True)
    work.wait()
    assert work.done and torch.equal(out2, x)


def test_communicator_counts_and_refuses_bad_arguments_by_name():
    comm = self_comm()
    x, out = torch.arange(10.0).reshape(5, 2), torch.zeros(5, 2)
    comm.alltoallv(out, [5], x, [5])
    assert torch.equal(out, x)
    counter = comm.stats.ops[("ep", "alltoallv")]
    assert (counter.calls, counter.bytes, counter.sent) == (1, 40, 0)  # nothing leaves a group of one
    comm.alltoallv(torch.zeros(0, 2), [0], torch.zeros(0, 2), [0])  # empty
    comm.alltoallv(out, [5], x, [5], nonblocking=True).wait()
    assert counter.calls == 3 and comm.seq == 3
    head = "alltoallv on group 'ep' (rank 0 of 1): "
    bad = [((out, [5, 0], x, [5]), "input_splits has 1 entries and output_splits 2; expected one per rank (1)"),
           ((out, [5], x, [6]), "input_splits [6] add up to 6 rows, input has 5; output_splits [5] add up to 5"),
           ((out, [-1], x, [5]), "negative split in input_splits [5] or output_splits [-1]"),
           ((torch.zeros(5, 3), [5], x, [5]), "must have at least one dimension, the same dtype and the same "
                                              "trailing dims"),
           ((out.double(), [5], x, [5]), "input torch.float32 (5, 2) and output torch.float64 (5, 2)"),
           ((torch.zeros(()), [1], torch.zeros(()), [1]), "must have at least one dimension")]
    for args, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            comm.alltoallv(*args)
        assert str(info.value).startswith(head)
    assert counter.calls == 3 and comm.seq == 3  # refused before any call
    assert comm.alltoall_splits([7]) == [7]
    with pytest.raises(ValueError, match="alltoall_splits: 2 splits for a group of 1 ranks"):
        comm.alltoall_splits([1, 2])


def test_comm_check_passes_agreeing_splits_on_one_rank():
    comm = self_comm(check=True)
    comm.alltoallv(torch.zeros(3), [3], torch.ones(3), [3])
    assert comm.stats.ops[("ep", "alltoallv")].calls == 1
