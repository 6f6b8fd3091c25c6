"""LoRA in the planner (hpctrain/plan/lora.py): the frozen base's memory and time, the adapters' split over tp,
the FLOPs, and `hpctrain plan` with `lora.rank`. tests/mpi/test_lora_plan_memory.py holds the memory against the engine."""
import json
import subprocess
import sys

import pytest

from hpctrain.config import ModelConfig, resolve_model
from hpctrain.config.arithmetic import adapter_parameters
from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Candidate, Options, _zero3_gathers, executed_flops_per_token, step_time
from hpctrain.plan.devices import PlanError, device_preset
from hpctrain.plan.lora import ROW_PARALLEL, block_adapter_parameters, partial_adapter_parameters
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.memory import GIB, memory, zero3_units
from hpctrain.plan.shapes import block_matmul_params, for_tp
from hpctrain.plan.stages import stages

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def llama():
    return resolve_model(ModelConfig(preset="llama-2-7b", vocab_size=0))


def test_row_parallel_targets_are_the_engines():
    from hpctrain.models.lora import TARGET_MODULES

    assert ROW_PARALLEL == {t for t, (_, column) in TARGET_MODULES.items() if not column}


def test_the_adapters_split_over_tp_like_their_linears():
    m = llama()
    assert block_adapter_parameters(m, 1, 16, TARGETS) * m.n_layers == adapter_parameters(m, 16, TARGETS)
    d, f = m.d_model, m.d_ff
    # q: A [16, d] whole, B [d/4, 16]; down: A [16, f/4], B [d, 16] whole
    assert block_adapter_parameters(m, 4, 16, ("q", "down")) == 16 * (d + d // 4) + 16 * (f // 4 + d)
    assert partial_adapter_parameters(m, 4, 16, ("q", "down")) == 16 * d + 16 * d  # q's A, down's B
    assert partial_adapter_parameters(m, 1, 16, ("q", "down")) == 0


def test_a_lora_run_keeps_the_base_and_trains_only_the_adapters():
    m, dp = for_tp(llama(), 1), 8
    lay = Layout(dp, dp, 1, 1, 1, dp, 2048)
    full = memory(m, lay, "off", Options(reserve_gib=0.0))
    lora = memory(m, lay, "off", Options(reserve_gib=0.0, lora_rank=16, lora_targets=TARGETS))
    adapters = adapter_parameters(m, 16, TARGETS)
    assert lora.params_gib == pytest.approx(full.params_gib + adapters * 2 / GIB)  # bf16 base + adapters
    assert lora.grads_gib == pytest.approx(adapters * 4 / GIB)  # float32 main grads of the adapters only
    assert lora.optimizer_gib == pytest.approx(adapters * 12 / GIB)  # two moments + float32 masters
    assert lora.activations_gib == full.activations_gib
    z3 = memory(m, Layout(dp, dp, 1, 1, 1, dp, 2048, zero=3), "off",
                Options(reserve_gib=0.0, lora_rank=16, lora_targets=TARGETS))
    assert z3.params_gib < lora.params_gib / 4  # the frozen base sharded too


def test_the_frozen_base_skips_its_weight_gradients_and_its_reduction():
    m = llama()
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200.0), 1, 8)
    cand = Candidate(Layout(8, 8, 1, 1, 32, 512, 2048, zero=1))
    full = step_time(m, cand, machine, Options())
    lora = step_time(m, cand, machine, Options(lora_rank=16, lora_targets=("q", "v")))
    assert 0.6 < lora.compute_s / full.compute_s < 0.8  # backward: the input's gradient only (~4/6 of the FLOPs)
    assert lora.dp_comm_s < full.dp_comm_s / 100 and lora.optimizer_s < full.optimizer_s / 10
    frozen = m.n_layers * block_matmul_params(m) + m.d_model * m.vocab_size
    difference = executed_flops_per_token(m, 2048, "off", True) - \
        executed_flops_per_token(m, 2048, "off", True, lora=(16, ("q", "v")))
    assert difference == pytest.approx(2 * frozen - 6 * adapter_parameters(m, 16, ("q", "v")))


