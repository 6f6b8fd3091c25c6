"""The small-message path (hpctrain/comm/persistent.py): persistent requests on real ranks give the
ordinary calls' results, are numbered, counted and freed, and a stopped rank inside one is named."""
import json
import re

import pytest

from mpirun import run_mpi, run_self_stopping


@pytest.mark.parametrize("ranks", [2, 3])
def test_recurring_collectives_match_the_ordinary_calls(ranks):
    result = run_mpi(ranks, "check_persistent.py", "check", timeout=90)
    assert f"persistent collectives ok on {ranks} ranks" in result.stdout, result.output
    assert "freeing inactive persistent request" not in result.output  # every request freed before finalize


def test_a_stopped_rank_in_a_recurring_collective_is_named():
    result = run_self_stopping(2, "check_persistent.py", "stop", env={"HPCTRAIN_COMM_TIMEOUT": "3"})
    report = result.stderr
    assert result.returncode not in (0, 124, 137), result.output
    assert "not detected" not in result.stdout
    assert report.count("hpctrain: hang report from rank 0") == 1, report
    assert re.search(r"allreduce #\d+ of 8 bytes on group 'world' \(world ranks \[0, 1\]\) has not completed",
                     report), report
    cause = re.search(r"  cause: rank 1 \(node 0 \S+, pid \d+\): (.*)", report)
    assert cause and "stopped (SIGSTOP" in cause.group(1), report


def test_bench_comm_has_a_persistent_row(tmp_path):
    out = tmp_path / "bench.json"
    run_mpi(2, "hpctrain.cli", "bench", "comm", "--ops", "allreduce,broadcast,allgather", "--sizes", "1K",
            "--impls", "hpctrain,hpctrain-persistent,mpi4py", "--iters", "20", "--rounds", "1", "--json", str(out),
            module=True, timeout=120)
    records = json.loads(out.read_text())
    rows = sorted((r["op"], r["impl"]) for r in records)
    assert rows == sorted([(op, impl) for op in ("allreduce", "broadcast") for impl in
                           ("hpctrain", "hpctrain-persistent", "mpi4py")] + [("allgather", "hpctrain"),
                                                                             ("allgather", "mpi4py")]), rows
    assert all(r["time_us"] > 0 for r in records)
