"""Context parallelism in the performance and memory model (hpctrain/plan/ring.py, cost.py, memory.py,
planner.py) and `hpctrain plan --seq-len` with cp, without MPI."""
import dataclasses
import json
import subprocess
import sys

import pytest

from hpctrain.config import ModelConfig, resolve_model
from hpctrain.parallel.context_parallel import block_plan, causal_window_mask, zigzag_positions
from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Candidate, Options, step_time
from hpctrain.plan.devices import device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.memory import memory
from hpctrain.plan.planner import SearchSpace, plan
from hpctrain.plan.ring import kv_elements, ring_pairs

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
OFF = Options(reserve_gib=0.0)


def llama(name="llama-3-8b", **changes):
    return dataclasses.replace(resolve_model(ModelConfig(preset=name, vocab_size=0)), **changes)


def h100_nodes(nodes, inter_gbps=400.0, intra_gbps=3600.0):
    return Machine(device_preset("h100"), links_from_bandwidth(intra_gbps, inter_gbps if nodes > 1 else None),
                   nodes, 8)


def cp_layout(cp, seq=32768, dp=1, tp=1, zero=0, batch=None):
    world = dp * cp * tp
    return Layout(world, dp, 1, tp, 1, batch or dp, seq, False, zero, cp_size=cp)


@pytest.mark.parametrize("seq, cp, window, tile", [(64, 2, 0, 8), (64, 4, 0, 4), (96, 2, 0, 0), (64, 2, 9, 4),
                                                   (128, 4, 21, 8), (64, 4, 64, 4), (48, 3, 5, 2)])
def test_ring_pairs_count_the_blocks_ring_attention_computes(seq, cp, window, tile):
    """The planner's count (pure arithmetic) against the block plan ring_attention runs and a brute count of
    the visible (query, key) pairs, per step, the busiest rank."""
    work = ring_pairs(seq, cp, window, tile)
    stripe = seq // (2 * cp)
    for step in range(cp):
        computed, visible = [], []
        for rank in range(cp):
            owner = (rank - step) % cp
            blocks = block_plan(rank, owner, cp, stripe, window, tile)
            computed.append(sum((b.q.stop - b.q.start) * (b.k.stop - b.k.start) for b in blocks if b.kind != "skip"))
            mask = causal_window_mask(zigzag_positions(seq, rank, cp), zigzag_positions(seq, owner, cp), window)
            visible.append(int(mask.sum()))
        assert work.computed[step] == max(computed), (step, computed)
        busiest = [v for c, v in zip(computed, visible) if c == max(computed)]
        assert work.visible[step] == max(busiest), (step, visible)
        if window == 0:
            assert len(set(visible)) == 1  # the zig-zag balance
    total = seq * (seq + 1) // 2 if window == 0 else sum(min(window, t + 1) for t in range(seq))
    if window == 0:  # the zig-zag split: every rank does the same causal work
        assert sum(work.visible) * cp == total
    assert 0 <= work.skipped_fraction < 1


def test_a_sliding_window_skips_blocks_and_their_compute():
    full, windowed = ring_pairs(131072, 8, 0), ring_pairs(131072, 8, 4096)
    assert full.skipped_fraction == pytest.approx(0.5, abs=0.05)  # causal: about half
    assert windowed.skipped_fraction > 0.9 and sum(windowed.computed) < sum(full.computed) / 5
    m, lay, machine = llama(), cp_layout(8, seq=131072), h100_nodes(1)
    a = step_time(m, Candidate(lay), machine)
    b = step_time(dataclasses.replace(m, attention_window=4096), Candidate(lay), machine)
    assert b.compute_s < a.compute_s


def test_activation_memory_falls_as_one_over_cp_and_state_is_replicated():
    m = llama()
    one = memory(m, cp_layout(1), "off", OFF)
    for cp in (2, 4, 8):
        mem = memory(m, cp_layout(cp), "off", OFF)
        ratio = mem.activations_gib / one.activations_gib
        assert 1 / cp <= ratio < 1.1 / cp, (cp, ratio)  # + the ring's log-sum-exp and working set
        assert mem.params_gib == one.params_gib and mem.grads_gib == one.grads_gib  # replicated like dp
        assert mem.optimizer_gib == one.optimizer_gib
        zero = memory(m, cp_layout(cp, dp=2, zero=1, batch=2), "off", OFF)
        assert zero.optimizer_gib == pytest.approx(one.optimizer_gib / (2 * cp))  # ZeRO-1 over dp x cp
    unfused = Options(reserve_gib=0.0, flash_attention=False)  # the ring keeps no S x S scores, either way
    assert memory(m, cp_layout(2), "off", unfused).activations_gib == pytest.approx(
        memory(m, cp_layout(2), "off", OFF).activations_gib)
    assert memory(m, cp_layout(1), "off", unfused).activations_gib > 10 * one.activations_gib


