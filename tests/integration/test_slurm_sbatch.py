"""slurm/train.sbatch on a real (local) Slurm: a job trains; a second submission resumes where it stopped."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mpirun import ROOT, mpi_env

FAST = ["--config", "configs/tiny.toml", "data.max_bytes=300000", "train.seq_len=32", "model.n_layers=2",
        "train.steps=4", "checkpoint.async=false", "parallel.pp=1"]


def sbatch_and_wait(slurm_env, run_dir, *args, timeout=240):
    env = mpi_env(slurm_env)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    out = run_dir.parent / f"{run_dir.name}-%j.out"
    submit = subprocess.run(["sbatch", "--parsable", "--wait", f"--output={out}", "--ntasks-per-node=2",
                             "--time=10", str(ROOT / "slurm" / "train.sbatch"), *FAST,
                             f"train.run_dir={run_dir}", *args],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    job = submit.stdout.strip().split(";")[0]
    log = Path(str(out).replace("%j", job))
    text = log.read_text() if log.exists() else ""
    assert submit.returncode == 0, f"sbatch exit {submit.returncode}: {submit.stderr}\n{text}"
    return text


def test_sbatch_template_trains_and_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    first = sbatch_and_wait(slurm, run_dir, "--max-steps", "2")
    assert "dp=1 x pp=1 x tp=2" in first
    second = sbatch_and_wait(slurm, run_dir)  # no --resume: auto inside a batch job
    assert "resumed from" in second and "at step 2" in second
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "event" not in r]
    assert steps == [1, 2, 3, 4]
