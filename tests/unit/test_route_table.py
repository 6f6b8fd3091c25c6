"""comm.intra_node=auto's routing table (hpctrain/comm/routes.py): from injected timings to the table, its
lookup by ShmRoute.takes, its summary, and the cache file (corrupt or mismatched: ignored)."""
import json

import torch

from hpctrain.comm.intra_node import RouteChoice, ShmRoute
from hpctrain.comm.routes import (CLASSES, ROUTE_OPS, SHM_MARGIN, SHM_MARGIN_OVERSUBSCRIBED, bounds, cache_key,
                                  cache_path, decide, describe, read_cache, uses_shm, write_cache)

K = len(CLASSES)


def timings(ratios: dict[str, list[float]]) -> dict[str, list[tuple[float, float]]]:
    """{op: [MPI time / shm time per class]} as (shm seconds, MPI seconds)."""
    return {op: [(1e-3, 1e-3 * r) for r in ratios[op]] for op in ROUTE_OPS}


def test_shm_takes_a_class_only_when_it_measured_faster_by_the_margin():
    table = decide(timings({"allreduce": [0.5, 0.9, 1.2, 2.0, 4.0], "reduce_scatter": [1.5] * K,
                            "allgather": [1.02, 0.8, 1.01, 0.99, 1.0]}))
    assert [r[1] for r in table["allreduce"]] == ["mpi", "mpi", "shm", "shm", "shm"]
    assert [r[1] for r in table["reduce_scatter"]] == ["shm"] * K
    assert [r[1] for r in table["allgather"]] == ["mpi"] * K  # within 3%: a tie stays on MPI
    assert table["allreduce"][3] == (16 << 20, "shm", 2.0) and table["allreduce"][-1][0] is None
    assert describe(table) == "allreduce shm > 64K, reduce_scatter shm, allgather mpi"
    assert uses_shm(table) and not uses_shm(decide(timings({op: [0.5] * K for op in ROUTE_OPS})))
    assert [r[1] for r in decide(timings({op: [1.9, 2.1, 1, 1, 1] for op in ROUTE_OPS}), 2.0)["allgather"]] == \
        ["mpi", "shm", "mpi", "mpi", "mpi"]  # an oversubscribed node's margin


def test_an_oversubscribed_node_asks_shm_for_a_larger_margin():
    assert cache_key("MPICH", 2, 2, 2, "call")["margin"] == SHM_MARGIN
    assert cache_key("MPICH", 4, 4, 2, "call")["margin"] == SHM_MARGIN_OVERSUBSCRIBED == 2.0


def test_describe_names_every_range_of_shm_classes():
    table = decide(timings({"allreduce": [2, 2, 0.5, 2, 0.5], "reduce_scatter": [0.5, 2, 2, 0.5, 0.5],
                            "allgather": [0.5] * K}))
    assert describe(table) == ("allreduce shm <= 64K and > 1M <= 16M, reduce_scatter shm > 8K <= 1M, "
                               "allgather mpi")


class Route(ShmRoute):
    """ShmRoute's lookup without a window."""

    def __init__(self, table):
        self.bounds = bounds(table) if table is not None else {}


def test_takes_looks_the_size_up_in_the_table_by_collective():
    table = decide(timings({"allreduce": [0.5, 0.5, 2, 2, 2], "reduce_scatter": [2, 0.5, 0.5, 0.5, 2],
                            "allgather": [0.5] * K}))
    route = Route(table)
    f32 = lambda nbytes: torch.zeros(nbytes // 4)  # noqa: E731
    assert not route.takes(f32(64 << 10)) and route.takes(f32((64 << 10) + 4)) and route.takes(f32(256 << 20))
    assert route.takes(f32(8 << 10), "sum", "reduce_scatter") and not route.takes(f32(16 << 20), "sum", "reduce_scatter")
    assert route.takes(f32(32 << 20), "sum", "reduce_scatter")  # the last class has no bound
    assert not any(route.takes(f32(n), "sum", "allgather") for n in (4, 1 << 20, 64 << 20))
    assert not route.takes(f32(1 << 20), "max") and not route.takes(torch.zeros(1 << 18, dtype=torch.int32))
    assert Route(None).takes(f32(4), "sum", "allgather")  # comm.intra_node=shm: no table, every size


def test_the_start_line_note_says_what_goes_through_shm():
    table = decide(timings({"allreduce": [0.5] * 4 + [2], "reduce_scatter": [0.5] * K, "allgather": [0.5] * K}))
    assert RouteChoice("shm", table, "measured in 0.7 s, cached in /x").note() == \
        " (auto, measured: allreduce shm > 16M, reduce_scatter mpi, allgather mpi)"
    none = decide(timings({op: [0.5] * K for op in ROUTE_OPS}))
    assert RouteChoice("mpi", none, "cached in /x").note() == " (auto, cached: shm slower at every size)"
    assert RouteChoice("shm").note() == ""


def test_the_cache_round_trips_and_ignores_corrupt_or_mismatched_files(tmp_path):
    key = cache_key("MPICH Version: 4.2", 2, 2, 2, "call")
    path = cache_path(str(tmp_path), key)
    table = decide(timings({op: [0.5, 2, 2, 2, 2] for op in ROUTE_OPS}))
    assert read_cache(path, key) is None  # missing
    assert write_cache(path, key, table)
    assert read_cache(path, key) == table
    assert [p.name for p in (tmp_path / "intra-node").iterdir()] == [path.rsplit("/", 1)[1]]  # no temp file left
    other = dict(key, group_size=4)
    assert cache_path(str(tmp_path), other) != path and read_cache(path, other) is None  # another key
    stored = json.loads(open(path).read())
    for bad in ("{not json", json.dumps({"key": key}), json.dumps({"key": key, "table": {"allreduce": []}}),
                json.dumps(dict(stored, table=dict(stored["table"], allgather=[[1, "nccl", 1.0]] * K))), "[]"):
        with open(path, "w") as f:
            f.write(bad)
        assert read_cache(path, key) is None, bad
    (tmp_path / "file").write_text("")
    assert not write_cache(str(tmp_path / "file" / "sub" / "x.json"), key, table)  # a file where a dir should be


def test_hpctrain_info_shows_the_table_per_op_and_size_class():
    import io

    from hpctrain.tools.info import print_routes, routes_report

    table = decide(timings({"allreduce": [0.5, 0.5, 2, 2, 2.5], "reduce_scatter": [1.5] * K, "allgather": [0.5] * K}))
    report = routes_report(RouteChoice("shm", table, "cached in /c/routes.json"))
    assert report["summary"] == "allreduce shm > 64K, reduce_scatter shm, allgather mpi"
    out = io.StringIO()
    print_routes(report, out)
    lines = out.getvalue().splitlines()
    assert "cached in /c/routes.json" in lines[0] and lines[1].split() == ["size", *ROUTE_OPS], lines
    assert lines[2].split() == ["<=", "8K", "mpi", "0.50x", "shm", "1.50x", "mpi", "0.50x"], lines
    assert lines[-1].split() == [">", "16M", "shm", "2.50x", "shm", "1.50x", "mpi", "0.50x"], lines
    assert routes_report(RouteChoice("mpi")) is None  # no table: comm.intra_node=mpi / shm, or no window
