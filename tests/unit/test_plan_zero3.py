"""ZeRO-2 and ZeRO-3 in the planner as hpctrain's engine runs them (hpctrain/plan/memory.py, cost.py;
hpctrain/parallel/data_parallel.py, zero/gather.py): the state they shard, the units ZeRO-3 gathers at once, the
collectives they cost, the search that recommends them, and the published Llama 3 405B layout."""
import json
import subprocess
import sys

import pytest

from hpctrain.config import ModelConfig, resolve_model
from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Candidate, Options, step_time
from hpctrain.plan.devices import PlanError, device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.memory import GIB, memory, whole_parameters, zero3_units
from hpctrain.plan.planner import SearchSpace, plan, predict
from hpctrain.plan.shapes import block_matmul_params, for_tp
from hpctrain.plan.stages import stage_parameters, stages

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
OPTS = Options(dtype="bfloat16", reserve_gib=0.0)


def model(name="llama-2-7b"):
    return resolve_model(ModelConfig(preset=name, vocab_size=0))


def a100(nodes, inter_gbps=200.0):
    return Machine(device_preset("a100"), links_from_bandwidth(2400, inter_gbps), nodes, 8)


def test_zero2_shards_the_gradients_and_keeps_two_buckets_whole():
    m, dp = model(), 8
    plain = memory(m, Layout(dp, dp, 1, 1, 1, dp, 2048), "off", OPTS)
    z2 = memory(m, Layout(dp, dp, 1, 1, 1, dp, 2048, zero=2), "off", OPTS)
    buckets = 2 * OPTS.bucket_mb * 2**20 / GIB  # one bucket filling, the previous one's reduce-scatter
    assert z2.params_gib == plain.params_gib and z2.optimizer_gib == pytest.approx(plain.optimizer_gib / dp)
    assert z2.grads_gib == pytest.approx(plain.grads_gib / dp + buckets)


def test_zero3_is_the_sharded_state_plus_the_units_gathered_at_once():
    """llama-2-7b on one stage (untied, rope): units embedding (V h), 32 blocks, norm + head (h + V h)."""
    m, dp = model(), 8
    lay = Layout(dp, dp, 1, 1, 1, dp, 2048, zero=3)
    plain = memory(m, Layout(dp, dp, 1, 1, 1, dp, 2048), "off", OPTS)
    h, vh = m.d_model, m.vocab_size * m.d_model
    block, head = block_matmul_params(m) + 2 * h, h + vh
    assert [list(u.values()) for u in zero3_units(m, stages(m, lay)[0], lay)[0]] == [[vh]] + [[block]] * 32 + [[head]]

    def z3(**options):
        return memory(m, lay, "off", Options(dtype="bfloat16", reserve_gib=0.0, **options))
    state = (plain.params_gib + plain.grads_gib + plain.optimizer_gib) / dp
    assert block > head  # so the largest window of the running unit + one prefetched is two blocks
    default = z3()
    assert default.params_gib == pytest.approx(plain.params_gib / dp + 2 * block * 2 / GIB)
    assert default.grads_gib == pytest.approx(plain.grads_gib / dp + block * 4 / GIB)  # one unit's fp32 grads
    assert default.params_gib + default.grads_gib + default.optimizer_gib == pytest.approx(
        state + (2 * block * 2 + block * 4) / GIB)
    assert z3(zero_prefetch=2).params_gib == pytest.approx(default.params_gib + block * 2 / GIB)  # one unit more
    assert z3(zero_prefetch=0).params_gib == pytest.approx(plain.params_gib / dp + block * 2 / GIB)
    assert z3(zero_reshard_after_forward=False).params_gib == pytest.approx(plain.params_gib * (1 + 1 / dp))
    assert default.activations_gib == plain.activations_gib and default.total_gib < plain.total_gib / 3


