"""The process grid on real ranks: `hpctrain info --json`, placement over emulated nodes, bad layouts."""
import json

import pytest

from mpirun import run_mpi


def info_json(nprocs, *args, **kwargs):
    result = run_mpi(nprocs, "hpctrain.cli", "info", *args, "--json", module=True, timeout=120, **kwargs)
    return json.loads(result.stdout)


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


def test_info_json_8_ranks_tp2_pp2():
    doc = info_json(8, "--tp", "2", "--pp", "2")
    assert doc["world_size"] == 8 and doc["launcher"] == "hydra" and "MPICH" in doc["mpi_library"]
    check_grid(doc, 2, 2, 2)
    # on one node: consecutive ranks form tp groups, and no group crosses nodes
    assert doc["ranks"][0]["tp_group"] == [0, 1] and doc["groups_crossing_nodes"] == []


@pytest.mark.parametrize("tp,pp", [(1, 4), (4, 1)])
def test_info_json_4_ranks(tp, pp):
    check_grid(info_json(4, "--tp", str(tp), "--pp", str(pp)), 4 // (tp * pp), pp, tp)


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


def test_info_reports_the_pipeline_schedule_and_bubble():
    doc = info_json(2, "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4")
    assert doc["pipeline"] == {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4, "bubble": 0.125}
    assert info_json(2, "--pp", "2")["pipeline"]["bubble"] == 0.5  # 1f1b, M = pp: (pp - 1) / M
    bad = run_mpi(2, "hpctrain.cli", "info", "--pp", "2", "--virtual-stages", "2", module=True, timeout=60,
                  check=False)
    assert bad.returncode != 0 and "parallel.virtual_stages=2 needs parallel.schedule=interleaved" in bad.output
