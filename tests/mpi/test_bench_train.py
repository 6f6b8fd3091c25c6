"""benchmarks/bench_train.py runs end to end on 2 ranks (a smoke test: it asserts records, never speed)."""
import csv
import json
import math

import pytest

from hpctrain.parallel.schedules import idle_per_rank, timeline
from mpirun import ROOT, run_mpi

TINY = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--d-model", "32", "--layers", "2", "--heads", "2",
        "--seq-len", "16", "--global-batch", "8", "--max-bytes", "300000"]


def test_bench_train_writes_positive_records(tmp_path):
    out_json, out_csv = tmp_path / "bench.json", tmp_path / "bench.csv"
    result = run_mpi(2, str(ROOT / "benchmarks" / "bench_train.py"), *TINY, "--json", str(out_json),
                     "--csv", str(out_csv), timeout=180)
    records = json.loads(out_json.read_text())
    assert {(r["impl"], r["tp"], r["pp"]) for r in records} == {
        ("hpctrain", 1, 1), ("ddp-gloo", 1, 1), ("hpctrain", 2, 1), ("hpctrain", 1, 2)}
    for r in records:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["ratio_vs_ddp"] > 0, r
        assert r["timed_steps"] == 2 and r["ranks"] == 2 and r["phases_ms"], r
    losses = [r["final_loss"] for r in records]  # same model, data and optimizer: the same training
    assert max(losses) - min(losses) < 1e-3 * max(losses), losses
    assert len(list(csv.DictReader(out_csv.open()))) == len(records)
    assert "ratio vs ddp-gloo" in result.stdout


def test_bench_pipeline_trains_the_same_model_in_every_schedule(tmp_path):
    """benchmarks/bench_pipeline.py on 2 ranks: 1f1b, interleaved V=2 and zb-h1 records; equal final losses (the
    same training, whatever the schedule); the bubble column is (pp - 1) / (V M). With a measured profile
    every row carries the performance model's prediction: finite, positive, the interleaved bubble smaller,
    and within a factor of 2 of the measurement (a broken model, not timing precision: these shapes are
    all overhead)."""
    profile, out_json, out_csv = tmp_path / "profile.json", tmp_path / "pipe.json", tmp_path / "pipe.csv"
    run_mpi(2, "hpctrain.cli", "bench", "comm", "--profile", str(profile), "--ops", "allreduce,sendrecv",
            "--sizes", "4K,64K", "--rounds", "1", "--iters", "5", module=True, timeout=150)
    result = run_mpi(2, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--steps", "1", "--warmup", "1",
                     "--rounds", "1", "--d-model", "32", "--layers", "4", "--heads", "2", "--seq-len", "16",
                     "--max-bytes", "300000", "--virtual", "2,4", "--zero-bubble", "zb-h1", "--profile", str(profile),
                     "--json", str(out_json),
                     "--csv", str(out_csv), timeout=180)
    records = json.loads(out_json.read_text())
    schedules = [(r["schedule"], r["virtual_stages"]) for r in records]
    assert schedules == [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]  # 2x4 > 4 layers: no V=4
    assert [r["bubble"] for r in records] == pytest.approx([0.5, 0.25, 1 / 6])
    assert all(r["step_ms"] > 0 for r in records)
    final = [r["final_loss"] for r in records]
    assert max(final) - min(final) < 1e-5 * final[0]
    for r in records:  # each rank's idle time (pp_wait + pp_drain), the mean theirs; zb-h1's against 1f1b's
        assert len(r["bubble_ms_by_rank"]) == len(r["pp_wait_ms_by_rank"]) == 2, r  # (issue #53's bubble target)
        assert r["bubble_ms"] == pytest.approx(sum(r["bubble_ms_by_rank"]) / 2), r
        assert r["pp_wait_ms"] == pytest.approx(sum(r["pp_wait_ms_by_rank"]) / 2), r
        assert r["pp_drain_ms"] > 0, r  # one timed step: each rank's median idle is its pp_wait + pp_drain
        assert r["bubble_ms"] == pytest.approx(r["pp_wait_ms"] + r["pp_drain_ms"]), r
    # the order's own idle at the run's action times (no timing asserted: these shapes are all overhead, and W
    # may cost more than F here): 1F1B's rank idles (pp - 1)(F + B) of one micro-batch (M = 2); zb-h1's is its
    # timeline's at its own F, B and W per micro-batch
    f1b, zb = records[0], records[2]
    assert f1b["bubble_model_ms"] == pytest.approx((f1b["forward_ms"] + f1b["backward_ms"]) / 2, rel=1e-3), f1b
    per_action_us = [round(zb[f"{name}_ms"] * 1e3 / 2) for name in ("forward", "backward", "weight")]
    idle = sum(idle_per_rank(timeline("zb-h1", 2, 2, 1, *per_action_us))) / 2 / 1e3
    assert zb["bubble_model_ms"] == pytest.approx(idle, rel=1e-3) and idle > 0, (zb, idle)
    assert "model" in result.stdout
    assert records[0]["bubble_ratio"] is None and records[1]["pp_wait_ratio"] is None
    assert records[2]["bubble_ratio"] == pytest.approx(records[2]["bubble_ms"] / records[0]["bubble_ms"])
    assert records[2]["pp_wait_ratio"] == pytest.approx(records[2]["pp_wait_ms"] / records[0]["pp_wait_ms"])
    for r in records:
        assert math.isfinite(r["predicted_ms"]) and r["predicted_ms"] > 0, r
        assert r["prediction_error"] == pytest.approx(r["predicted_ms"] / r["step_ms"] - 1), r
        assert abs(r["prediction_error"]) < 1.0, r
    assert 0 < records[1]["predicted_bubble_ms"] < records[0]["predicted_bubble_ms"], records
    rows = list(csv.DictReader(out_csv.open()))
    assert [float(row["predicted_ms"]) for row in rows] == pytest.approx([r["predicted_ms"] for r in records])
    assert "pred ms" in result.stdout and "error" in result.stdout


