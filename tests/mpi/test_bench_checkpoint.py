"""benchmarks/bench_checkpoint.py runs end to end on 2 ranks (a smoke test: it asserts records, never speed)."""
import csv
import json

import h5py

from mpirun import ROOT, run_mpi

TINY = ["--mib-per-rank", "0.5", "--tensors", "4", "--cols", "256", "--repeats", "1", "--async-repeats", "1",
        "--base-steps", "1", "--model", "tiny", "--seq-len", "16", "--max-bytes", "300000"]


def test_bench_checkpoint_writes_positive_records(tmp_path):
    out_json, out_csv, work = tmp_path / "bench.json", tmp_path / "bench.csv", tmp_path / "work"
    result = run_mpi(2, str(ROOT / "benchmarks" / "bench_checkpoint.py"), *TINY, "--dir", str(work),
                     "--json", str(out_json), "--csv", str(out_csv), timeout=300)
    records = json.loads(out_json.read_text())
    ops = {(r["impl"], r["op"]) for r in records}
    writers = ["shards"] + (["mpio"] if h5py.get_config().mpi else [])
    io = {("dd", "write"), ("dd", "read"), ("torch.save", "write"), ("torch.load", "read")}
    io |= {(f"hpctrain-{w}", op) for w in writers for op in ("write", "read", "save")}
    assert io <= ops, ops
    assert {("hpctrain", op) for op in ("sync save (Trainer)", "async save: stall", "async save: background write",
                                        "async save + wait, no training", "train step, no save pending",
                                        "restart: build grid + Trainer", "restart: resume (open+read+CRC+apply)",
                                        "restart: first step after resume", "restart: resume + first step",
                                        "first step, no resume")} <= ops, ops
    for r in records:
        assert r["ranks"] == 2 and r["repeats"] >= 1 and r["seconds"] > 0, r
        assert r["seconds_min"] <= r["seconds"] <= r["seconds_max"], r
        if (r["impl"], r["op"]) in io:
            assert r["bytes"] > 0 and r["GBps"] > 0 and r["ratio_vs_dd"] > 0, r
        if r["op"] == "save":
            assert r["phases"]["write"] > 0 and r["phases"]["fsync"] > 0 and r["phases"]["verify"] > 0, r
            assert len(r["phases_by_rank"]) == 2, r
    by_op = {(r["impl"], r["op"]): r for r in records}
    stall = by_op[("hpctrain", "async save: stall")]
    assert stall["ratio"] > 0 and stall["ratio_to"] == "sync save" and stall["phases"]["stall (wait + snapshot)"] > 0, stall
    assert by_op[("hpctrain", "sync save (Trainer)")]["bytes"] > 0
    assert by_op[("hpctrain", "restart: resume + first step")]["ratio"] > 0
    assert len(list(csv.DictReader(out_csv.open()))) == len(records)
    assert "vs dd" in result.stdout and "target:" in result.stdout
    assert list(work.iterdir()) == []  # the benchmark's files are removed


def test_bench_checkpoint_sleeping_waits_uses_the_managers_hook(tmp_path):
    """``--sleeping-waits`` builds every manager with ``poll_sleep_s`` (a documented hook, nothing patched):
    the I/O part still saves, verifies and publishes, and its agreements are timed."""
    out_json = tmp_path / "bench.json"
    run_mpi(2, str(ROOT / "benchmarks" / "bench_checkpoint.py"), *TINY, "--parts", "io", "--writers", "shards",
            "--sleeping-waits", "--dir", str(tmp_path / "work"), "--json", str(out_json), timeout=300)
    save = next(r for r in json.loads(out_json.read_text()) if r["op"] == "save")
    assert save["impl"] == "hpctrain-shards" and save["seconds"] > 0, save
    assert save["phases"]["agree"] > 0 and save["phases"]["publish"] > 0, save
