"""Where the time goes, in real training: the per-step phase breakdown and per-group communication in
metrics.jsonl, the per-rank Chrome traces of ``train.trace``, and ``hpctrain trace`` naming a slow rank."""
import json
import subprocess
import sys

import pytest
from mpirun import ROOT, mpi_env, run_mpi

PHASES = {"data", "forward", "backward", "pp_wait", "dp_wait", "loss", "grad_norm", "optimizer", "other", "sync"}


def records(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"event"' not in line]


def trace_report(run_dir, *args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "trace", str(run_dir), *args], capture_output=True,
                          text=True, env=mpi_env(), cwd=ROOT, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.alone  # rank 0's wait for the sleeping rank: a loaded machine can delay rank 0 as long
def test_breakdown_traces_and_the_slow_rank(tmp_path):
    """4 ranks, dp=2 x pp=2 with 2 micro-batches; rank 1 sleeps 0.6 s in step 3 (inside the traced window)."""
    run_mpi(4, "hpctrain.cli", "train", f"train.run_dir={tmp_path}", "parallel.pp=2", "parallel.microbatches=2",
            "train.steps=7", "train.progress=false", "train.trace=true", "train.trace_steps=4",
            "checkpoint.interval=3", module=True, timeout=120,
            env={"HPCTRAIN_FAULT": "rank=1,step=3,phase=optimizer,action=sleep:0.6"})
    steps = records(tmp_path)
    assert len(steps) == 7
    for r in steps:
        assert PHASES <= set(r["time_s"]), r["time_s"]
        inside = sum(v for k, v in r["time_s"].items() if k not in ("checkpoint", "sync"))
        assert abs(inside - r["step_time_s"]) <= 0.02 * r["step_time_s"] + 1e-4, r  # phases add up to the step
        assert set(r["groups"]) >= {"dp", "pp", "world"}, r["groups"]
        assert sum(g["bytes_sent"] for g in r["groups"].values()) == r["bytes_sent"]
        assert abs(sum(g["comm_s"] for g in r["groups"].values()) - r["comm_time_s"]) < 1e-4
    assert "checkpoint" in steps[2]["time_s"] and "checkpoint" not in steps[1]["time_s"]  # the save after step 3

    files = sorted(p.name for p in (tmp_path / "trace").iterdir())
    assert files == [f"rank{r:05d}.json" for r in range(4)], files
    doc = json.loads((tmp_path / "trace" / "rank00002.json").read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["step"] for e in events if e["cat"] == "step") == [2, 3, 4, 5]
    comms = [e for e in events if e["cat"] in ("blocked", "inflight")]
    assert {e["args"]["group"] for e in comms} >= {"dp", "pp", "world"}
    assert all(e["dur"] >= 0 and (e["args"]["bytes"] > 0 or e["name"] == "drain") for e in comms)
    drains = [e for e in comms if e["name"] == "drain"]  # the pipeline's drain: once a training step, on pp
    assert len(drains) == 4 and all(e["args"]["group"] == "pp" and e["cat"] == "blocked" for e in drains)
    assert {e["name"] for e in events if e["cat"] == "phase"} >= PHASES - {"other"} | {"checkpoint"}
    assert max(r["step_time_s"] for r in steps[3:5]) > 0.4  # rank 0 waits for the sleeping rank 1 in step 4

    report = trace_report(tmp_path)
    assert report.returncode == 0, report.stderr
    assert "slowest rank: 1 " in report.stdout and "merged trace" in report.stdout, report.stdout
    assert "other takes" in report.stdout, report.stdout  # the sleep is in no phase
    merged = json.loads((tmp_path / "trace" / "trace.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1, 2, 3}
    rows = json.loads(trace_report(tmp_path, "--json").stdout)["ranks"]
    assert [r["rank"] for r in rows] == [0, 1, 2, 3] and all(r["compute"] >= 0 for r in rows), rows
    assert rows[1]["compute"] > 0.1 and rows[1]["phases"]["other"] > 0.1, rows[1]  # 0.6 s / 4 steps, in no phase
    for r in (rows[0], rows[2], rows[3]):  # the others wait for rank 1 in communication
        assert sum(r["comm"].values()) + r["bubble"] > 0.1, r


def test_trace_of_a_run_without_one_says_how(tmp_path):
    report = trace_report(tmp_path)
    assert report.returncode != 0 and "train.trace=true" in report.stderr + report.stdout


def test_zero3_prefetched_gathers_are_in_flight_while_units_compute(tmp_path):
    """ZeRO-3 (dp=2, prefetch 1): the trace holds all-gathers on dp that were in flight (not waited for)
    inside a forward and a backward phase; the time a hook waited for one shows as blocked ("wait allgather").
    Through MPI: with ``comm.intra_node = auto`` a start-up measurement on this machine may give the gathers'
    sizes to the shared-memory route, whose calls complete inside the call (nothing in flight)."""
    run_mpi(2, "hpctrain.cli", "train", f"train.run_dir={tmp_path}", "parallel.zero=3", "comm.intra_node=mpi",
            "train.steps=3",
            "train.progress=false", "train.trace=true", "train.trace_steps=2", "model.n_layers=4", module=True,
            timeout=120)
    events = [e for e in json.loads((tmp_path / "trace" / "rank00000.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    gathers = [e for e in events if e["name"] == "allgather" and e["args"]["group"] == "dp"]
    assert gathers and all(e["cat"] == "inflight" for e in gathers), gathers
    assert any(e["name"] == "wait allgather" and e["cat"] == "blocked" for e in events)

    def inside(event, phase):
        return any(p["ts"] <= event["ts"] and event["ts"] + event["dur"] <= p["ts"] + p["dur"]
                   for p in events if p["cat"] == "phase" and p["name"] == phase)

    in_flight = [e for e in gathers if e["cat"] == "inflight"]
    assert any(inside(e, "forward") for e in in_flight) and any(inside(e, "backward") for e in in_flight)
