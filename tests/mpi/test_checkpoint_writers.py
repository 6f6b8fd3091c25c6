"""Both checkpoint writers produce the same logical checkpoint, and each reads the other's.

Needs h5py built with MPI (the cluster-like environment of scripts/setup_parallel_hdf5.sh; CI runs
this file there via scripts/test_parallel_hdf5.sh). Skips with the reason elsewhere.
"""
import json

import h5py
import pytest

from mpirun import run_mpi
from test_checkpoint import F32, ckpt, losses, train

pytestmark = pytest.mark.skipif(not h5py.get_config().mpi,
                                reason="h5py is serial (PyPI wheel): the collective mpio writer needs h5py built "
                                       "with MPI; run scripts/test_parallel_hdf5.sh")
LAYOUT = ["parallel.tp=2", "parallel.pp=1", "parallel.zero=1", "parallel.microbatches=1"]  # 4 ranks: dp=2


def test_mpio_and_shards_write_the_same_checkpoint(tmp_path):
    a, b = tmp_path / "mpio", tmp_path / "shards"
    train(4, a, *F32, *LAYOUT, "checkpoint.writer=mpio", "--max-steps", "2")
    train(4, b, *F32, *LAYOUT, "checkpoint.writer=shards", "--max-steps", "2")
    ckpt("diff", str(a), str(b), "--atol", "0")
    info_a = json.loads(ckpt("inspect", str(a), "--json").stdout)
    info_b = json.loads(ckpt("inspect", str(b), "--json").stdout)
    assert info_a["writer"] == "mpio" and info_b["writer"] == "shards"
    def content(info):  # every tensor and its box checksums (RNG rows are per process, not model state)
        return [(t["name"], t["shape"], t["crc32"]) for t in info["tensors"] if not t["name"].startswith("rng/")]
    assert content(info_a) == content(info_b) and len(content(info_a)) > 50
    assert "OK" in ckpt("verify", str(a)).stdout


def test_each_writer_resumes_the_others_checkpoint_in_another_layout(tmp_path):
    whole = tmp_path / "whole"
    train(2, whole, *F32, "parallel.tp=1", "parallel.pp=1")
    run_dir = tmp_path / "chain"
    train(4, run_dir, *F32, *LAYOUT, "checkpoint.writer=mpio", "--max-steps", "3")
    train(2, run_dir, *F32, "parallel.tp=1", "parallel.pp=2", "checkpoint.writer=shards", "--max-steps", "3",
          "--resume", "auto")
    train(4, run_dir, *F32, "parallel.tp=2", "parallel.pp=2", "checkpoint.writer=mpio", "--resume", "auto")
    ref, got = losses(whole), losses(run_dir)
    assert sorted(got) == sorted(ref)
    assert all(abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]) for s in ref), (got, ref)
