"""Collectives on CUDA tensors through the NCCL (CuPy) and CUDA-aware MPI backends.

The multi-rank tests skip, with the reason, where CUDA, CuPy/NCCL, enough GPUs or a CUDA-aware MPI
are missing (PyPI MPICH is not CUDA-aware: set HPCTRAIN_TEST_CUDA_MPI=1 where mpi4py's MPI is).
The table checks at the bottom run everywhere.
"""
import os

import pytest
import torch

from hpctrain.comm.backends import nccl as nccl_backend
from mpirun import run_mpi

NCCL_OK, NCCL_REASON = nccl_backend.nccl_available()
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# ncclDataType_t / ncclRedOp_t from nccl.h (stable ABI since NCCL 2.0; bfloat16 since 2.10, avg since 2.10)
NCCL_H_DTYPES = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4,
                 "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}
NCCL_H_OPS = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
# the dtypes tests/mpi/scripts/check_collectives.py runs (host and device)
HOST_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]


@pytest.mark.skipif(NCCL_OK and GPUS < 2, reason=f"NCCL needs one GPU per rank: 2 ranks, {GPUS} visible GPU(s)")
@pytest.mark.skipif(not NCCL_OK, reason=f"NCCL backend unavailable: {NCCL_REASON}")
def test_collectives_on_cuda_through_nccl():
    result = run_mpi(2, "check_collectives.py", "--device", "cuda", "--backend", "nccl", timeout=300)
    assert "OK" in result.stdout and "backend nccl" in result.stdout


@pytest.mark.skipif(os.environ.get("HPCTRAIN_TEST_CUDA_MPI") != "1",
                    reason="CUDA-aware MPI not declared: set HPCTRAIN_TEST_CUDA_MPI=1 when mpi4py's MPI library "
                           "accepts device pointers (the PyPI MPICH wheel does not)")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
def test_collectives_on_cuda_through_cuda_aware_mpi():
    result = run_mpi(2, "check_collectives.py", "--device", "cuda", "--backend", "cuda-mpi", timeout=300)
    assert "OK" in result.stdout and "backend mpi" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
def test_collectives_on_cuda_through_host_staged_mpi():
    """Any MPI, ranks may share one GPU: every collective on CUDA tensors staged through host memory."""
    result = run_mpi(2, "check_collectives.py", "--device", "cuda", "--backend", "mpi", "--tp", "2", timeout=300)
    assert "OK" in result.stdout and "backend mpi-staged" in result.stdout


@pytest.mark.skipif(not NCCL_OK, reason=f"NCCL backend unavailable: {NCCL_REASON}")
def test_collectives_on_one_gpu_through_nccl():
    """A one-rank NCCL communicator: the CuPy calls (groups, streams, events) run for real on one GPU."""
    result = run_mpi(1, "check_collectives.py", "--device", "cuda", "--backend", "nccl", timeout=300)
    assert "OK" in result.stdout and "backend nccl" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
@pytest.mark.parametrize("ranks,backend", [(2, "mpi"), (1, "nccl"), (2, "nccl")])
def test_alltoallv_on_cuda(ranks, backend):
    """Uneven pieces of CUDA tensors (tests/mpi/scripts/check_alltoallv.py): host staging (ranks may share a
    GPU), one-rank NCCL (the send/recv group to itself, for real) and, with a GPU per rank, NCCL."""
    if backend == "nccl" and not NCCL_OK:
        pytest.skip(f"NCCL backend unavailable: {NCCL_REASON}")
    if backend == "nccl" and GPUS < ranks:
        pytest.skip(f"NCCL needs one GPU per rank: {ranks} ranks, {GPUS} visible GPU(s)")
    result = run_mpi(ranks, "check_alltoallv.py", "--device", "cuda", "--backend", backend, timeout=300)
    want = "mpi-staged" if backend == "mpi" else backend
    assert f"OK {ranks * 56} checks on {ranks} ranks, backend {want}" in result.stdout, result.output


def test_nccl_dtype_table_matches_nccl_h():
    table = nccl_backend.NCCL_DTYPES
    for dtype, (name, value) in table.items():
        assert isinstance(dtype, torch.dtype)
        assert NCCL_H_DTYPES.get(name) == value, f"{dtype}: {name}={value} disagrees with nccl.h"
        assert torch.empty((), dtype=dtype).element_size() == _nccl_size(name), dtype
    assert len({v for _, v in table.values()}) == len(table), "two torch dtypes map to one NCCL type"
    missing = [d for d in HOST_DTYPES if d not in table]
    assert not missing, f"dtypes the MPI backend handles but NCCL does not: {missing}"


def test_nccl_op_table_matches_nccl_h_and_the_collective_contract():
    table = nccl_backend.NCCL_OPS
    assert set(table) == {"sum", "avg", "max"}  # the ops every backend accepts (Communicator.allreduce)
    for op, (name, value) in table.items():
        assert NCCL_H_OPS.get(name) == value, f"{op}: {name}={value} disagrees with nccl.h"


def test_const_prefers_the_library_constant_and_falls_back_to_nccl_h():
    class WithNames:
        NCCL_FLOAT32 = 7

    class WithoutNames:
        pass

    assert nccl_backend.nccl_constant(WithNames, nccl_backend.NCCL_DTYPES, torch.float32) == 7
    assert nccl_backend.nccl_constant(WithoutNames, nccl_backend.NCCL_DTYPES, torch.bfloat16) == 9
    assert nccl_backend.nccl_constant(WithoutNames, nccl_backend.NCCL_OPS, "avg") == 4


@pytest.mark.skipif(not NCCL_OK, reason=f"NCCL backend unavailable: {NCCL_REASON}")
def test_nccl_table_names_agree_with_cupy():
    from cupy.cuda import nccl

    for table in (nccl_backend.NCCL_DTYPES, nccl_backend.NCCL_OPS):
        for name, value in table.values():
            if hasattr(nccl, name):
                assert getattr(nccl, name) == value, f"cupy.cuda.nccl.{name} = {getattr(nccl, name)} != {value}"


def test_nccl_available_explains_itself():
    ok, reason = nccl_backend.nccl_available()
    assert isinstance(ok, bool) and (ok or reason), "a missing NCCL backend must say why"


def _nccl_size(name: str) -> int:
    """Bytes per element from the NCCL type name: NCCL_FLOAT16 -> 2, NCCL_UINT8 -> 1."""
    return int("".join(c for c in name if c.isdigit())) // 8
