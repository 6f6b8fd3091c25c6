"""``Communicator.alltoallv`` (uneven all-to-all over rows) on real MPI ranks: results against numpy on 2 and
3 ranks, and misuse or a stopped rank ending the job with a clear message instead of a hang."""
import re

import pytest

from mpirun import run_mpi, run_self_stopping


@pytest.mark.parametrize("ranks,path", [(2, "alltoallv"), (3, "alltoallv"), (3, "by-peer")])
def test_uneven_and_empty_pieces_equal_numpy(ranks, path):
    result = run_mpi(ranks, "check_alltoallv.py", *(["--by-peer"] if path == "by-peer" else []), timeout=120)
    assert f"OK {ranks * 56} checks on {ranks} ranks" in result.stdout, result.output


def test_comm_check_names_splits_that_disagree():
    result = run_mpi(2, "alltoallv_faults.py", "check", timeout=60, check=False)
    assert result.returncode == 2 and "not detected" not in result.stdout, result.output
    for rank in (0, 1):
        assert (f"hpctrain: error: rank {rank}: comm.check: collective #2 on group 'world' (world ranks [0, 1]): "
                f"alltoallv splits disagree: world rank 0 sends 3 rows to world rank 1, which expects 2 from it "
                f"(input_splits of every rank: [[1, 3], [2, 1]], output_splits: [[1, 2], [2, 1]])") in result.stderr, \
            result.stderr


def test_splits_that_do_not_fit_the_tensors_are_named_before_any_communication():
    result = run_mpi(2, "alltoallv_faults.py", "local", timeout=60, check=False)
    assert result.returncode not in (0, 124, 137) and "not detected" not in result.stdout, result.output
    assert ("ValueError: alltoallv on group 'world' (rank 1 of 2): input_splits [1, 1] add up to 2 rows, input "
            "has 3; output_splits [1, 1] add up to 2, output has 2") in result.stderr, result.stderr


@pytest.mark.parametrize("mode", ["truncate", "truncate-by-peer"])
def test_without_comm_check_a_longer_piece_is_an_mpi_error_with_a_hint(mode):
    result = run_mpi(2, "alltoallv_faults.py", mode, timeout=60, check=False)
    assert result.returncode not in (0, 124, 137) and "rank 1: not detected" not in result.stdout, result.output
    assert "RuntimeError: alltoallv: MPI failed (" in result.stderr, result.stderr
    assert "than output_splits [2, 1] expect? (comm.check = true names" in result.stderr


def test_a_stopped_rank_in_alltoallv_is_named():
    result = run_self_stopping(2, "alltoallv_faults.py", "stop", env={"HPCTRAIN_COMM_TIMEOUT": "3"})
    report = result.stderr
    assert result.returncode not in (0, 124, 137) and "not detected" not in result.stdout, result.output
    assert report.count("hpctrain: hang report from rank 0") == 1, report
    assert "alltoallv #2 of 64 bytes on group 'world' (world ranks [0, 1]) has not completed" in report, report
    cause = re.search(r"  cause: rank 1 \(node 0 \S+, pid \d+\): (.*)", report)
    assert cause and "stopped (SIGSTOP" in cause.group(1), report