def test_compute_falls_with_cp_and_the_ring_exchange_is_charged_where_exposed():
    m, seq = llama(), 65536
    fast, slow = h100_nodes(2), h100_nodes(2, inter_gbps=1.0)
    one = step_time(m, Candidate(cp_layout(1, seq=seq, tp=8)), fast)
    two = step_time(m, Candidate(cp_layout(2, seq=seq, tp=8)), fast)  # tp x cp = 16: cp crosses the nodes
    four = step_time(m, Candidate(cp_layout(4, seq=seq, tp=4)), fast)
    assert one.cp_comm_s == 0 and two.cp_comm_s > 0
    assert four.compute_s / two.compute_s == pytest.approx(1.0, rel=0.1)  # 16 ranks share the work alike
    eight = step_time(m, Candidate(cp_layout(4, seq=seq, tp=8)), h100_nodes(4))
    assert eight.compute_s / two.compute_s == pytest.approx(0.5, rel=0.05)  # twice the cp: half the work
    # hpctrain's ring computes its blocks unfused in float32: slower per pair than the fused causal SDPA
    assert two.compute_s > one.compute_s / 2
    kv = kv_elements(m, 1, seq, 2, 8)
    dkv_s = 1e-5 + kv * 4 * 8 / 400e9  # the last dK/dV pass (float32) over one rank's share of the NIC
    assert two.cp_comm_s == pytest.approx(m.n_layers * dkv_s, rel=1e-6)  # hidden behind the block compute
    exposed = step_time(m, Candidate(cp_layout(2, seq=seq, tp=8)), slow)
    assert exposed.cp_comm_s > 10 * two.cp_comm_s  # a slow link outlasts the blocks
    assert exposed.compute_s == two.compute_s
    recomputed = step_time(m, Candidate(cp_layout(2, seq=seq, tp=8), "full"), slow)
    assert recomputed.cp_comm_s > exposed.cp_comm_s  # the recomputed forward runs the ring again


def test_the_engines_unfused_float32_ring_against_a_fused_one():
    m, machine, lay = llama(), h100_nodes(2), cp_layout(2, seq=65536, tp=8)
    engine = step_time(m, Candidate(lay), machine)
    fused = step_time(m, Candidate(lay), machine, Options(fused_ring=True))
    flash = step_time(m, Candidate(cp_layout(1, seq=65536, tp=8)), machine)
    assert fused.compute_s < engine.compute_s / 2  # bf16 peak, scores kept on chip
    assert fused.compute_s == pytest.approx(flash.compute_s / 2, rel=0.1)  # = one rank's fused causal SDPA / cp
    assert fused.cp_comm_s >= engine.cp_comm_s  # less compute to hide the same exchange behind


@pytest.mark.parametrize("nodes, per_node", [(2, 8), (4, 8), (3, 4), (4, 6)])
def test_the_dp_x_cp_group_is_placed_as_the_grid_places_it(nodes, per_node):
    """Machine.group_placement against counting each dp_cp group's members per node (grid order: tp fastest,
    then cp, pp, dp)."""
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), nodes, per_node)
    world = nodes * per_node
    for tp, cp, pp in [(t, c, p) for t in range(1, world + 1) for c in range(1, world + 1)
                       for p in range(1, world + 1) if world % (t * c * p) == 0]:
        dp = world // (tp * cp * pp)
        groups: dict[tuple, list[int]] = {}
        for rank in range(world):
            t, c, p = rank % tp, rank // tp % cp, rank // (tp * cp) % pp
            groups.setdefault((t, p), []).append(rank // per_node)
        per = [[g.count(n) for n in set(g)] for g in groups.values()]
        crosses = any(len(c) > 1 for c in per)
        expected = ("inter", min(min(c) for c in per if len(c) > 1)) if crosses else ("intra", dp * cp)
        got = machine.group_placement((tp * cp * pp, dp), (tp, cp))
        assert (got.level, got.per_node) == expected, (tp, cp, pp, dp)


def test_gradients_are_reduced_over_dp_x_cp():
    m, machine = llama(), h100_nodes(2)
    alone = step_time(m, Candidate(cp_layout(2, seq=8192, tp=8)), machine)
    with_dp = step_time(m, Candidate(cp_layout(2, seq=8192, tp=4, dp=2, batch=2)), machine)
    assert alone.dp_comm_s > 0 and with_dp.dp_comm_s > 0  # a replica of cp ranks sums its gradients
    assert step_time(m, Candidate(cp_layout(1, seq=8192, tp=8)), machine).dp_comm_s == 0


def test_a_seq_len_not_divisible_by_2cp_is_never_proposed():
    m, machine = llama(), h100_nodes(2)
    result = plan(m, machine, 16, 6666, space=SearchSpace(recompute=("full",)))  # 6666 = 2 x 3333
    assert result.plans and all(p.candidate.layout.cp_size == 1 for p in result.plans)
    for seq in (12288, 24576):
        result = plan(m, machine, 16, seq, space=SearchSpace(recompute=("full",)))
        cps = {p.candidate.layout.cp_size for p in result.plans}
        assert cps - {1} and all(seq % (2 * c) == 0 for c in cps), cps
    given = plan(m, machine, 16, 6666, space=SearchSpace(cp=2, recompute=("full",)))
    assert not given.plans and any("train.seq_len=6666 must be divisible by 2 x parallel.cp = 4" in i.reason
                                   for i in given.infeasible)


def hpctrain_plan(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)


H100_NODES = ("--gpus-per-node", "8", "--device", "h100", "--inter-gbps", "400")


def test_plan_at_131072_tokens_proposes_cp_where_nothing_else_fits():
    """Llama 3 405B at 128K tokens (Llama 3's long-context stage used cp 16 on 16K GPUs): on 32 nodes no
    layout without cp holds the activations, even with full recomputation."""
    args = ("--model", "llama-3-405b", "--seq-len", "131072", "--nodes", "32", *H100_NODES, "--global-batch", "128")
    out = hpctrain_plan(*args, "--json", "--top", "1000")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["plans"] and all(p["cp"] > 1 and 131072 % (2 * p["cp"]) == 0 for p in doc["plans"])
    best = doc["plans"][0]
    assert best["memory_gib_per_device"] <= 80 and best["seq_chunk"] == 131072 // best["cp"] // (
        best["tp"] if best["sequence_parallel"] else 1)
    no_cp = [i for i in doc["infeasible"] if "cp" not in i["layout"]]
    assert all(i["reason"].startswith("memory") or "parallel." in i["reason"] or "train." in i["reason"]
               for i in no_cp)  # what passes the layout rules does not fit
    assert any(i["reason"].startswith("memory") and i["layout"]["tp"] == 8 for i in no_cp)
    table = hpctrain_plan(*args, "--top", "3")
    assert table.returncode == 0, table.stderr
    assert f"cp={best['cp']} tp={best['tp']}" in table.stdout and "cp_comm" in table.stdout, table.stdout


