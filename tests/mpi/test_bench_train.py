"""benchmarks/bench_train.py runs end to end on 2 ranks (a smoke test: it asserts records, never speed)."""
import csv
import json

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
    """benchmarks/bench_pipeline.py on 2 ranks: 1f1b and interleaved V=2 records; equal final losses (the
    same training, whatever the schedule); the bubble column is (pp - 1) / (V M)."""
    out_json = tmp_path / "pipe.json"
    run_mpi(2, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--steps", "1", "--warmup", "1", "--rounds", "1",
            "--d-model", "32", "--layers", "4", "--heads", "2", "--seq-len", "16", "--max-bytes", "300000",
            "--virtual", "2,4", "--json", str(out_json), timeout=180)
    records = json.loads(out_json.read_text())
    assert [(r["schedule"], r["virtual_stages"]) for r in records] == [("1f1b", 1), ("interleaved", 2)]  # 2x4 > 4
    assert [r["bubble"] for r in records] == [0.5, 0.25] and all(r["step_ms"] > 0 for r in records)
    assert abs(records[0]["final_loss"] - records[1]["final_loss"]) < 1e-5 * records[0]["final_loss"]