def test_without_lora_nothing_changes():
    m = llama()
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200.0), 2, 8)
    for zero in (0, 2, 3):
        cand = Candidate(Layout(16, 4, 2, 2, 8, 512, 2048, zero=zero))
        assert step_time(m, cand, machine, Options()) == step_time(m, cand, machine, Options(lora_targets=("q",)))


def test_zero3_gathers_a_frozen_tied_embedding_with_its_units_and_never_in_the_backward():
    gpt = for_tp(resolve_model(ModelConfig(preset="gpt-1.7b", vocab_size=0)), 1)  # tied, learned positions
    assert gpt.tie_embeddings
    lay = Layout(8, 4, 2, 1, 8, 512, 2048, zero=3)
    first, last = stages(gpt, lay)[0], stages(gpt, lay)[-1]
    vh = gpt.vocab_size * gpt.d_model
    frozen = zero3_units(gpt, first, lay, frozen=True)[0][0], zero3_units(gpt, last, lay, frozen=True)[-1][-1]
    assert frozen[0]["embed"] >= vh and frozen[1]["head"] == gpt.d_model + vh  # sharded, each stage its own
    assert zero3_units(gpt, first, lay)[0][0]["embed"] < vh  # full training: the split embedding stays whole
    m = llama()
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200.0), 1, 8)
    lay = Layout(8, 8, 1, 1, 32, 512, 2048, zero=3)
    st = stages(for_tp(m, 1), lay)[0]
    at = machine.placement(1, 8)
    units = {k: (1.0, 1.0) for k in ("embed", "block", "head", "moe")}
    gaps = []
    for options in (Options(), Options(lora_rank=16, lora_targets=("q", "v"))):
        _, _, forward, backward = _zero3_gathers(for_tp(m, 1), lay, machine, options, (at, at), st, units)
        gaps.append(forward - backward)  # the head (and, frozen, the embedding) not gathered in the backward
    embed = machine.collective_s("allgather", m.vocab_size * m.d_model * 2, 8, at)
    assert gaps[1] - gaps[0] == pytest.approx(embed)


def test_bad_lora_options_are_refused_by_name():
    with pytest.raises(PlanError, match="LoRA targets"):
        Options(lora_rank=8, lora_targets=("qkv",))
    with pytest.raises(PlanError, match="lora_rank"):
        Options(lora_rank=-1)
    with pytest.raises(PlanError, match="distinct"):
        Options(lora_rank=8, lora_targets=("q", "q"))
    gelu = resolve_model(ModelConfig(preset="gpt-1.7b", vocab_size=0))
    with pytest.raises(PlanError, match=r"\['gate'\]: this model has no such linear"):
        block_adapter_parameters(gelu, 1, 8, ("q", "gate"))


def plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)


def test_plan_cli_models_lora_from_the_config_and_refuses_it_on_experts():
    args = ("--model", "llama-2-7b", "--nodes", "1", "--gpus-per-node", "8", "--device", "a100", "--top", "1")
    full = plan_cli(*args, "--json")
    lora = plan_cli(*args, "--json", "--set", "lora.rank=16")
    assert full.returncode == lora.returncode == 0, lora.stderr
    doc, base = json.loads(lora.stdout), json.loads(full.stdout)
    assert doc["lora"] == {"rank": 16, "targets": ["q", "v"]} and "lora" not in base
    assert doc["plans"][0]["predicted_step_s"] < base["plans"][0]["predicted_step_s"]
    table = plan_cli(*args, "--set", "lora.rank=16")
    assert "LoRA rank 16 on q,v: 8.39M trainable parameters" in table.stdout, table.stdout
    moe = plan_cli("--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--device", "cpu", "--set",
                   "moe.num_experts=4", "--set", "lora.rank=8")
    assert moe.returncode != 0 and "models LoRA on dense models only" in moe.stderr, moe.stderr