def test_a_tied_embedding_split_over_pp_stays_whole():
    m = model("gpt-1.7b")  # tied embeddings, learned positions
    lay = Layout(8, 4, 2, 1, 2, 8, 2048, zero=3)
    first, last = stages(m, lay)
    vh = m.vocab_size * m.d_model
    assert whole_parameters(m, first, lay) == whole_parameters(m, last, lay) == vh
    assert zero3_units(m, first, lay)[0][0] == {"embed": m.max_seq_len * m.d_model}  # the positions alone
    assert zero3_units(m, last, lay)[0][-1] == {"head": m.d_model}  # the final norm; the copy is whole
    single = Layout(4, 4, 1, 1, 1, 4, 2048, zero=3)
    assert whole_parameters(m, stages(m, single)[0], single) == 0  # one stage: the head gathers the embedding
    assert set(zero3_units(m, stages(m, single)[0], single)[0][-1]) == {"head", "embed"}


def test_zero2_pays_a_reduce_scatter_every_micro_batch():
    m, mb = model("gpt-7.5b"), 4
    slow = a100(4, inter_gbps=20)  # the reduce-scatter outlasts a micro-batch's slot
    one, two = (step_time(m, Candidate(Layout(32, 32, 1, 1, mb, 32 * mb, 2048, zero=z)), slow) for z in (1, 2))
    lay = Layout(32, 32, 1, 1, mb, 32 * mb, 2048, zero=2)
    grads = stage_parameters(for_tp(m, 1), stages(m, lay)[0], 1) * 4  # float32, the whole stage
    whole = slow.collective_s("reduce_scatter", grads, 32, slow.group_placement((1, 32), (1, 1)))
    slot = (one.compute_s + one.tp_comm_s) / mb
    assert whole > slot and two.dp_comm_s - one.dp_comm_s == pytest.approx((mb - 1) * (whole - slot))
    assert two.compute_s == one.compute_s and two.optimizer_s == one.optimizer_s


def test_zero3_gathers_per_micro_batch_or_per_step_and_prefetch_hides_them():
    m = model("gpt-7.5b")
    slow = a100(4, inter_gbps=20)

    def dp_s(mb, **options):
        lay = Layout(32, 32, 1, 1, mb, 32 * 4, 2048, zero=3)
        return step_time(m, Candidate(lay), slow, Options(**options)).dp_comm_s
    lay = Layout(32, 32, 1, 1, 4, 32 * 4, 2048, zero=3)
    units = zero3_units(m, stages(m, lay)[0], lay)[0]
    at = slow.group_placement((1, 32), (1, 1))
    # per micro-batch: every unit forward, every unit but the head backward (the embedding stays pinned by the
    # tied head: zero/gather.py), as tests/unit/test_zero3_units.py counts the engine's gathers
    forward = sum(slow.collective_s("allgather", sum(u.values()) * 2, 32, at) for u in units)
    backward = sum(slow.collective_s("allgather", sum(v for k, v in u.items() if k not in units[-1]) * 2, 32, at)
                   for u in units[:-1] if set(u) - set(units[-1]))
    assert dp_s(4, zero_prefetch=0) >= 4 * (forward + backward)  # prefetch 0: every gather exposed
    assert dp_s(4) < dp_s(4, zero_prefetch=0)  # a prefetched gather overlaps the unit before it
    assert dp_s(4, zero_reshard_after_forward=False) < dp_s(4)  # one gather per unit and step
    once = {"zero_reshard_after_forward": False}
    assert dp_s(4) - dp_s(1) > 2 * (dp_s(4, **once) - dp_s(1, **once))  # gathers per micro-batch, or per step


def test_zero3_has_no_parameter_all_gather_after_the_step():
    m = model("gpt-1.7b")
    lay = {z: Layout(16, 16, 1, 1, 1, 16, 2048, zero=z) for z in (1, 3)}
    one, three = (step_time(m, Candidate(lay[z]), a100(2)) for z in (1, 3))  # 200 Gbit/s: gathers hide
    assert three.dp_comm_s < one.dp_comm_s / 2  # the first units' gathers exposed, not a whole stage's


def test_the_default_search_tries_every_stage_and_picks_zero3_when_memory_is_tight():
    assert SearchSpace().zero == (0, 1, 2, 3)
    m = model("gpt-39b")  # 78 GB of bf16 parameters: on one stage without tp only ZeRO-3 fits 80 GB
    result = plan(m, a100(2), 64, 2048, space=SearchSpace(tp=1, pp=1, cp=1))
    assert result.plans and {p.candidate.layout.zero for p in result.plans} == {3}
    best = result.plans[0].to_dict()
    assert best["zero"] == 3 and best["zero_prefetch"] == 1 and best["zero_reshard_after_forward"] is True
    assert "planner_only" not in best and not any("planner" in w for w in best["warnings"])
    searched = plan(model("gpt-1.7b"), a100(2), 64, 2048, space=SearchSpace(tp=2, pp=1, cp=1))
    assert {p.candidate.layout.zero for p in searched.plans} == {0, 1, 2, 3}


