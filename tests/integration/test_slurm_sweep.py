"""`hpctrain sweep --launcher sbatch` on a real (local) Slurm: every run is a job from
slurm/scaling_study.sbatch; the sweep waits for them, reads their exit codes and collects the CSV. A job
that never reaches its first step (here: the first launch's rank 0 stalls before the process grid is built,
as behind a launch stuck in Slurm's pmi2 plugin) is cancelled and resubmitted, and its run still lands."""
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
    # one launch (whichever starts first) stalls at start-up; HPCTRAIN_FAULT_ONCE makes every other one clean
    env.update(HPCTRAIN_FAULT="rank=0,step=0,phase=launch,action=sleep:900",
               HPCTRAIN_FAULT_ONCE=str(tmp_path / "stalled-once"))
    result = subprocess.run(
        [sys.executable, "-m", "hpctrain.cli", "sweep", "--config", "configs/tiny.toml", "--out", str(out),
         "--launcher", "sbatch", "--ranks", "2,4", "--layouts", "tp=1,pp=1;tp=2,pp=1", "--ranks-per-node", "2",
         "--steps", "3", "--timeout", "360", "--start-timeout", "40", "--sbatch-arg=--time=10",
         "data.max_bytes=200000", "comm.timeout_s=600",
         "train.seq_len=32", "model.n_layers=2"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=480, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "submitted 4 jobs" in result.stdout
    assert (tmp_path / "stalled-once").exists()
    stalled = [line for line in result.stdout.splitlines() if "never got through MPI's start-up" in line]
    assert len(stalled) == 1 and "resubmitted as job" in stalled[0] and "resubmission 1 of 2" in stalled[0], \
        result.stdout
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [r["name"] for r in rows] == ["r2-dp2-tp1-pp1-mb1", "r2-dp1-tp2-pp1-mb1", "r4-dp4-tp1-pp1-mb1",
                                         "r4-dp2-tp2-pp1-mb1"]
    assert all(r["status"] == "ok" and r["steps"] == "3" for r in rows), rows
    for r in rows:
        run_dir = out / r["name"]
        assert (run_dir / "exit_code").read_text().strip() == "0"
        log = _last_job_log(run_dir).read_text()
        assert f"dp={r['dp']} x pp=1 x tp={r['tp']}" in log, log[-2000:]
    four = _last_job_log(out / "r4-dp4-tp1-pp1-mb1").read_text()
    assert "2 nodes" in four or "nodes=2" in four or "on 2 node" in four, four[-2000:]


def _last_job_log(run_dir: Path) -> Path:
    """The Slurm output of the run's last job (a resubmitted run has one per job)."""
    return max(run_dir.glob("slurm-*.out"), key=lambda p: int(p.stem.split("-")[1]))
