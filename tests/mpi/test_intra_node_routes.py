"""comm.intra_node=auto routes each op and size by a table measured on the node and cached (hpctrain/comm/routes.py):
a cached table is obeyed (call counts, hang-report route names, exact float64 results), a corrupt cache file is
measured again without error, and every rank holds the same table (tests/mpi/scripts/check_routes.py)."""
import json

from mpirun import run_mpi


def test_auto_routes_by_the_cached_table_and_remeasures_a_corrupt_one(tmp_path):
    result = run_mpi(2, "check_routes.py", str(tmp_path), timeout=120)
    assert result.stdout.count("routes ok") == 2, result.output
    assert len(list((tmp_path / "intra-node").glob("routes-*.json"))) == 1, result.output  # no temp file left


def test_bench_comm_has_an_auto_row(tmp_path):
    out = tmp_path / "bench.json"
    result = run_mpi(2, "hpctrain.cli", "bench", "comm", "--ops", "allgather,broadcast", "--sizes", "4K",
                     "--impls", "hpctrain-auto,mpi4py", "--iters", "3", "--rounds", "1", "--json", str(out),
                     module=True, timeout=120, env={"HPCTRAIN_CACHE": str(tmp_path / "cache")})
    assert "bench comm: hpctrain-auto routes " in result.stderr and "(measured in " in result.stderr, result.output
    rows = sorted((r["op"], r["impl"]) for r in json.loads(out.read_text()))
    assert rows == [(op, impl) for op in ("allgather", "broadcast") for impl in ("hpctrain-auto", "mpi4py")], rows
