"""The planner with a mixture of experts (hpctrain/plan; issue #41): experts over parallel.ep, their ZeRO group,
the all-to-all, active-parameter FLOPs, ep in the search and in `hpctrain plan`. No torch, no MPI."""
import dataclasses
import json
import subprocess
import sys

import pytest

from hpctrain.config import ModelConfig, resolve_model
from hpctrain.config.arithmetic import flops_per_token, partition_layers
from hpctrain.config.layout import Layout
from hpctrain.config.moe_keys import MoeConfig, resolve_moe
from hpctrain.plan.cost import Candidate, Options, ep_placements, step_time
from hpctrain.plan.devices import PlanError, device_preset
from hpctrain.plan.machine import GroupPlacement, Machine, links_from_bandwidth
from hpctrain.plan.memory import memory
from hpctrain.plan.planner import SearchSpace, plan, predict
from hpctrain.plan.stages import moe_activation_bytes, stages

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
GIB = 2**30


def mixtral():
    m = resolve_model(ModelConfig(preset="mixtral-8x7b"))
    return m, resolve_moe(MoeConfig(), m)


def h100_nodes(nodes, per_node=8):
    return Machine(device_preset("h100"), links_from_bandwidth(3600, 400), nodes, per_node)


def test_experts_are_split_over_ep_and_their_optimizer_state_sharded_over_dp_cp_over_ep():
    m, moe = mixtral()
    opts = Options(dtype="bfloat16", reserve_gib=0.0)
    # by hand, one rank (tp 1) of dp = 8: per block attention 2 x 4096^2 + 2 x 4096 x 1024, router 8 x 4096, norms
    # 2 x 4096, and 8 / ep experts of 3 x 4096 x 14336; the embedding and head (32000 rows: no padding), final norm
    dense = 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 8 * 4096 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    expert = 3 * 4096 * 14336
    for ep in (1, 2, 8):
        experts = 32 * (8 // ep) * expert
        mem = memory(m, Layout(8, 8, 1, 1, 1, 8, 4096, zero=1, ep_size=ep), "full", opts, moe)
        assert mem.params_gib * GIB == pytest.approx((dense + experts) * 2)
        # ZeRO-1: the dense part over dp x cp = 8, the experts over the 8 / ep ranks holding the same ones
        assert mem.optimizer_gib * GIB == pytest.approx((dense / 8 + experts / (8 // ep)) * 12)
        assert mem.grads_gib * GIB == pytest.approx((dense + experts) * 4 + (dense / 8 + experts / (8 // ep)) * 4)
    # without ZeRO the optimizer state is the rank's parameters', ep or not
    plain = memory(m, Layout(8, 8, 1, 1, 1, 8, 4096, ep_size=8), "full", opts, moe)
    assert plain.optimizer_gib * GIB == pytest.approx((dense + 32 * expert) * 12)
    # ZeRO-3: the parameters too (the gathered units come on top)
    z3 = memory(m, Layout(8, 8, 1, 1, 1, 8, 4096, zero=3, ep_size=4), "full", opts, moe)
    assert z3.params_gib * GIB > (dense / 8 + 32 * 2 * expert / 2) * 2


def test_an_moe_block_keeps_its_routed_copies_activations():
    m, moe = mixtral()
    s, b, h, f = 4096, 1, 4096, 14336
    # tp 1, 16-bit: 2 routed copies of (input 2h + gate, up, product 6f) in place of the dense SwiGLU's 6 f
    # (gate, up, product), plus the router's float32 logits and probabilities (8 E bytes) per token
    assert moe_activation_bytes(m, moe, b, s, 1, False, 2) == s * b * (2 * (2 * h + 6 * f) - 6 * f + 8 * 8)
    dense = memory(m, Layout(8, 8, 1, 1, 1, 8, 4096, ep_size=8), "off", Options(reserve_gib=0.0))
    routed = memory(m, Layout(8, 8, 1, 1, 1, 8, 4096, ep_size=8), "off", Options(reserve_gib=0.0), moe)
    assert routed.activations_gib * GIB == pytest.approx(dense.activations_gib * GIB
                                                         + 32 * moe_activation_bytes(m, moe, b, s, 1, False, 2))


def test_the_all_to_all_is_four_of_tokens_top_k_d_model_per_moe_layer_on_the_ep_links():
    m = resolve_model(ModelConfig(preset="custom", vocab_size=1024, d_model=512, n_layers=4, n_heads=8,
                                  n_kv_heads=8, d_ff=1024, max_seq_len=512))
    moe = resolve_moe(MoeConfig(num_experts=8, top_k=2, layers=[1, 3]), m)
    machine = Machine(device_preset("h100"), links_from_bandwidth(800, None), 1, 8)
    alpha, beta = 5e-6, 8 / 800e9  # the intra-node link: 5 us, 800 Gbit/s
    lay = Layout(8, 8, 1, 1, 2, 16, 512, ep_size=4)  # 2 micro-batches of 1 sequence per replica
    rows = 1 * 512 * 2 * 512 * 2  # tokens x top_k x d_model x bf16 bytes
    one = alpha + beta * 3 / 4 * rows  # an all-to-all on 4 ranks puts (ep - 1) / ep of it on the wire
    counts = alpha + beta * 3 / 4 * 8 * 8  # the per-expert counts (int64), once per forward
    t = step_time(m, Candidate(lay), machine, moe=moe)
    assert t.ep_comm_s == pytest.approx(2 * 2 * (4 * one + counts))  # 2 micro-batches x 2 MoE layers
    again = step_time(m, Candidate(lay, "full"), machine, moe=moe)  # the recomputed forward: 2 more, counts again
    assert again.ep_comm_s == pytest.approx(2 * 2 * (6 * one + 2 * counts))
    assert step_time(m, Candidate(Layout(8, 8, 1, 1, 2, 16, 512)), machine, moe=moe).ep_comm_s == 0.0  # ep 1
    assert "ep_comm" in t.breakdown() and "ep_comm" not in step_time(m, Candidate(lay), machine).breakdown()
    # across nodes: the same bytes on the inter-node link, which the group's 4 members on a node share
    two = Machine(device_preset("h100"), links_from_bandwidth(800, 100), 2, 4)
    lay2 = Layout(8, 8, 1, 1, 2, 16, 512, ep_size=8)
    assert ep_placements(two, lay2)[0] == GroupPlacement("inter", 4)
    inter = 1e-5 + max(beta, 8 / 100e9 / 4) * 7 / 8 * rows
    inter_counts = 1e-5 + max(beta, 8 / 100e9 / 4) * 7 / 8 * 64
    assert step_time(m, Candidate(lay2), two, moe=moe).ep_comm_s == pytest.approx(2 * 2 * (4 * inter + inter_counts))


def test_ep_groups_are_consecutive_replica_ranks_and_experts_reduce_over_the_rest():
    machine = h100_nodes(2)
    # tp 2, dp 8: replica ranks are 2 apart, an ep group of 4 is one node's, the experts' group crosses nodes
    assert ep_placements(machine, Layout(16, 8, 1, 2, 1, 8, 4096, ep_size=4)) == (
        GroupPlacement("intra", 4), GroupPlacement("inter", 1))
    # cp 2 x dp 8, ep 2: the ep group is a cp pair; the experts' group is 8 ranks 2 apart, 4 on each node
    assert ep_placements(machine, Layout(16, 8, 1, 1, 1, 8, 4096, cp_size=2, ep_size=2)) == (
        GroupPlacement("intra", 2), GroupPlacement("inter", 4))
    # cp 3 (irregular: ep 2 neither divides nor is a multiple of it) on 2 nodes of 6: replica r = position r
    six = Machine(device_preset("h100"), links_from_bandwidth(3600, 400), 2, 6)
    assert ep_placements(six, Layout(12, 4, 1, 1, 1, 4, 6144, cp_size=3, ep_size=2)) == (
        GroupPlacement("intra", 2), GroupPlacement("inter", 3))
    assert ep_placements(machine, Layout(16, 16, 1, 1, 1, 16, 4096)) == (
        GroupPlacement("intra", 1), machine.placement(1, 16))  # ep 1: the dp group


def test_model_flops_are_the_active_parameters_and_stages_count_moe_blocks():
    m, moe = mixtral()
    pred = predict(m, Layout(16, 8, 2, 1, 8, 64, 4096, ep_size=8), h100_nodes(2), "full", moe=moe)
    assert pred.model_flops_per_token == flops_per_token(m, 4096, moe=moe)
    every = dataclasses.replace(moe, top_k=moe.num_experts)  # as if each token went through all 8
    assert pred.model_flops_per_token < 0.35 * flops_per_token(m, 4096, moe=every)
    assert [st.moe_layers for st in stages(m, pred.candidate.layout, moe)] == [16, 16]
    assert pred.to_dict()["ep"] == 8 and pred.to_dict()["placement"]["ep"] == "inter"  # dp 8 across pp 2: 2 nodes
    half = resolve_moe(MoeConfig(layers=list(range(16))), m)
    ranges = partition_layers(m, 2, moe=half)  # the first half's blocks are heavier: stage 0 has fewer
    assert ranges[0][1] < 16
    assert [st.moe_layers for st in stages(m, Layout(16, 8, 2, 1, 8, 64, 4096), half)] == [ranges[0][1], 16 - ranges[0][1]]


def test_the_planner_proposes_ep_when_memory_needs_it():
    m, moe = mixtral()
    machine = h100_nodes(2)
    space = SearchSpace(tp=1, pp=1, zero=(2,))  # no tp, no pipeline: the experts must be split or not fit
    result = plan(m, machine, 256, 4096, space=space, moe=moe)
    assert result.plans and all(p.candidate.layout.ep_size > 1 for p in result.plans)
    assert all(p.memory.total_gib <= 80 for p in result.plans)
    one = [i for i in result.infeasible if "ep" not in i.layout]
    assert one and all(i.reason.startswith("memory: needs") for i in one)  # ep 1: 46.7B bf16 weights per rank
    assert not plan(m, machine, 256, 4096, space=SearchSpace(tp=1, pp=1, zero=(2,), ep=1), moe=moe).plans
    searched = {p.candidate.layout.ep_size for p in plan(m, machine, 256, 4096, moe=moe).plans}
    assert searched <= {1, 2, 4, 8} and max(searched) == 8  # ep divides dp x cp and the 8 experts
    bad = plan(m, machine, 256, 4096, space=SearchSpace(tp=1, pp=1, cp=1, ep=16), moe=moe)
    assert not bad.plans and any("does not divide moe.num_experts=8" in i.reason for i in bad.infeasible)


def test_predict_refuses_an_ep_the_experts_do_not_allow():
    m, moe = mixtral()
    with pytest.raises(PlanError, match="does not divide moe.num_experts=8"):
        predict(m, Layout(16, 16, 1, 1, 1, 16, 4096, ep_size=16), h100_nodes(2), moe=moe)
    with pytest.raises(PlanError, match="the model has none"):
        predict(resolve_model(ModelConfig(preset="llama-3-8b")), Layout(16, 16, 1, 1, 1, 16, 4096, ep_size=2),
                h100_nodes(2))


def hpctrain_plan(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)


def test_plan_cli_takes_the_moe_preset_and_prints_the_ep():
    out = hpctrain_plan("--set", "model.preset=mixtral-8x7b", "--nodes", "2", "--gpus-per-node", "8", "--device",
                        "h100", "--inter-gbps", "400", "--seq-len", "4096", "--global-batch", "256", "--top", "3",
                        "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["model"] == "mixtral-8x7b" and doc["moe"]["num_experts"] == 8 and doc["moe"]["top_k"] == 2
    assert doc["plans"][0]["ep"] > 1 and doc["plans"][0]["breakdown_s"]["ep_comm"] > 0
    table = hpctrain_plan("--set", "model.preset=mixtral-8x7b", "--nodes", "2", "--gpus-per-node", "8", "--device",
                          "h100", "--inter-gbps", "400", "--seq-len", "4096", "--global-batch", "256", "--ep", "4",
                          "--tp", "2", "--top", "2")
    assert table.returncode == 0, table.stderr
    assert "46.70B parameters, 12.88B active: 8 experts, top 2" in table.stdout, table.stdout
    assert " ep=4 tp=2 " in table.stdout and "ep_comm" in table.stdout, table.stdout


def test_plan_cli_sets_experts_on_a_dense_preset_or_a_toml(tmp_path):
    args = ("--nodes", "1", "--gpus-per-node", "4", "--device", "cpu", "--global-batch", "8", "--seq-len", "64",
            "--json")
    out = hpctrain_plan("--model", "tiny", "--set", "moe.num_experts=4", "--set", "parallel.ep=2", *args)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["moe"]["num_experts"] == 4 and doc["plans"] and {p["ep"] for p in doc["plans"]} == {2}
    config = tmp_path / "moe.toml"
    config.write_text('[model]\npreset = "tiny"\n[moe]\nnum_experts = 4\ntop_k = 1\n'
                      '[train]\nglobal_batch = 8\nseq_len = 64\n')
    out = hpctrain_plan("--model", str(config), *args)
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    eps = {p["ep"] for p in plans}  # searched with and without ep, at every ZeRO stage (zero 3 x ep included)
    assert 1 in eps and eps & {2, 4} and any(p["zero"] == 3 for p in plans if p["ep"] > 1)
    dense = hpctrain_plan("--model", "tiny", "--set", "parallel.ep=2", *args)
    assert dense.returncode != 0 and "parallel.ep" in dense.stdout + dense.stderr
    odd = hpctrain_plan("--model", "tiny", "--set", "moe.num_experts=4", "--ep", "3", *args)
    assert odd.returncode != 0 and "--ep 3: must be a positive divisor" in odd.stdout + odd.stderr
