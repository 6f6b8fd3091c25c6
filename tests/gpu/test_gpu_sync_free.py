"""The sync-free step on a GPU (issue #26, item 2): no host wait inside ``train_step(defer=True)``.

tests/mpi/test_host_reads.py proves on the CPU that hpctrain's step code makes no ``.item()``-style read;
here the same audit runs on CUDA tensors, where it also sees blocking device-to-host copies, with torch's
sync debug mode on (every synchronising CUDA call torch makes warns "called a synchronizing CUDA operation";
the mode's one-time "prototype feature" notice is not counted: ``host_reads.sync_warnings``, tested on the CPU
in tests/unit/test_cuda_paths_on_cpu.py): bfloat16 eager and float16 compiled (the device loss scale). Skips
without CUDA.
"""
import pytest
import torch

from mpirun import run_mpi

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")


def test_deferred_steps_on_cuda_do_not_wait_for_the_device():
    cases = ["dp=1:train.device=cuda train.dtype=bfloat16",
             "dp=1:train.device=cuda train.dtype=float16 train.compile=true"]
    result = run_mpi(1, "check_host_reads.py", *cases, timeout=600)
    assert "HOST READS OK" in result.stdout, result.stdout
