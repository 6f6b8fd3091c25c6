"""An error every rank agrees on ends the job cleanly (MPI finalised, exit 2), so nothing is left in /dev/shm:
in a 6 MiB /dev/shm (room for three leaked segments), 4 mistyped launches (MPICH's segment is 2 MiB at 2 ranks; an
abort leaves it: the fourth would not fit) and then a valid run, which trains. A rank that fails alone still aborts the job (hpctrain/runtime/errors_exit.py)."""
import os
import shutil
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env, mpiexec, run_mpi

RUN = [sys.executable, "-m", "hpctrain.cli", "train", "--config", "configs/tiny.toml", "parallel.pp=1",
       "parallel.tp=1", "data.max_bytes=100000", "train.seq_len=32", "train.progress=false"]
TOO_BIG = ["model.vocab_size=16777216", "model.d_model=65536", "model.n_heads=64", "model.n_kv_heads=64"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private 6 MiB /dev/shm needs root and unshare(1)")
def test_four_agreed_errors_leave_nothing_in_a_small_dev_shm_and_a_valid_run_trains(tmp_path):
    launch = " ".join(["timeout -k 5 60", *mpiexec(), "-n 2", *RUN])
    # 2 config errors (before the process grid); after the grid and its shared-memory window (comm.intra_node
    # auto: the dp group of 2 ranks reduces in shared memory), 1 refused by the memory check and 1 corpus
    # too short (the window still open: MPI frees it at finalisation)
    script = f"""
mount -t tmpfs -o size=6m tmpfs /dev/shm || exit 99
for i in 1 2; do {launch} train.run_dir={tmp_path}/bad train.bogus_key=$i >/dev/null 2>&1; echo "bad $i: $?"; done
for i in 1; do {launch} train.run_dir={tmp_path}/bad {' '.join(TOO_BIG)} >/dev/null 2>&1; echo "big $i: $?"; done
for i in 3; do {launch} train.run_dir={tmp_path}/bad data.source=README.md data.max_bytes=20 >/dev/null 2>&1; echo "big $i: $?"; done
echo "left: $(ls -A /dev/shm | tr '\\n' ' ')"
{launch} train.run_dir={tmp_path}/good train.steps=3 2>&1; echo "good: $?"
echo "left after: $(ls -A /dev/shm | tr '\\n' ' ')"
"""
    proc = subprocess.run(["timeout", "-k", "5", "500", "unshare", "--mount", "sh", "-c", script], capture_output=True,
                          text=True, env=mpi_env(), cwd=str(ROOT), stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "exit 99" not in out, out[-3000:]
    codes = [line.split(": ")[1] for line in out.splitlines() if line.startswith(("bad ", "big "))]
    assert codes == ["2"] * 4, out[-3000:]  # each a clean exit 2, not an abort nor a crash
    assert "left: \n" in out + "\n" and "left after: \n" in out + "\n", out[-3000:]  # nothing in /dev/shm
    assert "good: 0" in out and "Bus error" not in out, out[-3000:]
    assert (tmp_path / "good" / "metrics.jsonl").read_text().count('"step"') >= 3 and not (tmp_path / "bad").exists()


def test_an_agreed_error_is_a_clean_exit_on_every_rank_without_an_abort(tmp_path):
    result = run_mpi(2, "hpctrain.cli", "train", "--config", "configs/tiny.toml", "train.bogus_key=1",
                     f"train.run_dir={tmp_path}", module=True, timeout=60, check=False)
    assert result.returncode == 2, result.output[-3000:]
    assert "MPI_Abort" not in result.output and "BAD TERMINATION" not in result.output, result.output[-3000:]
    assert result.stderr.count("hpctrain: error: all 2 ranks: config: train.bogus_key: unknown key") == 1


def test_an_error_on_one_rank_alone_still_aborts_the_job_in_seconds(tmp_path):
    """Rank 1 fails alone (a fault injected at start-up), rank 0 waits in the grid's first collective: the
    agreement times out (HPCTRAIN_ERROR_GRACE_S) and the job is aborted with exit 2, never hangs."""
    script = tmp_path / "alone.py"
    script.write_text(
        "import sys, time\n"
        "from mpi4py import MPI\n"
        "from hpctrain.errors import HpcTrainError\n"
        "from hpctrain.runtime.errors_exit import run_and_exit\n"
        "def main(argv):\n"
        "    if MPI.COMM_WORLD.rank == 1:\n"
        "        raise HpcTrainError('rank 1 alone')\n"
        "    MPI.COMM_WORLD.Barrier()\n"
        "sys.exit(run_and_exit(main))\n")
    result = run_mpi(2, str(script), timeout=60, check=False)
    assert result.returncode == 2, result.output[-3000:]
    assert "hpctrain: error: rank 1: rank 1 alone" in result.stderr, result.output[-3000:]
    assert "MPI_Abort" in result.output, result.output[-3000:]  # the peer in the barrier is ended by the abort


def test_a_config_file_missing_on_one_node_is_named_by_the_rank_that_cannot_read_it(tmp_path):
    """A config error is one every rank raises alike, so it is printed once, by rank 0 ("all N ranks") -- but
    only once the ranks agree they all raised it. Here rank 1 alone cannot read the file (its working directory
    lacks it, as a node without the file system would): rank 1 names it after the grace period, exit 2."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shutil.copy(ROOT / "configs" / "tiny.toml", tmp_path / "a" / "tiny.toml")
    train = [sys.executable, "-m", "hpctrain.cli", "train", "--config", "tiny.toml", f"train.run_dir={tmp_path}/run"]
    result = subprocess.run(["timeout", "-k", "5", "60", *mpiexec(), "-n", "1", "-wdir", str(tmp_path / "a"), *train,
                             ":", "-n", "1", "-wdir", str(tmp_path / "b"), *train], capture_output=True, text=True,
                            env=mpi_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert errors == ["hpctrain: error: rank 1: config: cannot read config file tiny.toml: No such file or "
                      "directory"], result.stderr[-3000:]
    assert not (tmp_path / "run").exists()
