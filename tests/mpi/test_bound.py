"""Blocking host collectives bound to their tensors (hpctrain/comm/bound.py): the same results as MPI on
real ranks, never a stale buffer, numbered and counted like any call, and a stopped rank inside one is named."""
import re

import pytest

from mpirun import run_mpi, run_self_stopping


@pytest.mark.parametrize("ranks", [2, 3])
def test_bound_calls_match_numpy_and_never_serve_a_moved_or_changed_tensor(ranks):
    result = run_mpi(ranks, "check_bound.py", "check", timeout=90)
    assert f"bound collectives ok on {ranks} ranks" in result.stdout, result.output


def test_a_stopped_rank_in_a_bound_allgather_is_named():
    result = run_self_stopping(2, "check_bound.py", "stop", env={"HPCTRAIN_COMM_TIMEOUT": "3"})
    report = result.stderr
    assert result.returncode not in (0, 124, 137), result.output
    assert "not detected" not in result.stdout
    assert report.count("hpctrain: hang report from rank 0") == 1, report
    assert re.search(r"allgather #\d+ of 32 bytes on group 'world' \(world ranks \[0, 1\]\) has not completed",
                     report), report
    cause = re.search(r"  cause: rank 1 \(node 0 \S+, pid \d+\): (.*)", report)
    assert cause and "stopped (SIGSTOP" in cause.group(1), report
