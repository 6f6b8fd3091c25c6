"""comm.intra_node in training: the dp reduction through shared memory trains like one process (float64,
1e-10, plain and ZeRO-1); a dp group with one rank on each (emulated) node has nothing to reduce in shared
memory: `shm` is refused before any model exists and `auto` falls back to MPI with one line (several ranks
per node: the hierarchical route, tests/integration/test_hierarchical.py)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env, mpiexec, run_mpi, run_self_stopping

F64 = ["--param-rtol", "1e-10", "--rtol", "1e-10"]
SPANS = "the group spans nodes with one of its ranks on each: there is nothing to reduce in shared memory"


@pytest.mark.parametrize("progress", ["call", "thread"])
def test_dp_reduction_in_shared_memory_trains_like_one_process(progress):
    result = run_mpi(2, "check_fidelity.py", "--layouts", "2,1,1", "--variants", "1f1b/zero1", *F64,
                     "comm.intra_node=shm", f"comm.shm_progress={progress}", timeout=200)
    assert "FIDELITY OK 2" in result.stdout, result.output
    assert result.stdout.count("dp-reduction=shm") == 2, result.output  # the shm route really carried it


def train_on_two_nodes(tmp_path, choice):
    return run_mpi(2, "hpctrain.cli", "train", "--config", "configs/tiny.toml", "data.max_bytes=300000",
                   "train.seq_len=32", "train.global_batch=4", "model.n_layers=1", "train.steps=1",
                   "train.progress=false", "parallel.dp=2", "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1",
                   f"train.run_dir={tmp_path}", f"comm.intra_node={choice}", module=True, timeout=200,
                   check=False, fake_nodes=["nA", "nB"])


def test_shm_across_nodes_is_refused_before_training(tmp_path):
    result = train_on_two_nodes(tmp_path, "shm")
    assert result.returncode not in (0, 124, 137), result.output
    line = [s for s in result.output.splitlines() if "comm.intra_node=shm:" in s]
    assert len(line) == 1 and SPANS in line[0] and "comm.intra_node=auto" in line[0], result.output
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any step


def test_auto_across_nodes_falls_back_to_mpi_with_one_line(tmp_path):
    result = train_on_two_nodes(tmp_path, "auto")
    assert result.returncode == 0, result.output
    lines = [s for s in result.output.splitlines() if "comm.intra_node=auto" in s]
    assert lines == [f"hpctrain: comm.intra_node=auto: the dp reduction uses MPI: shared-memory collectives on "
                     f"group 'dp' (world ranks [0, 1]): the group spans nodes; shm needs all its ranks on one node "
                     f"(comm.intra_node=shm reduces such a group hierarchically; auto keeps MPI across nodes, where "
                     f"that measured no faster)"], result.output  # auto does not try the hierarchical path
    assert (tmp_path / "metrics.jsonl").exists()


def test_bench_train_has_a_shm_dp_row(tmp_path):
    out = tmp_path / "bench.json"
    run_mpi(2, str(ROOT / "benchmarks" / "bench_train.py"), "--impls", "hpctrain-dp,hpctrain-dp-shm", "--steps", "2",
            "--warmup", "1", "--rounds", "1", "--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
            "--global-batch", "8", "--max-bytes", "300000", "--json", str(out), timeout=180)
    records = json.loads(out.read_text())
    assert [r["impl"] for r in records] == ["hpctrain", "hpctrain-shm"], records
    assert records[0]["final_loss"] == records[1]["final_loss"]  # float32: rank-order sums, 2 ranks: identical


@pytest.mark.parametrize("progress", ["call", "thread"])
def test_a_stopped_rank_in_a_routed_shm_reduction_is_named(progress):
    result = run_self_stopping(2, "check_shm.py", "stop-route", progress, env={"HPCTRAIN_COMM_TIMEOUT": "3"})
    report = result.stderr
    assert result.returncode not in (0, 124, 137) and "not detected" not in result.stdout, result.output
    assert "allreduce #4 (shared memory) of 4000 bytes on group 'world' (world ranks [0, 1]) has not completed" \
        in report, report
    cause = re.search(r"  cause: rank 1 \(node 0 \S+, pid \d+\): (.*)", report)
    assert cause and "stopped (SIGSTOP" in cause.group(1), report


# A node whose /dev/shm cannot hold the window: the job runs in a private mount namespace whose /dev/shm is
# a tmpfs big enough for MPICH's own start-up segment (2 MiB at 2 ranks) but not for hpctrain's window as
# well (2 x 512 KiB + 64 B). MPICH's Allocate_shared still succeeds there (a sparse file); the pages cannot be
# backed, which hpctrain checks before touching them (hpctrain/comm/shm_memory.py).
SMALL_SHM = "2560k"
NO_ROOM = "bytes per rank (/dev/shm cannot hold it (MADV_POPULATE_WRITE: Bad address; "


def train_in_small_shm(tmp_path, choice):
    mount = f"mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm && exec \"$@\""
    cmd = ["timeout", "-k", "5", "200", "unshare", "--mount", "sh", "-c", mount, "sh", *mpiexec(), "-n", "2",
           sys.executable, "-m", "hpctrain.cli", "train", "--config", "configs/tiny.toml", "data.max_bytes=300000",
           "train.seq_len=32", "train.global_batch=4", "model.n_layers=1", "train.steps=2", "train.progress=false",
           "parallel.dp=2", "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", f"train.run_dir={tmp_path}",
           f"comm.intra_node={choice}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=str(ROOT), stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


needs_mount_namespace = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                           reason="a private /dev/shm needs root and unshare(1)")


@needs_mount_namespace
def test_shm_where_dev_shm_cannot_hold_the_window_is_refused_on_every_rank(tmp_path):
    code, output = train_in_small_shm(tmp_path, "shm")
    assert code not in (0, 124, 137), output  # an error exit, not a hang (and no SIGBUS: see the line)
    lines = [s for s in output.splitlines() if "comm.intra_node=shm:" in s]
    assert len(lines) == 1 and NO_ROOM in lines[0] and "comm.intra_node=auto" in lines[0], output
    assert "Bus error" not in output and "SIGBUS" not in output, output  # what it was before the check
    assert lines[0].startswith("hpctrain: error: all 2 ranks: comm.intra_node=shm: "), output  # raised on each
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any step


@needs_mount_namespace
def test_auto_where_dev_shm_cannot_hold_the_window_falls_back_with_one_line(tmp_path):
    code, output = train_in_small_shm(tmp_path, "auto")
    assert code == 0, output
    lines = [s for s in output.splitlines() if "comm.intra_node=auto" in s]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: comm.intra_node=auto: the dp reduction uses MPI: "
                                                   "shared-memory collectives on group 'dp': cannot allocate"), output
    assert NO_ROOM in lines[0], output
    assert "dp reduction mpi" in output and (tmp_path / "metrics.jsonl").exists(), output
