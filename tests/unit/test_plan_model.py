"""The performance and memory model (hpctrain/plan) and `hpctrain plan`, without MPI."""
import json
import math
import subprocess
import sys

import pytest

from hpctrain.config import ModelConfig, load_config, resolve_model
from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Candidate, Options, step_time
from hpctrain.plan.devices import PlanError, device_preset
from hpctrain.plan.machine import (GroupPlacement, LinkProfile, Link, Machine, device_from_profile,
                                   links_from_bandwidth, load_profile, parse_profile, wire_bytes)
from hpctrain.plan.memory import memory
from hpctrain.plan.planner import SearchSpace, plan, predict
from hpctrain.sweep.predict import predict_run

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def a100_nodes(nodes, per_node=8):
    return Machine(device_preset("a100"), links_from_bandwidth(2400, 200), nodes, per_node)


def model(name="gpt-1.7b"):
    return resolve_model(ModelConfig(preset=name, vocab_size=0))


def test_groups_are_placed_as_the_grid_places_them():
    m = a100_nodes(4)  # 32 ranks, 8 per node; grid order: tp fastest, then pp, then dp
    assert m.placement(1, 8) == GroupPlacement("intra", 8)  # tp=8 fills a node
    assert m.placement(1, 16).level == "inter"  # tp=16 spans two nodes
    assert m.placement(8, 4) == GroupPlacement("inter", 1)  # pp over 4 nodes, one member per node
    assert m.placement(2, 4) == GroupPlacement("intra", 4)  # tp=2 x pp=4 inside a node
    assert m.placement(4, 8) == GroupPlacement("inter", 2)  # stride 4: two members on each node
    assert m.placement(1, 1) == GroupPlacement("intra", 1)


def test_wire_bytes_and_the_inter_node_link_shared_by_a_nodes_members():
    assert wire_bytes("allreduce", 100, 4) == 150 and wire_bytes("allgather", 100, 4) == 75
    assert wire_bytes("sendrecv", 100, 2) == 100
    m = a100_nodes(2)
    nbytes = 1e9
    one_nic = m.collective_s("allreduce", nbytes, 2, GroupPlacement("inter", 1))
    assert one_nic == pytest.approx(1e-5 + nbytes * 8 / 200e9, rel=1e-9)  # 2(p-1)/p = 1 at p = 2
    spread = m.collective_s("allreduce", nbytes, 16, GroupPlacement("inter", 8))
    assert spread < one_nic  # eight NICs carry the group's crossings
    intra = m.collective_s("allreduce", nbytes, 8, GroupPlacement("intra", 8))
    assert intra < spread and m.collective_s("allreduce", 0, 8, GroupPlacement("intra", 8)) == 0


def test_profile_errors_name_the_problem(tmp_path):
    with pytest.raises(PlanError, match="missing key 'levels'"):
        parse_profile({"collectives": {}})
    with pytest.raises(PlanError, match="unknown level 'rack'"):
        parse_profile({"levels": {"rack": {"alpha_s": 1e-6, "beta_s_per_byte": 1e-9}}})
    with pytest.raises(PlanError, match=r"levels.intra.beta_s_per_byte: expected a finite number"):
        parse_profile({"levels": {"intra": {"alpha_s": 1e-6, "beta_s_per_byte": "fast"}}})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_profile(str(bad))
    with pytest.raises(PlanError, match="cannot read link profile"):
        load_profile(str(tmp_path / "missing.json"))
    one_node = LinkProfile({"intra": Link(1e-6, 1e-9)}, source="p.json")
    with pytest.raises(PlanError, match="2 nodes need an inter-node link"):
        Machine(device_preset("cpu"), one_node, 2, 2)
    with pytest.raises(PlanError, match="unknown device 'tpu'"):
        device_preset("tpu")


def test_a_cpu_profile_is_rescaled_to_the_ranks_that_share_the_cores():
    measured = LinkProfile({"intra": Link(1e-5, 1e-9)}, device={
        "name": "cpu", "peak_tflops": 0.05, "efficiency": 0.8, "hbm_gbps": 10.0, "optimizer_s_per_param": 1e-8,
        "ranks_per_node": 4, "cores_per_node": 2})
    four = device_from_profile(measured, ranks_per_node=4)
    two = device_from_profile(measured, ranks_per_node=2)
    one = device_from_profile(measured, ranks_per_node=1)
    assert four.peak("float32") == pytest.approx(0.05) and four.efficiency == 0.8
    assert two.peak("float32") == pytest.approx(0.10) and one.peak("float32") == pytest.approx(0.10)
    assert two.optimizer_s_per_param == pytest.approx(5e-9) and two.hbm_gbps == pytest.approx(20.0)


