"""Host staging warned (#52): a CUDA run whose device collectives would go through host memory (CuPy missing,
NCCL unavailable) says so once at start-up, with the cause and the bytes per step (hpctrain/comm/staging.py,
``announce.host_staging_warning``); on a CPU, with fake CUDA (tests/fake_cuda.py) and a fake NCCL
(tests/fake_nccl.py)."""
import sys
from types import SimpleNamespace

import torch
from mpi4py import MPI

from fake_cuda import FakeCuda
from fake_nccl import FakeNccl
from hpctrain.comm.collectives import Communicator
from hpctrain.comm.staging import staged_bytes, staging_warning
from hpctrain.comm.watchdog import CommStats, Watchdog
from hpctrain.train.announce import host_staging_warning

CUDA = torch.device("cuda", 2)


def communicator(backend="auto"):
    return Communicator(MPI.COMM_SELF, "dp", (0,), Watchdog(0, timeout_s=60), CommStats(), backend=backend)


def test_the_staged_cause_is_kept_by_the_communicator(monkeypatch):
    cuda = FakeCuda(index=2).install(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    comm = communicator()
    assert comm.prepare_device(CUDA) == "mpi-staged"
    assert comm.staged_because.startswith("cupy with NCCL is not importable (ModuleNotFoundError")
    chosen = communicator("mpi")
    assert chosen.prepare_device(CUDA) == "mpi-staged" and chosen.staged_because == "parallel.backend='mpi'"
    FakeNccl(cuda).install(monkeypatch)
    nccl = communicator()
    try:
        assert nccl.prepare_device(CUDA) == "nccl" and nccl.staged_because == ""
    finally:
        nccl.close()
    assert communicator().prepare_device(torch.device("cpu")) == "mpi"


def test_the_cost_per_step_counts_the_groups_with_traffic():
    args = dict(grad_params=1000, local_layers=2, tokens=64, d_model=8, act_bytes=2, microbatches=3)
    act = 64 * 8 * 2
    assert staged_bytes({"dp": 2, "tp": 1, "pp": 1}, **args) == {"dp": 8000}
    assert staged_bytes({"dp": 2, "tp": 2, "pp": 2}, **args) == {"dp": 8000, "tp": 2 * 4 * 2 * act * 3,
                                                                 "pp": 2 * 2 * act * 3}
    assert staged_bytes({"dp": 1, "tp": 1, "pp": 1}, **args) == {}


def test_one_line_names_the_cause_and_the_cost_and_nothing_when_not_staged():
    cost = {"dp": 3 * 2**20, "tp": 2**20}
    line = staging_warning({"dp": "mpi-staged", "tp": "mpi-staged", "world": "mpi-staged"},
                           {"dp": "cupy with NCCL is not importable (ModuleNotFoundError: cupy)"}, cost)
    assert "\n" not in line and "dp/tp are staged through host memory" in line
    assert "cupy with NCCL is not importable" in line and "about 4.0 MiB per step per rank" in line
    assert "(dp 3.0 MiB, tp 1.0 MiB)" in line
    assert staging_warning({"dp": "nccl", "tp": "nccl"}, {}, cost) == ""
    assert staging_warning({"dp": "mpi-staged"}, {"dp": "x"}, {}) == ""  # one rank per group: no traffic


def test_announce_computes_the_warning_from_the_run(monkeypatch):
    FakeCuda(index=2).install(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", None)
    comm = communicator()
    backends = {"dp": comm.prepare_device(CUDA), "world": "mpi-staged"}
    stage = SimpleNamespace(layers={"0": None, "1": None})
    model = torch.nn.Linear(10, 10)  # 110 trainable parameters
    parts = SimpleNamespace(local_model=model, stages=[stage], backends=backends,
                            layout=SimpleNamespace(micro_batch=2, microbatches=4),
                            model_cfg=SimpleNamespace(d_model=8), executor=SimpleNamespace(act_dtype=torch.bfloat16))
    grid = SimpleNamespace(sizes={"dp": 2, "tp": 1, "pp": 1, "cp": 1}, comm=lambda axis: comm)
    cfg = SimpleNamespace(train=SimpleNamespace(seq_len=16))
    line = host_staging_warning(cfg, grid, parts)
    assert line.startswith("GPU collectives of dp are staged through host memory (backend mpi-staged: cupy")
    assert "about 0.9 KiB per step per rank" in line and "(dp 0.9 KiB)" in line  # 2 x 4 x 110 bytes
