"""`hpctrain sweep` end to end with mpiexec: runs, CSV, plots, --resume, a failing run, no overwrites."""
import csv
import subprocess
import sys

from mpirun import ROOT, mpi_env

FAST = ["data.max_bytes=200000", "train.seq_len=32", "model.n_layers=2"]


def sweep(out, *args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "sweep", "--config", "configs/tiny.toml",
                           "--out", str(out), "--steps", "4", *args, *FAST], capture_output=True, text=True,
                          env=mpi_env(env), cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


def rows(out):
    return list(csv.DictReader(open(out / "sweep.csv")))


def test_sweep_runs_collects_plots_and_resumes(tmp_path):
    out = tmp_path / "study"
    first = sweep(out, "--ranks", "1,2", "--layouts", "tp=1,pp=1;tp=1,pp=2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "skipped 1 ranks tp=1 pp=2" in first.stdout
    table = rows(out)
    assert [r["name"] for r in table] == ["r1-dp1-tp1-pp1-mb1", "r2-dp2-tp1-pp1-mb1", "r2-dp1-tp1-pp2-mb4"]
    for r in table:
        assert r["status"] == "ok" and float(r["step_s"]) > 0 and float(r["tokens_per_s"]) > 0, r
        assert float(r["compute_s"]) > 0 and r["steps"] == "4"
    assert float(table[2]["bubble_s"]) > 0 and table[1]["global_batch"] == str(2 * int(table[0]["global_batch"]))
    assert float(table[0]["efficiency"]) == 1.0
    for png in ("throughput.png", "efficiency.png", "breakdown.png"):
        assert (out / png).stat().st_size > 1000

    again = sweep(out, "--ranks", "1,2", "--layouts", "tp=1,pp=1;tp=1,pp=2")  # never reuses silently
    assert again.returncode != 0 and "pass --resume" in again.stdout + again.stderr
    (out / "r2-dp1-tp1-pp2-mb4" / "summary.json").unlink()  # as if that run had been cut short
    resumed = sweep(out, "--ranks", "1,2", "--layouts", "tp=1,pp=1;tp=1,pp=2", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.count(": running") == 1  # only the unfinished run ran again
    assert (out / "r2-dp1-tp1-pp2-mb4.incomplete-1" / "metrics.jsonl").exists()  # moved aside, not deleted


def test_a_killed_rank_fails_its_run_not_the_sweep(tmp_path):
    """Rank 1 is SIGKILLed in step 2 of every run: each run is reported failed, the others still run, the
    CSV is written, and the sweep exits 1."""
    out = tmp_path / "bad"
    result = sweep(out, "--ranks", "2", "--layouts", "tp=1,pp=1;tp=2,pp=1", "--timeout", "60", timeout=200,
                   env={"HPCTRAIN_FAULT": "rank=1,step=2,phase=forward,action=kill"})
    assert result.returncode == 1, result.stdout + result.stderr
    table = rows(out)
    assert len(table) == 2 and all(r["status"].startswith("exit ") for r in table), table
    assert "sweep.log" in table[0]["status"]
