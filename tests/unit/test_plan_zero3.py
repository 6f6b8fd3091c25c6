"""ZeRO-2 and ZeRO-3 / FSDP in the planner only (hpctrain/plan/memory.py, cost.py): the state they shard,
the all-gathers they cost, and that the planner never recommends them unless asked."""
import json
import subprocess
import sys

import pytest

from hpctrain.config import ModelConfig, resolve_model
from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Candidate, Options, step_time
from hpctrain.plan.devices import device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.memory import GIB, fsdp_unit_parameters, memory
from hpctrain.plan.planner import ENGINE_NOTE, SearchSpace, plan
from hpctrain.plan.shapes import block_matmul_params
from hpctrain.plan.stages import stages

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
OPTS = Options(dtype="bfloat16", reserve_gib=0.0)


def model(name="gpt-7.5b"):
    return resolve_model(ModelConfig(preset=name, vocab_size=0))


def test_zero3_divides_parameters_grads_and_optimizer_by_dp_plus_the_units_in_flight():
    m, dp = model(), 8
    plain = memory(m, Layout(dp, dp, 1, 1, 1, dp, 2048), "off", OPTS)
    z2 = memory(m, Layout(dp, dp, 1, 1, 1, dp, 2048, zero=2), "off", OPTS)
    z3 = memory(m, Layout(dp, dp, 1, 1, 1, dp, 2048, zero=3), "off", OPTS)
    assert z2.params_gib == plain.params_gib and z2.grads_gib == pytest.approx(plain.grads_gib / dp)
    assert z2.optimizer_gib == pytest.approx(plain.optimizer_gib / dp)
    unit = fsdp_unit_parameters(m, stages(m, Layout(dp, dp, 1, 1))[0], 1)  # embedding rows or a block
    assert unit == max(block_matmul_params(m) + 2 * m.d_model, m.vocab_size * m.d_model)
    assert z3.params_gib == pytest.approx(plain.params_gib / dp + 2 * unit * 2 / GIB)  # computing + prefetched
    assert z3.grads_gib == pytest.approx(plain.grads_gib / dp + unit * 4 / GIB)  # one unit's fp32 gradient
    assert z3.optimizer_gib == pytest.approx(plain.optimizer_gib / dp)
    assert z3.activations_gib == plain.activations_gib and z3.total_gib < z2.total_gib < plain.total_gib


def test_zero3_pays_parameter_all_gathers_every_micro_batch():
    m = model()
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 4, 8)
    lay = Layout(32, 32, 1, 1, 4, 32 * 4, 2048, zero=3)
    three = step_time(m, Candidate(lay), machine)
    one = step_time(m, Candidate(Layout(32, 32, 1, 1, 4, 32 * 4, 2048, zero=1)), machine)
    unit = fsdp_unit_parameters(m, stages(m, lay)[0], 1)
    first = machine.collective_s("allgather", unit * 2, 32, machine.placement(1, 32))
    assert three.dp_comm_s >= 2 * 4 * first > 0  # at least one unit's gather exposed per pass
    assert three.compute_s == one.compute_s and three.optimizer_s == one.optimizer_s
    slow = Machine(device_preset("a100"), links_from_bandwidth(2400, 2), 4, 8)  # gathers no longer hide
    few, many = (step_time(m, Candidate(Layout(32, 32, 1, 1, mb, 32 * 4, 2048, zero=3)), slow) for mb in (1, 4))
    assert many.dp_comm_s > 2 * few.dp_comm_s  # a gather per micro-batch, forward and backward


def test_the_default_search_never_includes_zero_2_or_3():
    assert SearchSpace().zero == (0, 1)
    m = model("gpt-1.7b")
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 2, 8)
    result = plan(m, machine, 64, 2048)
    assert result.plans and {p.candidate.layout.zero for p in result.plans} <= {0, 1}
    asked = plan(m, machine, 64, 2048, space=SearchSpace(zero=(3,), tp=1, pp=1))
    assert asked.plans and all(p.candidate.layout.zero == 3 and p.to_dict()["planner_only"] == ENGINE_NOTE
                               for p in asked.plans)


def test_plan_cli_zero3_is_marked_planner_only():
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", "--model", "gpt-1.7b", "--nodes", "2",
                               "--gpus-per-node", "8", "--device", "a100", "--inter-gbps", "200", "--global-batch",
                               "64", "--tp", "2", "--pp", "1", *extra], capture_output=True, text=True, timeout=300,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
    out = run("--zero", "3", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert plans and all(p["zero"] == 3 and p["planner_only"] == ENGINE_NOTE for p in plans)
    assert all(any("planner-only" in w for w in p["warnings"]) for p in plans)
    table = run("--zero", "3")
    assert table.returncode == 0 and "+zero3" in table.stdout and "planner-only" in table.stdout, table.stdout
    default = run("--json")
    assert {p["zero"] for p in json.loads(default.stdout)["plans"]} <= {0, 1}
    assert all("planner_only" not in p for p in json.loads(default.stdout)["plans"])


def test_the_engine_still_refuses_zero_3():
    from hpctrain.config import load_config
    from hpctrain.errors import HpcTrainError

    with pytest.raises(HpcTrainError, match="parallel.zero"):
        load_config(None, ["parallel.zero=3"])
