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
    assert "allreduce of 16 bytes on group 'world'" in result.stderr
    assert "did not complete" in result.stderr
