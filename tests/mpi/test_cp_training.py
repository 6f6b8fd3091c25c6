"""Context parallelism in training (``parallel.cp``) on real ranks: every cp layout trains like one process
(float64: losses and final parameters 1e-10) alone and with tp, SP, pp, dp, ZeRO-1, GQA, a sliding window,
recomputation and learned positions; checkpoints resume across cp sizes; bad cp input is one line on
every rank; the ring's overlap shows in `hpctrain trace`; a rank stopped inside the ring is named."""
import json
import re
import subprocess
import sys

import pytest

from mpirun import ROOT, FidelityRuns, mpi_env, mpiexec, run_mpi
from test_checkpoint import F64, run_chain
from test_checkpoint import losses as step_losses
from test_checkpoint import train
from test_hang_report import run_with_fault

EXACT = ["--param-rtol", "1e-10", "--rtol", "1e-10"]


# name: (world size, layouts "dp,tp,pp,cp", variants, *options and overrides) of scripts/check_fidelity.py; one
# launch per world size (tests/mpirun.py: FidelityRuns)
RUNS = {
    "cp alone and with tp, pp, dp": (4, "1,1,1,4;1,2,1,2;1,1,2,2;2,1,1,2", "1f1b,sp,zero1/gpipe", *EXACT),
    "window and recompute": (4, "1,1,1,4;1,2,1,2", "1f1b,sp", *EXACT, "model.attention_window=5",
                             "train.recompute=true"),
    "learned positions": (4, "1,2,1,2;1,1,2,2", "sp,zero1", *EXACT, "model.positions=learned", "model.mlp=gelu",
                          "model.tie_embeddings=true"),
    "8 ranks": (8, "2,2,1,2;1,2,2,2", "1f1b,sp,zero1", *EXACT, "model.attention_window=6"),
    "bfloat16": (2, "1,1,1,2", "1f1b", "--dtype", "bfloat16", "--rtol", "2e-2"),
}


@pytest.fixture(scope="module")
def launched():
    runs = FidelityRuns(RUNS)

    def checked(name):
        """The number of layouts/variants checked, every one with cp."""
        out = runs(name)
        assert all(" cp=" in line for line in out.splitlines() if line.startswith("OK dp="))
        return out.count("OK dp=")

    return checked


def test_cp_alone_and_with_tp_pp_dp_zero1_equals_one_process(launched):
    """cp=4; cp=2 x tp=2; cp=2 x pp=2; cp=2 x dp=2 (gradients over dp x cp), each with 1F1B + SP + ZeRO-1
    (sharded over dp x cp) and GPipe; GQA (8 query heads, 4 KV heads)."""
    assert launched("cp alone and with tp, pp, dp") == 8


def test_cp_with_a_sliding_window_recompute_and_learned_positions_equals_one_process(launched):
    """A window of 5 tokens over 16 (the ring skips blocks outside it), recomputation; then GPT-style
    learned positions (each cp rank adds its zig-zag rows of the table), tied embeddings."""
    assert launched("window and recompute") == 2
    assert launched("learned positions") == 2


def test_eight_ranks_every_axis_at_once(launched):
    """dp=2 x tp=2 x cp=2 and tp=2 x pp=2 x cp=2 with SP, ZeRO-1 and a window."""
    assert launched("8 ranks") == 2


def test_bfloat16_keeps_float32_softmax_statistics(launched):
    """bfloat16 with cp=2 follows bfloat16 on one process (the ring merges in float32: close, not exact)."""
    assert launched("bfloat16") == 1


def test_checkpoints_resume_across_cp_sizes(tmp_path):
    """cp=2 -> cp=1 -> cp=4 x tp=2 -> dp=2 x cp=2 with ZeRO-1 -> cp=2 x pp=2, 2 steps
    each: every step's loss equals one uninterrupted process to 1e-10 and the final weights too (checkpoints
    hold global tensors, whatever cp wrote them)."""
    reference = tmp_path / "reference"
    train(1, reference, *F64, "parallel.pp=1", "parallel.tp=1", "parallel.microbatches=1", "train.steps=10")
    chain = [(2, ["parallel.pp=1", "parallel.cp=2"]),
             (1, ["parallel.pp=1"]),
             (8, ["parallel.pp=1", "parallel.tp=2", "parallel.cp=4", "parallel.sequence_parallel=true"]),
             (4, ["parallel.pp=1", "parallel.cp=2", "parallel.zero=1"]),
             (4, ["parallel.pp=2", "parallel.cp=2"])]  # 5 segments of 2 steps: the reference's 10
    run_chain(tmp_path / "chain", reference, step_losses(reference), chain, "train.steps=10")


