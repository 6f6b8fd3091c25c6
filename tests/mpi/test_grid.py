"""The process grid on real ranks: `hpctrain info --json`, placement over emulated nodes, bad layouts."""
import json

import pytest

from mpirun import run_many, run_mpi


def info_json(nprocs, *args, **kwargs):
    result = run_mpi(nprocs, "hpctrain.cli", "info", *args, "--json", module=True, timeout=120, **kwargs)
    return json.loads(result.stdout)


INFOS = {  # (world size, flags): `hpctrain info --json` on one node, one launch per world size
    "tp2 pp2": (8, ["--tp", "2", "--pp", "2"]),
    "tp1 pp4": (4, ["--tp", "1", "--pp", "4"]),
    "tp4 pp1": (4, ["--tp", "4", "--pp", "1"]),
    "interleaved": (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4"]),
    "1f1b": (2, ["--pp", "2"]),
}


@pytest.fixture(scope="module")
def infos():
    """{name of INFOS: its JSON document}, each world size's commands in one launch (mpirun.run_many)."""
    docs = {}
    for size in sorted({n for n, _ in INFOS.values()}):
        names = [name for name, (n, _) in INFOS.items() if n == size]
        done = run_many(size, [["info", *INFOS[name][1], "--json"] for name in names], timeout=240)
        docs.update({name: json.loads(run["stdout"]) for name, run in zip(names, done)})
    return docs


def check_grid(doc, dp, pp, tp):
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert sorted(ranks) == list(range(dp * pp * tp))
    assert doc["layout"] == {"dp": dp, "pp": pp, "cp": 1, "tp": tp}
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
        for r in ranks.values():
            group = r[f"{axis}_group"]
            assert len(group) == size and r["rank"] in group
            # group members agree on the group, differ exactly in this axis' coordinate, in order
            assert [ranks[m][axis] for m in group] == list(range(size))
            for m in group:
                assert ranks[m][f"{axis}_group"] == group
                assert all(ranks[m][a] == r[a] for a in ("dp", "pp", "tp") if a != axis)
    # every coordinate triple is used exactly once
    assert len({(r["dp"], r["pp"], r["tp"]) for r in ranks.values()}) == dp * pp * tp


def test_info_json_8_ranks_tp2_pp2(infos):
    doc = infos["tp2 pp2"]
    assert doc["world_size"] == 8 and doc["launcher"] == "hydra" and "MPICH" in doc["mpi_library"]
    check_grid(doc, 2, 2, 2)
    # on one node: consecutive ranks form tp groups, and no group crosses nodes
    assert doc["ranks"][0]["tp_group"] == [0, 1] and doc["groups_crossing_nodes"] == []


@pytest.mark.parametrize("tp,pp", [(1, 4), (4, 1)])
def test_info_json_4_ranks(infos, tp, pp):
    check_grid(infos[f"tp{tp} pp{pp}"], 4 // (tp * pp), pp, tp)


def test_round_robin_placement_keeps_tp_inside_nodes():
    """Ranks 0,2,4,6 on node A and 1,3,5,7 on node B: tp groups must still be node-local."""
    doc = info_json(8, "--tp", "2", "--pp", "2", fake_nodes=["nodeA", "nodeB"])
    check_grid(doc, 2, 2, 2)
    assert doc["nodes"] == 2 and doc["ranks_per_node"] == [4, 4]
    nodes = {r["rank"]: r["node"] for r in doc["ranks"]}
    assert [nodes[r] for r in range(8)] == [0, 1] * 4
    for r in doc["ranks"]:
        assert len({nodes[m] for m in r["tp_group"]}) == 1, r
    assert "tp" not in doc["groups_crossing_nodes"] and "dp" in doc["groups_crossing_nodes"]


def test_tp_larger_than_node_warns_or_fails_when_strict():
    doc = info_json(4, "--tp", "4", fake_nodes=["nodeA", "nodeB"])
    assert "tp" in doc["groups_crossing_nodes"] and "span nodes" in doc["warnings"][0]
    result = run_mpi(4, "hpctrain.cli", "info", "--tp", "4", "--strict-placement", module=True, timeout=60,
                     check=False, fake_nodes=["nodeA", "nodeB"])
    assert result.returncode != 0 and "span nodes" in result.stderr


# bad `hpctrain info` layouts on 4 ranks: tests/mpi/test_train_cli.py::test_bad_config_fails_clearly_on_every_rank


def test_info_reports_the_pipeline_schedule_and_bubble(infos):
    """(--virtual-stages without an interleaved schedule: tests/mpi/test_train_cli.py's bad configs)"""
    doc = infos["interleaved"]
    assert doc["pipeline"] == {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4, "bubble": 0.125}
    assert infos["1f1b"]["pipeline"]["bubble"] == 0.5  # 1f1b, M = pp: (pp - 1) / M
