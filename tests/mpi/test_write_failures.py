"""A checkpoint that cannot be written ends the job in seconds with ONE line naming the cause, and keeps
what was published: a full file system (a real tmpfs, mounted here by root), an ENOSPC injected on one
rank only (the others must not wait in another collective), HDF5's destructor noise kept out."""
import os
import subprocess
import time

import h5py
import numpy as np
import pytest

from hpctrain.checkpoint.writers import write_or_error
from mpirun import run_mpi

FAST = ["--config", "configs/tiny.toml", "parallel.pp=1", "data.max_bytes=200000", "train.progress=false",
        "checkpoint.interval=2", "checkpoint.keep=1", "train.steps=8", "--resume", "none"]


@pytest.fixture
def small_fs(tmp_path):
    """A 5 MiB tmpfs: room for one checkpoint of the tiny model (3.2 MiB on 2 ranks), not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def train(run_dir, *extra, env=None):
    started = time.monotonic()
    result = run_mpi(2, "hpctrain.cli", "train", *FAST, f"train.run_dir={run_dir}", *extra, module=True,
                     timeout=180, env=env, check=False)
    return result, time.monotonic() - started


def one_error_line(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    assert len(errors) == 1, result.output[-3000:]
    assert "Traceback" not in result.output and "Exception ignored" not in result.output, result.output[-3000:]
    return errors[0]


def test_a_full_file_system_stops_the_run_with_one_line_and_keeps_latest(tmp_path, small_fs):
    result, seconds = train(tmp_path / "run", f"checkpoint.dir={small_fs}/ckpt")
    assert result.returncode == 2 and seconds < 60, (seconds, result.output[-3000:])
    line = one_error_line(result)
    assert "checkpoint of step 4 does not fit in" in line and "with metadata" in line and " short" in line, line
    assert "intact (latest: " in line and "step-00000002" in line, line
    assert (small_fs / "ckpt" / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in (small_fs / "ckpt").iterdir()) == ["latest", "step-00000002"]  # no .tmp left
    assert "WARNING" in result.stderr and "less than twice a checkpoint" in result.stderr


def test_an_enospc_on_one_rank_only_ends_the_job_in_seconds(tmp_path):
    fault = {"HPCTRAIN_FAULT": "rank=1,step=4,phase=write,action=enospc"}
    result, seconds = train(tmp_path / "run", env=fault)  # comm.timeout_s stays 600 s: no waiting for it
    assert result.returncode == 2 and seconds < 60, (seconds, result.output[-3000:])
    line = one_error_line(result)
    assert "writing checkpoint of step 4" in line and "rank 1: " in line, line
    assert "shard-00001.h5: No space left on device (errno 28)" in line, line
    assert "(no space left on device: " in line and "free in " in line and "with metadata)" in line, line
    assert "intact (latest: " in line and "step-00000002" in line, line
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step-00000002"]


def test_hdf5_destructor_noise_becomes_one_message(tmp_path, small_fs, capfd):
    path = small_fs / "big.h5"

    def write():
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.ones(2 << 20))  # 16 MiB into 5 MiB

    problem = write_or_error(str(path), write)
    assert problem == f"{path}: No space left on device (errno 28)", problem
    captured = capfd.readouterr()
    assert "Exception ignored" not in captured.err and "Traceback" not in captured.err, captured.err[-2000:]