# bad context-parallel input on 4 ranks: tests/mpi/test_train_cli.py::test_bad_config_fails_clearly_on_every_rank


def test_cp_with_heads_that_cannot_split_over_tp_is_refused_before_the_grid():
    """cp=2 x tp=4 on 8 ranks with 2 KV heads: the heads split over tp (the sequence over cp) cannot."""
    from hpctrain.config import load_config
    from hpctrain.config.layout import Layout, LayoutError

    cfg = load_config(None, ["parallel.cp=2", "parallel.tp=4", "model.n_heads=4", "model.n_kv_heads=2",
                             "train.seq_len=16"])
    with pytest.raises(LayoutError, match=r"model\.n_kv_heads=2 is not divisible by parallel\.tp=4"):
        Layout.from_config(cfg, 8)


def test_the_trace_shows_the_ring_overlapped_with_compute(tmp_path):
    run = tmp_path / "run"
    run_mpi(4, "hpctrain.cli", "train", "--config", "configs/tiny.toml", "parallel.pp=1", "parallel.tp=2",
            "parallel.cp=2", "parallel.sequence_parallel=true", "train.seq_len=128", "train.steps=4",
            "train.trace=true", "train.trace_steps=2", f"train.run_dir={run}", "train.progress=false",
            module=True, timeout=240)
    result = subprocess.run([sys.executable, "-m", "hpctrain.cli", "trace", str(run)], cwd=ROOT, env=mpi_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^rank .* cp comm .* tp comm", result.stdout, re.M), result.stdout
    hidden = re.search(r"non-blocking calls on cp: (\d+)-(\d+)% of their time in flight was hidden", result.stdout)
    assert hidden and int(hidden.group(2)) > 0, result.stdout
    events = json.loads((run / "trace" / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    ring = [e for e in events if e.get("cat") == "inflight" and e.get("args", {}).get("group") == "cp"]
    compute = [e for e in events if e.get("cat") == "phase" and e["name"] in ("forward", "backward")]
    inside = [r for r in ring if any(c["pid"] == r["pid"] and c["ts"] <= r["ts"] and
                                     r["ts"] + r["dur"] <= c["ts"] + c["dur"] for c in compute)]
    assert ring and len(inside) == len(ring), (len(ring), len(inside))  # every ring pass flies during compute


def test_a_rank_stopped_inside_the_ring_is_named(tmp_path):
    """cp=4: rank 1 stops before step 3's forward; its ring neighbours wait in the cp exchange and the
    report names it (within comm.timeout_s + 30 s)."""
    code, stderr, seconds = run_with_fault(tmp_path / "run", "rank=1,step=3,phase=forward,action=stop",
                                           "parallel.pp=1", "parallel.cp=4", "train.seq_len=64",
                                           "checkpoint.interval=0")
    assert code != 0 and seconds < 8 + 30, (code, seconds, stderr[-3000:])
    assert stderr.count("hpctrain: hang report from") == 1, stderr[-3000:]
    assert re.search(r"on group 'cp' \(world ranks \[0, 1, 2, 3\]\)", stderr), stderr[-3000:]
    cause = re.search(r"  cause: rank 1 \(node 0 \S+, pid \d+\): (.*)", stderr)
    assert cause and "stopped (SIGSTOP" in cause.group(1), stderr[-3000:]


def test_bench_long_context_records_activation_memory_falling_with_cp(tmp_path):
    """benchmarks/bench_long_context.py end to end (cp = 1 and 2, one short length): the records, and the
    activation memory per rank at cp = 2 about half of cp = 1's (a smoke test: never speed)."""
    out = tmp_path / "lc.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_long_context.py"), "--cps", "1,2",
                             "--seq-lens", "128", "--preset", "tiny", "--steps", "1", "--warmup", "0",
                             "--mpiexec", " ".join(mpiexec()), "--json", str(out)], cwd=ROOT, env=mpi_env(),
                            capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    records = {r["cp"]: r for r in json.loads(out.read_text())}
    assert set(records) == {1, 2} and records[1]["act_vs_cp1"] == 1.0
    assert 0.4 < records[2]["act_vs_cp1"] < 0.6, records
    assert all(r["step_s"] > 0 and r["peak_mb"] > 0 for r in records.values())
