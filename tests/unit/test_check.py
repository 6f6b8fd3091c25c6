"""``hpctrain check``: every start-up problem of a run listed in one process, from the trainer's own rules; the
planner never proposes a layout it refuses, and keeps tp inside a node unless asked."""
import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpctrain.checkpoint.format import FORMAT_NAME, MASTER_FILE
from hpctrain.config import ModelConfig, config_to_dict, load_config, resolve_model
from hpctrain.config.load import read_config
from hpctrain.config.moe_keys import MoeConfig, resolve_moe
from hpctrain.plan.cost import Options
from hpctrain.plan.devices import device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.planner import SearchSpace, plan
from hpctrain.train.preflight import check_job

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


def check(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "check", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)


def test_one_run_names_every_problem_and_exits_2():
    """The issue's target: the KV heads, the experts, compression at ZeRO-3 and the missing file, in one run
    (ZeRO-3 with ep is no problem: the experts are sharded over their own replicas)."""
    out = check("--config", TINY, "--ranks", "8", "parallel.tp=4", "parallel.pp=2", "moe.num_experts=3",
                "parallel.ep=2", "parallel.zero=3", "compression.method=topk", "data.source=/nonexistent/corpus.txt")
    assert out.returncode == 2, out.stdout + out.stderr
    problems = [line for line in out.stderr.splitlines() if line.startswith("  - ")]
    for expected in ("model.n_kv_heads=2 is not divisible by parallel.tp=4",
                     "parallel.ep: 2 does not divide moe.num_experts=3",
                     "parallel.zero: 3 keeps only this rank's slice of each gradient, which compression.method='topk'",
                     "data source '/nonexistent/corpus.txt': path does not exist"):
        assert sum(expected in line for line in problems) == 1, (expected, out.stderr)
    assert f"{len(problems)} problem(s)" in out.stderr and "parallel.zero: 3 with parallel.ep" not in out.stderr