def test_memory_zero1_recompute_and_megatrons_18_bytes_per_parameter():
    m = model("gpt-7.5b")
    opts = Options(dtype="bfloat16", reserve_gib=0.0)
    plain = memory(m, Layout(8, 8, 1, 1, 1, 8, 2048), False, opts)
    n = plain.params_gib * 2**30 / 2  # parameters on the rank (bf16)
    assert (plain.params_gib + plain.grads_gib + plain.optimizer_gib) * 2**30 / n == pytest.approx(18)
    zero = memory(m, Layout(8, 8, 1, 1, 1, 8, 2048, zero=1), False, opts)
    assert zero.optimizer_gib == pytest.approx(plain.optimizer_gib / 8)
    recomputed = memory(m, Layout(8, 8, 1, 1, 1, 8, 2048), True, opts)
    assert recomputed.activations_gib < plain.activations_gib / 4
    tp = memory(m, Layout(8, 1, 1, 8, 1, 8, 2048), False, opts)
    assert tp.params_gib < plain.params_gib / 6  # everything but the norms is split over tp


def test_the_bubble_of_equal_stages_is_pp_minus_1_over_m():
    m = resolve_model(ModelConfig(preset="custom", vocab_size=128, d_model=1024, n_layers=64, n_heads=8,
                                  n_kv_heads=8, d_ff=4096, max_seq_len=512))
    machine = Machine(device_preset("a100"), links_from_bandwidth(1e6, None), 1, 8)  # near-free links
    for pp, mb in ((4, 8), (8, 32)):
        t = step_time(m, Candidate(Layout(pp, 1, pp, 1, mb, mb, 512)), machine)
        ideal = t.compute_s + t.tp_comm_s + t.pp_comm_s
        assert t.bubble_s / ideal == pytest.approx((pp - 1) / mb, rel=0.05)
    gpipe_like = step_time(m, Candidate(Layout(1, 1, 1, 1, 1, 1, 512)), machine)
    assert gpipe_like.bubble_s == 0 and gpipe_like.dp_comm_s == 0


def test_slower_links_and_compression_move_the_dp_time():
    m = model()
    lay = Layout(16, 16, 1, 1, 1, 16, 2048)
    fast = step_time(m, Candidate(lay), Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 2, 8))
    slow = step_time(m, Candidate(lay), Machine(device_preset("a100"), links_from_bandwidth(2400, 1), 2, 8))
    squeezed = step_time(m, Candidate(lay), Machine(device_preset("a100"), links_from_bandwidth(2400, 1), 2, 8),
                         Options(dp_compression=0.25))
    assert slow.dp_comm_s > 10 * fast.dp_comm_s and squeezed.dp_comm_s < slow.dp_comm_s / 2
    assert slow.compute_s == fast.compute_s


def test_planner_ranks_feasible_layouts_and_says_why_others_fail():
    result = plan(model("gpt-18b"), a100_nodes(4), 256, 2048,
                  space=SearchSpace(zero=(0,), sequence_parallel=(False,), recompute=(True,), tp_across_nodes=True))
    speeds = [p.tokens_per_s for p in result.plans]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 3
    assert all(p.memory.total_gib <= 80 for p in result.plans)
    reasons = [i.reason for i in result.infeasible]
    assert any(r.startswith("memory: needs") for r in reasons)  # tp=1 cannot hold 18B parameters
    assert any("not divisible by parallel.tp" in r for r in reasons)  # 48 heads over tp=32
    best = result.plans[0].to_dict()
    for key in ("dp", "tp", "pp", "microbatches", "predicted_step_s", "predicted_tokens_per_s",
                "predicted_tflops_per_device", "memory_gib_per_device"):
        assert key in best
    assert best["dp"] * best["tp"] * best["pp"] == 32


def test_predict_rejects_an_invalid_layout_with_the_layout_rule():
    with pytest.raises(Exception, match="not divisible by parallel.tp=5"):
        predict(model(), Layout(5, 1, 1, 5, 1, 8, 2048), a100_nodes(1, 5))


def test_sweep_rows_get_a_prediction_and_invalid_ones_none():
    cfg = load_config(str(ROOT / "configs" / "tiny.toml"))
    row = {"ranks": 4, "dp": 1, "tp": 2, "pp": 2, "microbatches": 4, "global_batch": 8}
    got = predict_run(cfg, row)
    assert got["predicted_step_s"] > 0 and got["predicted_bubble_s"] > 0 and got["predicted_comm_s"] > 0
    assert got["predicted_tokens_per_s"] == pytest.approx(8 * cfg.train.seq_len / got["predicted_step_s"])
    assert predict_run(cfg, {**row, "microbatches": 3}) is None


