"""The performance model against measurement on this machine: a measured profile, then every layout of
2 ranks trained by `hpctrain sweep`, each step time compared with the model's prediction (docs/scaling.md
has the 4-rank table; 2 ranks do not oversubscribe the 2 cores CI has)."""
import csv
import statistics
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env, run_mpi

SMALL = ["model.preset=small", "train.seq_len=128", "data.max_bytes=400000"]


@pytest.mark.alone  # a measured profile against measured step times
def test_model_predicts_every_2_rank_layout(tmp_path):
    profile = tmp_path / "profile.json"
    run_mpi(2, "hpctrain.cli", "bench", "comm", "--profile", str(profile), "--sizes", "4K,64K,1M,4M",
            "--rounds", "1", "--iters", "5", module=True, timeout=150)
    out = tmp_path / "sweep"
    sweep = subprocess.run([sys.executable, "-m", "hpctrain.cli", "sweep", "--config", "configs/tiny.toml",
                            "--ranks", "2", "--layouts", "auto", "--mode", "strong", "--steps", "6",
                            "--out", str(out), "--profile", str(profile), *SMALL], capture_output=True, text=True,
                           env=mpi_env(), cwd=ROOT, timeout=400, stdin=subprocess.DEVNULL)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert {(r["dp"], r["tp"], r["pp"]) for r in rows} == {("2", "1", "1"), ("1", "2", "1"), ("1", "1", "2")}
    errors = {r["name"]: float(r["prediction_error"]) for r in rows}
    print("prediction errors:", {k: f"{v:+.0%}" for k, v in errors.items()})
    assert all(abs(e) <= 0.5 for e in errors.values()), errors  # far off: the model is broken
    assert statistics.median(abs(e) for e in errors.values()) <= 0.35, errors
