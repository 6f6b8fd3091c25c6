"""Collectives on real MPI ranks: 1, 2, 4, 8 ranks, every axis of a (2,2,2) grid, all dtypes."""
import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("nprocs,tp,pp", [(1, 1, 1), (2, 2, 1), (4, 2, 1), (8, 2, 2)])
def test_every_collective_every_dtype(nprocs, tp, pp):
    result = run_mpi(nprocs, "check_collectives.py", "--tp", str(tp), "--pp", str(pp), timeout=150)
    assert f"OK" in result.stdout and f"on {nprocs} ranks" in result.stdout


def test_collectives_across_two_emulated_nodes_round_robin():
    """Ranks placed round-robin on two emulated hosts: traffic crosses the MPI netmod, not shared memory."""
    result = run_mpi(4, "check_collectives.py", "--tp", "2", timeout=150, fake_nodes=["nodeA", "nodeB"])
    assert "on 4 ranks" in result.stdout


def test_watchdog_aborts_a_stalled_collective_with_a_message():
    """Rank 1 skips an allreduce: the others must not hang; the job ends naming the op and group."""
    result = run_mpi(2, "stall_collective.py", timeout=60, check=False, env={"HPCTRAIN_COMM_TIMEOUT": "3"})
    assert result.returncode != 0
    report = result.stderr
    assert report.count("hpctrain: hang report from rank 0") == 1, report
    assert "allreduce #1 of 16 bytes on group 'world' (world ranks [0, 1]) has not completed" in report
    assert "rank 1 (node 0" in report and "has not entered allreduce #1 on group world [0, 1]" in report
    assert "stall_collective.py:14 in <module>" in report  # where the missing rank is instead (time.sleep)


def test_comm_check_names_a_mismatched_collective():
    result = run_mpi(2, "mismatch_collective.py", timeout=60, check=False)
    assert result.returncode == 2 and "not detected" not in result.stdout, result.output
    for rank in (0, 1):
        assert (f"hpctrain: error: rank {rank}: comm.check: collective #2 on group 'world' (world ranks [0, 1]): "
                f"world rank 0 calls allreduce ('sum', torch.float32, 4), but world rank 1 calls allreduce "
                f"('sum', torch.float32, 8)") in result.stderr, result.stderr