def hpctrain_plan(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)


def test_plan_cli_json_and_table():
    out = hpctrain_plan("--model", "gpt-145b", "--nodes", "192", "--gpus-per-node", "8", "--device", "a100",
                        "--inter-gbps", "200", "--global-batch", "2304", "--top", "3", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    plans = doc["plans"]
    assert len(plans) == 3 and doc["device"] == "a100"
    assert plans[0]["predicted_tokens_per_s"] >= plans[1]["predicted_tokens_per_s"]
    # 145B on 1536 GPUs: tp inside a node, and the parameters sharded by ZeRO-3 or split over pipeline stages
    assert plans[0]["placement"]["tp"] == "intra" and (plans[0]["zero"] == 3 or plans[0]["pp"] > 1)
    assert all(math.isfinite(p["predicted_tflops_per_device"]) for p in plans)
    table = hpctrain_plan("--model", "tiny", "--nodes", "1", "--gpus-per-node", "4", "--device", "cpu",
                          "--global-batch", "8", "--seq-len", "64", "--top", "2")
    assert table.returncode == 0, table.stderr
    assert "where the time goes" in table.stdout and "dp=" in table.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-9t", "--nodes", "1", "--gpus-per-node", "8"], "neither a preset"),
    (["--model", "tiny", "--nodes", "2", "--gpus-per-node", "8"], "give --inter-gbps"),
    (["--model", "tiny", "--nodes", "1", "--gpus-per-node", "8", "--device", "tpu"], "unknown device 'tpu'"),
    (["--model", "tiny", "--nodes", "1", "--gpus-per-node", "4", "--profile", "/nonexistent.json"],
     "cannot read link profile"),
    (["--model", "gpt-1t", "--nodes", "1", "--gpus-per-node", "8", "--global-batch", "8"], "no layout fits"),
    (["--model", "tiny", "--nodes", "1", "--gpus-per-node", "4", "--device", "cpu", "--tp", "3"],
     "--tp 3: must be a positive divisor of the 4 devices"),
    (["--model", "tiny", "--nodes", "1", "--gpus-per-node", "4", "--device", "cpu", "--virtual-stages", "2",
      "--schedule", "gpipe"], "1 with the gpipe schedule"),
])
def test_plan_cli_bad_input_is_a_clear_error(args, message):
    out = hpctrain_plan(*args)
    assert out.returncode != 0 and message in out.stdout + out.stderr, out.stdout + out.stderr


def test_plan_evaluates_a_given_layout_from_flags_or_a_toml(tmp_path):
    out = hpctrain_plan("--model", "gpt-18b", "--nodes", "32", "--gpus-per-node", "8", "--device", "a100",
                        "--inter-gbps", "200", "--tp", "8", "--pp", "2", "--micro-batch", "1", "--global-batch", "1024",
                        "--virtual-stages", "2", "--zero", "0", "--sequence-parallel", "--recompute", "off", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert {(p["dp"], p["tp"], p["pp"], p["microbatches"], p["zero"], p["sequence_parallel"], p["recompute"])
            for p in plans} == {(16, 8, 2, 64, 0, True, "off")}
    config = tmp_path / "given.toml"  # [parallel] keys the file sets are given; no train.dtype: bfloat16
    config.write_text('[model]\npreset = "tiny"\n[parallel]\ntp = 2\npp = 2\nmicrobatches = 4\n'
                      '[train]\nglobal_batch = 8\nseq_len = 64\n')
    out = hpctrain_plan("--model", str(config), "--nodes", "1", "--gpus-per-node", "4", "--device", "cpu", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["dtype"] == "bfloat16"
    assert {(p["dp"], p["tp"], p["pp"], p["microbatches"]) for p in doc["plans"]} == {(1, 2, 2, 4)}


def test_fewer_micro_batches_than_stages_is_a_warning():
    out = hpctrain_plan("--model", "gpt-18b", "--nodes", "4", "--gpus-per-node", "8", "--device", "a100",
                        "--inter-gbps", "200", "--tp", "8", "--pp", "4", "--micro-batch", "4", "--global-batch", "8")
    assert out.returncode == 0, out.stderr
    assert "WARNING: 2 micro-batch(es) < pp=4: the pipeline bubble is" in out.stdout, out.stdout
