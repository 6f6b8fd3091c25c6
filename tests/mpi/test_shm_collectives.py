"""Node-local shared-memory collectives (hpctrain/comm/shm.py) on real ranks: equal to MPI's, exact,
bit-identical on every rank; a stopped rank inside one is named by the watchdog's hang report."""
import json
import re

import pytest

from mpirun import run_mpi, run_self_stopping


@pytest.mark.parametrize("ranks,barrier", [(2, "flags"), (4, "flags"), (3, "mpi")])
def test_shm_collectives_match_mpi(ranks, barrier):
    result = run_mpi(ranks, "check_shm.py", "check", barrier, timeout=90)
    assert f"shm collectives ok on {ranks} ranks ({barrier} barrier)" in result.stdout, result.output


@pytest.mark.parametrize("mode", ["stop", "stop-inside"])
def test_a_stopped_rank_in_a_shm_collective_is_named(mode):
    result = run_self_stopping(2, "check_shm.py", mode, env={"HPCTRAIN_COMM_TIMEOUT": "3"})
    report = result.stderr
    assert result.returncode not in (0, 124, 137), result.output
    assert "not detected" not in result.stdout
    assert report.count("hpctrain: hang report from rank 0") == 1, report
    assert "shm allreduce #3 of 4000 bytes on group 'world' (world ranks [0, 1]) has not completed" in report, report
    cause = re.search(r"  cause: rank 1 \(node 0 \S+, pid \d+\): (.*)", report)
    assert cause and "stopped (SIGSTOP" in cause.group(1), report


def test_bench_comm_has_a_shm_row(tmp_path):
    out = tmp_path / "bench.json"
    run_mpi(2, "hpctrain.cli", "bench", "comm", "--ops", "allreduce,reduce_scatter,allgather,broadcast",
            "--sizes", "4K", "--impls", "hpctrain-shm,mpi4py", "--iters", "3", "--rounds", "1", "--json", str(out),
            module=True, timeout=120)
    records = json.loads(out.read_text())
    assert sorted((r["op"], r["impl"]) for r in records) == sorted(
        [(op, impl) for op in ("allreduce", "reduce_scatter", "allgather") for impl in ("hpctrain-shm", "mpi4py")]
        + [("broadcast", "mpi4py")])  # no shm broadcast: no row
    assert all(r["time_us"] > 0 and r["ratio_vs_mpi4py"] > 0 for r in records)


def test_a_group_across_nodes_is_refused():
    result = run_mpi(2, "check_shm.py", "refuse", timeout=90, fake_nodes=["nA", "nB"])
    for rank in (0, 1):
        assert (f"rank {rank}: refused: shared-memory collectives on group 'world' (world ranks [0, 1]): the group "
                f"spans nodes; shm needs all its ranks on one node") in result.stdout, result.output
