"""Gradient compression in the planner (hpctrain/plan/compressed.py): the dp reduction's wire fraction per
method equals what the engine's compressors put on the wire, onebit-adam's ZeRO-1 case, its dense warm-up
in `hpctrain plan`, and the methods it refuses to guess."""
import json
import subprocess
import sys

import pytest
import torch

from hpctrain.compression.quantize import BlockOneBit, Int8, OneBit
from hpctrain.config import ModelConfig, resolve_model
from hpctrain.config.layout import Layout
from hpctrain.plan.compressed import dp_wire_fraction, payload_fraction, warmup_average_step_s
from hpctrain.plan.cost import Candidate, Options, step_time
from hpctrain.plan.devices import PlanError, device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("method, compressor", [("onebit-adam", BlockOneBit(None)), ("int8", Int8(None)),
                                                ("onebit", OneBit(None))])
def test_wire_fraction_is_the_compressors_payload_per_float32_byte(method, compressor):
    n = 2048 * 1024  # a bucket of 2M values: per-payload padding is negligible
    assert payload_fraction(method) == pytest.approx(compressor.payload_nbytes(n, torch.float32) / (4 * n), rel=1e-3)


def test_onebit_adam_replaces_an_all_reduce_or_zero1s_reduce_scatter():
    assert 1 / dp_wire_fraction("onebit-adam", zero=0) == pytest.approx(31.5, abs=0.05)
    assert dp_wire_fraction("onebit-adam", zero=1) == pytest.approx(2 * dp_wire_fraction("onebit-adam", zero=0))
    assert dp_wire_fraction("bf16", zero=1) == dp_wire_fraction("bf16", zero=0) == 0.5


def test_a_slow_link_s_dp_time_shrinks_by_the_fraction_and_the_warmup_is_averaged_in():
    model = resolve_model(ModelConfig(preset="gpt2-small", vocab_size=0))
    machine = Machine(device_preset("h100"), links_from_bandwidth(900.0, 1.0), 4, 1)
    layout = Layout(4, 4, 1, 1, 4, 64, 1024)
    layout.validate(model)
    dense = step_time(model, Candidate(layout, "off"), machine, Options())
    onebit = step_time(model, Candidate(layout, "off"), machine, Options(compression="onebit-adam"))
    assert onebit.dp_comm_s < dense.dp_comm_s / 20 and onebit.compute_s == dense.compute_s
    mean = warmup_average_step_s(dense.step_s, onebit.step_s, 100, 1000)
    assert mean == pytest.approx(0.1 * dense.step_s + 0.9 * onebit.step_s)
    with pytest.raises(PlanError, match="topk"):
        Options(compression="topk")


def test_hpctrain_plan_reports_onebit_adam_s_warmup_and_refuses_what_it_cannot_model():
    base = [sys.executable, "-m", "hpctrain.cli", "plan", "--model", "gpt2-small", "--nodes", "4", "--gpus-per-node",
            "1", "--device", "h100", "--inter-gbps", "1", "--top", "2"]
    out = subprocess.run([*base, "--json", "--compression", "onebit-adam", "--compression-warmup", "100", "--steps",
                          "1000"], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["compression"] == "onebit-adam"
    best = result["plans"][0]
    assert best["dense_step_s"] > 2 * best["compressed_step_s"] and best["compressed_step_s"] == best["predicted_step_s"]
    assert best["run_mean_step_s"] == pytest.approx(0.1 * best["dense_step_s"] + 0.9 * best["compressed_step_s"])
    text = subprocess.run([*base, "--compression", "onebit-adam", "--compression-warmup", "100", "--steps", "1000"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=True).stdout
    assert "onebit-adam: the first 100 of 1000 steps are dense AdamW" in text
    for bad, says in ((["--compression", "topk"], "--compression topk: the planner models"),
                      (["--compression", "onebit-adam"], "give --compression-warmup")):
        run = subprocess.run([*base, *bad], capture_output=True, text=True, cwd=ROOT, timeout=120)
        lines = run.stderr.strip().splitlines()
        assert run.returncode != 0 and len(lines) == 1 and says in lines[0], run.stderr