def test_plan_picks_cp_for_a_long_windowed_sequence_and_not_for_a_short_one():
    """With a sliding window the ring skips the blocks outside it, while one rank's SDPA with a window mask
    computes the whole square: cp wins at 128K tokens. At 2K tokens cp only adds the ring."""
    args = ("--model", "llama-3-8b", "--nodes", "2", *H100_NODES, "--global-batch", "16", "--json", "--top", "1000")
    long = json.loads(hpctrain_plan(*args, "--seq-len", "131072", "--attention-window", "4096").stdout)["plans"]
    assert long[0]["cp"] > 1, long[0]
    short = json.loads(hpctrain_plan(*args, "--seq-len", "2048").stdout)["plans"]
    assert short[0]["cp"] == 1, short[0]
    with_cp = [p for p in short if p["cp"] > 1]
    assert with_cp and all(p["breakdown_s"]["cp_comm"] > 0 for p in with_cp)  # the ring costs, buys nothing


def test_plan_cli_cp_and_window_input():
    out = hpctrain_plan("--model", "llama-3-8b", "--seq-len", "8192", "--nodes", "1", "--gpus-per-node", "8",
                        "--device", "h100", "--cp", "3")
    assert out.returncode != 0 and "--cp 3: must be a positive divisor of the 8 devices" in out.stdout + out.stderr
    out = hpctrain_plan("--model", "llama-3-8b", "--seq-len", "8192", "--nodes", "1", "--gpus-per-node", "8",
                        "--device", "h100", "--attention-window", "9000")
    assert out.returncode != 0 and "--attention-window 9000 is larger than --seq-len 8192" in out.stdout + out.stderr
    out = hpctrain_plan("--model", "gpt-1.7b", "--seq-len", "65536", "--nodes", "1", "--gpus-per-node", "8")
    assert out.returncode != 0 and "learned position table" in out.stdout + out.stderr
    out = hpctrain_plan("--model", "llama-3-8b", "--seq-len", "32768", "--nodes", "1", "--gpus-per-node", "8",
                        "--device", "h100", "--cp", "4", "--attention-window", "4096", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["attention_window"] == 4096 and {p["cp"] for p in doc["plans"]} == {4}


def test_a_sweep_row_with_cp_gets_the_ring_in_its_prediction():
    from hpctrain.config import load_config
    from hpctrain.sweep.predict import predict_run

    cfg = load_config(str(ROOT / "configs" / "tiny.toml"))
    row = {"ranks": 2, "dp": 2, "tp": 1, "pp": 1, "microbatches": 1, "global_batch": 8}
    plain = predict_run(cfg, row)
    ring = predict_run(cfg, {**row, "dp": 1, "cp": 2})
    assert plain and ring and ring["predicted_comm_s"] > 0
    assert predict_run(cfg, {**row, "dp": 1, "cp": 3}) is None  # 2 ranks are not dp x cp = 3


def test_a_toml_that_sets_parallel_cp_is_evaluated_with_it(tmp_path):
    config = tmp_path / "cp.toml"
    config.write_text('[model]\npreset = "tiny"\nattention_window = 16\n[parallel]\ncp = 2\ntp = 2\n'
                      '[train]\nglobal_batch = 8\nseq_len = 64\n')
    out = hpctrain_plan("--model", str(config), "--nodes", "1", "--gpus-per-node", "4", "--device", "cpu", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["attention_window"] == 16 and {(p["dp"], p["cp"], p["tp"], p["pp"]) for p in doc["plans"]} == {
        (1, 2, 2, 1)}
