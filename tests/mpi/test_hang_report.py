"""A rank that stops (SIGSTOP) or stalls in Python, in training or in a checkpoint save: the job ends
within comm.timeout_s + 30 s with ONE report that names that rank, its node and pid. Real ranks."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from mpirun import ROOT, mpi_env, mpiexec

TIMEOUT_S = 8
FAST = ["--config", "configs/tiny.toml", "data.max_bytes=300000", "train.seq_len=32", "train.global_batch=8",
        "model.n_layers=2", "train.progress=false", "parallel.tp=1", "parallel.pp=2", "parallel.microbatches=2",
        "train.steps=30", "checkpoint.interval=2", f"comm.timeout_s={TIMEOUT_S}"]


def run_with_fault(run_dir, fault: str, *overrides):
    """Run 4 ranks (dp=2 x pp=2) with ``HPCTRAIN_FAULT=fault``; (exit code, stderr, seconds from the
    fault to the job's end). Kills whatever is left (a stopped rank) at the end."""
    cmd = ["timeout", "-k", "5", "150"] + mpiexec() + ["-n", "4", sys.executable, "-m", "hpctrain.cli", "train",
                                                        *FAST, f"train.run_dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=mpi_env({"HPCTRAIN_FAULT": fault}), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    lines, fault_at = [], []

    def read():
        for line in proc.stderr:
            if "fault injection" in line:
                fault_at.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait(timeout=170)
    ended = time.monotonic()
    reader.join(timeout=10)
    stderr = "".join(lines)
    for pid in re.findall(r"pid (\d+)\)", stderr):  # never leave a stopped rank behind
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    assert fault_at, stderr[-3000:]
    return code, stderr, ended - fault_at[0]


@pytest.mark.parametrize("fault,overrides,where", [
    ("rank=3,step=3,phase=forward,action=stop", [], "stopped (SIGSTOP"),
    ("rank=3,step=2,phase=write,action=stop", ["checkpoint.async=false"], "stopped (SIGSTOP"),
    ("rank=3,step=2,phase=write,action=stop", ["checkpoint.async=true"], "stopped (SIGSTOP"),
    ("rank=3,step=3,phase=forward,action=sleep:300", [], "main thread at hpctrain/runtime/faults.py"),
    ("rank=3,step=0,phase=corpus,action=stop", [], "stopped (SIGSTOP"),
    ("rank=3,step=0,phase=trace,action=stop", ["train.trace=true"], "stopped (SIGSTOP"),
    ("rank=3,step=3,phase=weight,action=stop", ["parallel.schedule=zb-h1"], "stopped (SIGSTOP"),
], ids=["stopped-in-training", "stopped-in-sync-save", "stopped-in-async-save", "sleeping-in-python",
        "stopped-in-corpus-broadcast", "stopped-in-trace-sync", "stopped-in-a-deferred-weight-gradient"])
def test_the_report_names_the_missing_rank(tmp_path, fault, overrides, where):
    code, stderr, seconds = run_with_fault(tmp_path / "run", fault, *overrides)
    assert code == 3, stderr[-3000:]
    assert seconds < TIMEOUT_S + 30, (seconds, stderr[-3000:])
    assert stderr.count("hpctrain: hang report from") == 1, stderr  # one report per job
    cause = re.search(r"  cause: rank 3 \(node 0 \S+, pid \d+\): (.*)", stderr)
    assert cause and where in cause.group(1), stderr
    report = (tmp_path / "run" / "hang-report.txt").read_text()  # also on disk, whatever the pipe did
    assert "cause: rank 3" in report


def test_a_rank_stopped_inside_a_shared_memory_reduction_is_named_as_inside_it(tmp_path):
    """dp = 4 on one node: the gradient allreduce goes through the shared-memory window (comm.intra_node);
    rank 3 stops right after its 5th barrier there (the first of a chunk), the others wait at the next one.
    The report names the route, and rank 3 as inside the exchange (the window's header), not as absent."""
    code, stderr, seconds = run_with_fault(tmp_path / "run", "rank=3,step=5,phase=shm,action=stop", "parallel.pp=1",
                                           "comm.intra_node=shm")
    assert code == 3 and seconds < TIMEOUT_S + 30, (code, seconds, stderr[-3000:])
    assert stderr.count("hpctrain: hang report from") == 1, stderr
    assert re.search(r"allreduce #\d+ \(shared memory\) of \d+ bytes on group 'dp' \(world ranks \[0, 1, 2, 3\]\) "
                     r"has not completed", stderr), stderr
    assert re.search(r"  rank 3 \(node 0 \S+, pid \d+\) entered allreduce #\d+ \(shared memory\) on group dp "
                     r"\[0, 1, 2, 3\] and is inside the shared-memory exchange, but has not arrived at the barrier "
                     r"this rank waits in: it did not answer in \d+ s: stopped \(SIGSTOP", stderr), stderr
    assert "rank 3 (node" in stderr and "has not entered" not in stderr, stderr
    assert re.search(r"  cause: rank 3 \(node 0 \S+, pid \d+\): .*stopped \(SIGSTOP", stderr), stderr


def test_a_rank_stopped_before_a_zero3_parameter_gather_is_named_and_its_peer_waits_in_the_gather(tmp_path):
    """ZeRO-3 (dp=2 x pp=2): rank 3 stops as step 3 begins; its dp peer waits in the all-gather of a unit's
    parameters (with the next unit's prefetched gather posted behind it). The report names rank 3 as the
    cause and shows where the peer waits."""
    code, stderr, seconds = run_with_fault(tmp_path / "run", "rank=3,step=3,phase=forward,action=stop",
                                           "parallel.zero=3", "checkpoint.interval=100")
    assert code == 3 and seconds < TIMEOUT_S + 30, (code, seconds, stderr[-3000:])
    assert stderr.count("hpctrain: hang report from") == 1, stderr
    assert re.search(r"  cause: rank 3 \(node 0 \S+, pid \d+\): .*stopped \(SIGSTOP", stderr), stderr
    assert re.search(r"waits in allgather #\d+ of \d+ bytes on group 'dp'", stderr), stderr
    assert "zero/gather.py" in stderr and "_before_forward" in stderr, stderr