def test_a_valid_job_is_summarised_and_exits_0():
    out = check("--config", TINY, "--nodes", "2", "--gpus-per-node", "4", "--device", "h100",
                "parallel.tp=2", "parallel.pp=2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "layout: 8 ranks on 2 node(s) of 4, dp=2 x pp=2 x cp=1 x tp=2" in out.stdout
    assert "tokens per step" in out.stdout and "h100 has 80 GiB" in out.stdout
    assert "OK:" in out.stdout and not out.stderr.strip()


@pytest.mark.parametrize("args, message", [
    (["--config", "/nonexistent.toml"], "cannot read config file /nonexistent.toml"),
    (["--device", "tpu9"], "unknown device 'tpu9'"),
    (["--ranks", "7", "parallel.tp=2"], "world size 7 is not divisible by tp*pp"),
    (["parallel.nosuchkey=1"], "nosuchkey"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    out = check(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_config_that_does_not_parse_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    out = check("--config", str(bad))
    assert out.returncode == 2 and "invalid TOML" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_memory_is_judged_against_the_device():
    cfg = read_config(TINY, ["model.preset=llama-3-8b", "model.vocab_size=0", "parallel.tp=1", "parallel.pp=1",
                             "train.seq_len=2048"])
    report = check_job(cfg, 1, device=device_preset("v100"))
    assert any("does not fit in memory" in p and "v100 has 32 GiB" in p for p in report.problems), report
    assert check_job(cfg, 1).problems == []  # no device: a bound, no verdict
    spread = read_config(TINY, ["model.preset=llama-3-8b", "model.vocab_size=0", "parallel.tp=1", "parallel.pp=1",
                                "train.seq_len=2048", "parallel.zero=3", "train.global_batch=64", "parallel.microbatches=1"])
    assert check_job(spread, 64, device=device_preset("v100")).problems == []


def test_tp_across_nodes_is_a_warning_and_with_strict_placement_a_problem():
    cfg = read_config(TINY, ["parallel.tp=2", "parallel.pp=1"])
    report = check_job(cfg, 4, gpus_per_node=1)
    assert report.ok and any("tensor-parallel groups span nodes" in w for w in report.warnings)
    strict = read_config(TINY, ["parallel.tp=2", "parallel.pp=1", "parallel.strict_placement=true"])
    assert any("strict_placement" in p for p in check_job(strict, 4, gpus_per_node=1).problems)


def _checkpoint(directory: Path, cfg) -> Path:
    """A checkpoint file's identity (the root attributes a resume compares) for the model of ``cfg``."""
    from hpctrain.checkpoint.architecture import record

    step = directory / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    with h5py.File(step / MASTER_FILE, "w") as f:
        f.attrs.update({"format": FORMAT_NAME, "step": 2, "config": json.dumps(config_to_dict(cfg)),
                        "architecture": json.dumps(record(resolve_model(cfg.model), cfg.moe))})
    (step / "COMPLETE").write_text("")
    return step


def test_a_resume_into_another_model_is_named(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, load_config(TINY, [f"train.run_dir={run}"]))
    same = read_config(TINY, [f"train.run_dir={run}", "parallel.tp=1", "parallel.pp=1"])
    report = check_job(same, 1, resume="auto")
    assert report.ok and any("step-00000002 (step 2)" in line for line in report.summary), report
    other = read_config(TINY, [f"train.run_dir={run}", "parallel.tp=1", "parallel.pp=1", "model.d_model=96"])
    report = check_job(other, 1, resume="auto")
    assert any("model.d_model is 64 there, 96 here" in p for p in report.problems), report
    report = check_job(same, 1, resume=str(tmp_path / "nowhere"))
    assert any("cannot open" in p for p in report.problems), report


def _as_config(name: str, prediction, moe) -> list[str]:
    lay = prediction.candidate.layout
    keys = [f"model.preset={name}", "model.vocab_size=0", f"parallel.dp={lay.dp_size}", f"parallel.tp={lay.tp_size}",
            f"parallel.pp={lay.pp_size}", f"parallel.cp={lay.cp_size}", f"parallel.ep={lay.ep_size}",
            f"parallel.zero={lay.zero}", f"parallel.sequence_parallel={lay.sequence_parallel}",
            f"parallel.microbatches={lay.microbatches}", f"train.global_batch={lay.global_batch}",
            f"train.seq_len={lay.seq_len}", "train.dtype=bfloat16",
            f"train.recompute={prediction.candidate.recompute == 'full'}"]
    return keys + (["moe.num_experts=0"] if moe is None else [])


@pytest.mark.parametrize("name", ["llama-3-8b", "mixtral-8x7b", "llama-3-70b", "llama-2-13b", "gpt3-13b"])
def test_no_plan_the_planner_proposes_is_refused_by_check(name):
    model = resolve_model(ModelConfig(preset=name))
    moe = resolve_moe(MoeConfig(), model)
    machine = Machine(device_preset("h100"), links_from_bandwidth(3600, 400), 4, 8)
    result = plan(model, machine, 256, 2048, Options(), SearchSpace(recompute=("off", "full")), moe)
    assert len(result.plans) >= 20
    if moe is not None:
        assert any(p.candidate.layout.ep_size > 1 for p in result.plans[:20])
    for prediction in result.plans[:20]:
        cfg = read_config(None, _as_config(name, prediction, moe))
        report = check_job(cfg, machine.devices, machine.gpus_per_node, machine.device)
        assert report.ok and not report.warnings, (prediction.candidate, report)


def test_the_planner_keeps_tp_inside_a_node_unless_asked():
    """gpt3-175b on 128 x 8 A100 (the issue): tp <= 8 by default; tp across nodes only when allowed."""
    model = resolve_model(ModelConfig(preset="gpt3-175b"))
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 128, 8)
    space = SearchSpace(recompute=("full",), zero=(0, 1))
    result = plan(model, machine, 512, 2048, Options(), space)
    assert result.plans and all(p.candidate.layout.tp_size <= 8 for p in result.plans)
    assert result.tp_across_nodes_skipped > 0
    wide = plan(model, machine, 512, 2048, Options(), SearchSpace(recompute=("full",), zero=(0, 1),
                                                                    tp_across_nodes=True))
    assert any(p.candidate.layout.tp_size > 8 for p in wide.plans) and wide.tp_across_nodes_skipped == 0


def test_a_tp_ring_across_nodes_pays_one_nic_and_every_step_latency():
    """Issue #51 item 3: a layer's tp collective across nodes runs at one rank's NIC (not spread over the node's
    NICs, as a dp reduction is) and pays the inter-node latency on each ring step; inside a node it is the
    ordinary collective. With tp across nodes allowed, gpt3-175b on 128 x 8 A100 still plans tp <= 8 first."""
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 2, 8)
    across, inside = machine.placement(1, 16), machine.placement(1, 8)
    assert across.level == "inter" and inside.level == "intra"
    nbytes = 8 * 2048 * 12288 * 2.0
    assert machine.layer_collective_s("allreduce", nbytes, 8, inside) == machine.collective_s(
        "allreduce", nbytes, 8, inside)
    inter = machine.links.link("allreduce", "inter")
    expected = 30 * inter.alpha_s + inter.beta_s_per_byte * 2 * 15 / 16 * nbytes
    assert machine.layer_collective_s("allreduce", nbytes, 16, across) == pytest.approx(expected, rel=1e-12)
    assert machine.layer_collective_s("allreduce", nbytes, 16, across) > 7 * machine.collective_s(
        "allreduce", nbytes, 16, across)  # the dp-style model spreads it over 8 NICs
    model = resolve_model(ModelConfig(preset="gpt3-175b"))
    big = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 128, 8)
    wide = plan(model, big, 512, 2048, Options(), SearchSpace(zero=(3,), tp_across_nodes=True))
    assert wide.plans[0].candidate.layout.tp_size <= 8, wide.plans[0].candidate


def test_fp8_needs_torchao_and_warns_on_a_device_without_float8(monkeypatch):
    """train.fp8: torchao missing is a problem (a run's start refuses it); a device without float8 matmuls and no
    emulation a warning (a run's start warns and computes every linear in train.dtype); an h100 has them."""
    import hpctrain.parallel.fp8 as fp8

    cfg = read_config(TINY, ["train.fp8=tensorwise", "train.dtype=bfloat16"])
    h100 = check_job(cfg, 4, 4, device_preset("h100"))
    assert h100.ok and not h100.warnings, h100
    a100 = check_job(cfg, 4, 4, device_preset("a100"))
    assert a100.ok and [w for w in a100.warnings if "train.fp8" in w] == [
        "train.fp8: 'tensorwise' needs float8 matmuls (an sm89+ GPU: h100, h200), which --device a100 has not: "
        "every linear would compute in train.dtype; train.fp8_emulate=true (the same casts, not a speed path) or "
        "train.fp8='none'"], a100
    emulated = read_config(TINY, ["train.fp8=tensorwise", "train.dtype=bfloat16", "train.fp8_emulate=true"])
    assert not check_job(emulated, 4, 4, device_preset("a100")).warnings
    monkeypatch.setattr(fp8, "torchao_problem", lambda: "needs torchao==0.18.0, which is not installed")
    missing = check_job(cfg, 4, 4, device_preset("h100"))
    assert missing.problems == ["train.fp8: 'tensorwise' needs torchao==0.18.0, which is not installed"]
