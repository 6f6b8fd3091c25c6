"""`hpctrain sweep --launcher sbatch` on a real (local) Slurm: every run is a job from
slurm/scaling_study.sbatch; the sweep waits for them, reads their exit codes and collects the CSV."""
import csv
import os
import subprocess
import sys
from pathlib import Path

from mpirun import ROOT, mpi_env


def test_sweep_submits_one_job_per_run_and_collects_them(slurm, tmp_path):
    env = mpi_env(slurm)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    out = tmp_path / "study"
    result = subprocess.run(
        [sys.executable, "-m", "hpctrain.cli", "sweep", "--config", "configs/tiny.toml", "--out", str(out),
         "--launcher", "sbatch", "--ranks", "2,4", "--layouts", "tp=1,pp=1;tp=2,pp=1", "--ranks-per-node", "2",
         "--steps", "3", "--timeout", "300", "--sbatch-arg=--time=10", "data.max_bytes=200000",
         "train.seq_len=32", "model.n_layers=2"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=400, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "submitted 4 jobs" in result.stdout
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [r["name"] for r in rows] == ["r2-dp2-tp1-pp1-mb1", "r2-dp1-tp2-pp1-mb1", "r4-dp4-tp1-pp1-mb1",
                                         "r4-dp2-tp2-pp1-mb1"]
    assert all(r["status"] == "ok" and r["steps"] == "3" for r in rows), rows
    for r in rows:
        run_dir = out / r["name"]
        assert (run_dir / "exit_code").read_text().strip() == "0"
        log = next(run_dir.glob("slurm-*.out")).read_text()
        assert f"dp={r['dp']} x pp=1 x tp={r['tp']}" in log, log[-2000:]
    four = (out / "r4-dp4-tp1-pp1-mb1" / next((out / "r4-dp4-tp1-pp1-mb1").glob("slurm-*.out")).name).read_text()
    assert "2 nodes" in four or "nodes=2" in four or "on 2 node" in four, four[-2000:]