def test_bench_zero_trains_the_same_model_in_every_stage_and_fsdp2(tmp_path):
    """benchmarks/bench_zero.py on 2 ranks: every ZeRO stage and FSDP2 train the same model to the same loss;
    the model state a rank keeps shrinks stage by stage, ZeRO-3's to FSDP2's."""
    out_json = tmp_path / "zero.json"
    result = run_mpi(2, str(ROOT / "benchmarks" / "bench_zero.py"), "--steps", "1", "--warmup", "1", "--rounds",
                     "1", "--d-model", "32", "--layers", "2", "--heads", "2", "--vocab", "512", "--seq-len", "16",
                     "--global-batch", "4", "--max-bytes", "300000", "--json", str(out_json), timeout=240)
    records = {r["impl"]: r for r in json.loads(out_json.read_text())}
    assert set(records) == {"hpctrain-zero0", "hpctrain-zero1", "hpctrain-zero2", "hpctrain-zero3", "fsdp2-gloo"}
    losses = [r["final_loss"] for r in records.values()]
    assert max(losses) - min(losses) < 1e-4 * max(losses), losses
    state = [records[f"hpctrain-zero{z}"]["state_mb"] for z in range(4)]
    assert state[0] > state[1] > state[2] > state[3], state
    assert state[3] == pytest.approx(records["fsdp2-gloo"]["state_mb"], rel=0.05)
    assert all(r["step_ms"] > 0 and r["peak_mb"] > 0 and r["mb_sent_per_step"] > 0 for r in records.values())
    assert all(r["run_peak_mb"] >= r["peak_mb"] for r in records.values())  # the build counted too
    assert "ratio vs fsdp2" in result.stdout
    whole = run_mpi(2, str(ROOT / "benchmarks" / "bench_zero.py"), "--process-peak", "--impls", "hpctrain-zero3",
                    "--d-model", "32", "--layers", "2", "--heads", "2", "--vocab", "512", "--seq-len", "16",
                    "--global-batch", "4", "--max-bytes", "300000", "--json", str(out_json), timeout=240)
    (record,) = json.loads(out_json.read_text())
    assert record["impl"] == "hpctrain-zero3" and "whole-process peak" in whole.stdout
    assert record["process_peak_mb"] > 100  # the interpreter, torch and MPI included: never reset
    assert 0 < record["final_loss"] < 20 and record["state_mb"] == pytest.approx(records["hpctrain-zero3"]["state_mb"])