def test_compression_is_refused_at_zero_2_and_3_as_the_engine_refuses_it():
    from hpctrain.config import load_config
    from hpctrain.errors import HpcTrainError

    load_config(None, ["parallel.zero=3", "parallel.zero_prefetch=2"])  # the engine trains zero 3
    with pytest.raises(HpcTrainError, match="parallel.zero"):
        load_config(None, ["parallel.zero=2", "compression.method=bf16"])
    m, bf16 = model("gpt-1.7b"), Options(compression="bf16")
    with pytest.raises(PlanError, match="compression"):
        predict(m, Layout(16, 16, 1, 1, 1, 16, 2048, zero=3), a100(2), options=bf16)
    result = plan(m, a100(2), 64, 2048, bf16, SearchSpace(tp=2, pp=1, cp=1))
    assert {p.candidate.layout.zero for p in result.plans} == {0, 1}
    assert any("compression" in i.reason for i in result.infeasible)


def test_published_llama3_405b_zero3_fits_on_its_gpus():
    from hpctrain.plan.published import RUNS
    from hpctrain.plan.validate import machine, options, predict_run

    run = next(r for r in RUNS if r.name == "llama3-405b 16384")
    assert (run.tp, run.pp, run.zero, run.zero_reshard_after_forward) == (8, 16, 3, False)  # FSDP, not resharded
    pred = predict_run(run)
    assert pred.memory.total_gib <= machine(run).memory_gib()
    assert options(run).zero_reshard_after_forward is False and "planner" not in run.assumed


def hpctrain_plan(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", "--model", "gpt-1.7b", "--nodes", "2",
                           "--gpus-per-node", "8", "--device", "a100", "--inter-gbps", "200", "--global-batch",
                           "64", "--tp", "2", "--pp", "1", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def test_plan_cli_zero3_options_and_no_planner_only_marking(tmp_path):
    out = hpctrain_plan("--zero", "3", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert plans and all(p["zero"] == 3 and p["zero_prefetch"] == 1 and p["zero_reshard_after_forward"] for p in plans)
    assert all("planner_only" not in p and not p["warnings"] for p in plans)
    kept = hpctrain_plan("--zero", "3", "--zero-prefetch", "2", "--zero-reshard-after-forward", "false", "--json")
    more = json.loads(kept.stdout)["plans"]
    assert all(p["zero_prefetch"] == 2 and p["zero_reshard_after_forward"] is False for p in more)
    assert min(p["memory_gib"]["params"] for p in more) > max(p["memory_gib"]["params"] for p in plans)
    table = hpctrain_plan("--zero", "3")
    assert table.returncode == 0 and "+zero3" in table.stdout and "planner" not in table.stdout, table.stdout
    assert "ZeRO-3: 1 unit(s) prefetched" in table.stdout
    config = tmp_path / "z3.toml"
    config.write_text('[model]\npreset = "gpt-1.7b"\n[train]\nglobal_batch = 64\n'
                      '[parallel]\ndp = 16\nzero = 3\nzero_prefetch = 0\nzero_reshard_after_forward = false\n')
    given = subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", "--model", str(config), "--nodes", "2",
                            "--gpus-per-node", "8", "--device", "a100", "--inter-gbps", "200", "--json"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert given.returncode == 0, given.stderr
    sharded = [p for p in json.loads(given.stdout)["plans"] if p["dp"] * p["cp"] > 1]  # one replica: zero 0
    assert sharded and all(p["zero"] == 3 and p["zero_prefetch"] == 0 and p["zero_reshard_after_forward"] is False
                           for p in sharded)
    bad = hpctrain_plan("--zero-prefetch", "-1")
    assert bad.returncode != 0 and "--zero-prefetch -1" in bad.stderr
