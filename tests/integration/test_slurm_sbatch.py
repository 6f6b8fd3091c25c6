"""slurm/train.sbatch on a real (local) Slurm: a job trains; a second submission resumes where it stopped."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mpirun import ROOT, ckpt, mpi_env

FAST = ["--config", "configs/tiny.toml", "data.max_bytes=300000", "train.seq_len=32", "model.n_layers=2",
        "train.steps=4", "checkpoint.async=false", "parallel.pp=1"]


def sbatch_and_wait(slurm_env, run_dir, *args, timeout=240):
    """Submit and poll the job's state every 0.5 s (``sbatch --wait`` polls on a 2, 8, 32 s backoff: a 12 s job
    returns after 42 s); returns the job's output. Fails unless it ends with exit code 0."""
    env = mpi_env(slurm_env)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    out = run_dir.parent / f"{run_dir.name}-%j.out"
    submit = subprocess.run(["sbatch", "--parsable", f"--output={out}", "--ntasks-per-node=2",
                             "--time=10", str(ROOT / "slurm" / "train.sbatch"), *FAST,
                             f"train.run_dir={run_dir}", *args],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert submit.returncode == 0, f"sbatch exit {submit.returncode}: {submit.stderr}"
    job = submit.stdout.strip().split(";")[0]
    record = wait_for(lambda: job_ended(env, job), timeout, f"job {job} to end")
    log = Path(str(out).replace("%j", job))
    text = log.read_text() if log.exists() else ""
    assert "JobState=COMPLETED" in record and "ExitCode=0:0" in record, f"{record}\n{text}"
    return text


def job_ended(env, job):
    """``scontrol show job``'s record once the job is neither pending nor running (else None)."""
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return out if out and "JobState=RUNNING" not in out and "JobState=PENDING" not in out \
        and "JobState=COMPLETING" not in out else None


def test_sbatch_template_trains_and_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    first = sbatch_and_wait(slurm, run_dir, "--max-steps", "2")
    assert "dp=1 x pp=1 x tp=2" in first
    # the template checked the job before the step started (HPCTRAIN_CHECK): 1 node of 2 ranks, nothing to resume
    assert "hpctrain check: layout: 2 ranks on 1 node(s) of 2" in first and "hpctrain check: OK" in first
    second = sbatch_and_wait(slurm, run_dir)  # no --resume: auto inside a batch job
    assert "resumed from" in second and "at step 2" in second
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "event" not in r]
    assert steps == [1, 2, 3, 4]


def submit(slurm_env, run_dir, *args, requeue=True, extra=()):
    """sbatch (no --wait): returns the job id. ``extra``: more sbatch options (they override the
    template's #SBATCH lines)."""
    env = mpi_env(slurm_env)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    out = run_dir.parent / f"{run_dir.name}-%j.out"
    cmd = ["sbatch", "--parsable", f"--output={out}", "--ntasks-per-node=2", "--time=10",
           "--requeue" if requeue else "--no-requeue", *extra, str(ROOT / "slurm" / "train.sbatch"),
           *FAST[:-2], "parallel.pp=1", f"train.run_dir={run_dir}", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0], env


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def events(run_dir):
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines)]


def signal_after_steps(env, job, run_dir, steps=3):
    wait_for(lambda: len([r for r in events(run_dir) if "event" not in r]) >= steps, 120, f"{steps} steps")
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)  # to the ranks


def test_usr1_saves_requeues_resumes_and_matches_an_uninterrupted_run(slurm, tmp_path):
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    job, env = submit(slurm, run_dir, "train.steps=60")
    signal_after_steps(env, job, run_dir)
    done = wait_for(lambda: [e for e in events(run_dir) if e.get("reason") == "max steps"], 240, "the requeued job")
    stops = [e for e in events(run_dir) if e.get("event") == "stop"]
    assert stops[0]["reason"] == "signal USR1" and stops[0]["requeue"] == job, stops
    assert done[0]["restart_count"] >= 1 and done[0]["step"] == 60
    wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                                    text=True).stdout.strip() == "", 60, "the job to leave the queue")
    sbatch_and_wait(slurm, whole, "train.steps=60")
    diff = ckpt("diff", str(run_dir), str(whole), "--atol", "0", check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr


def test_a_job_that_cannot_be_requeued_exits_75(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job, env = submit(slurm, run_dir, "train.steps=100000", requeue=False)
    signal_after_steps(env, job, run_dir)
    stop = wait_for(lambda: [e for e in events(run_dir) if e.get("event") == "stop"], 120, "the stop")[0]
    assert stop["reason"] == "signal USR1"
    # the stop's timing as docs/slurm.md states it: the request rides on the next step, whose verdict is read
    # during the step after it (the dense reducer's late read), then the save: at most 2 steps after the
    # step in which rank 0 saw the signal
    print(f"signal to saved: {stop['steps_after_signal']} steps, {stop['signal_to_saved_s']} s, save "
          f"{stop['save_s']} s (after step {stop['signal_seen_after_step']})")
    assert 1 <= stop["steps_after_signal"] <= 2, stop
    assert stop["step"] == stop["signal_seen_after_step"] + stop["steps_after_signal"]
    assert 0 < stop["save_s"] <= stop["signal_to_saved_s"], stop

    record = wait_for(lambda: job_ended(env, job), 90, "the job to end")
    assert "ExitCode=75:0" in record, record  # not requeueable: the documented exit code
    log = next(tmp_path.glob("run-*.out")).read_text()
    assert "exit 75" in log and "Restarts=0" in record


def test_a_one_minute_job_stops_and_saves_before_its_time_limit(slurm, tmp_path):
    """--time=1: the ranks read the job's end time from squeue and stop with train.time_limit_margin_s
    to spare (or on the --signal, whichever comes first: Slurm may send it up to 60 s early); the
    checkpoint is complete and the job ends with 75 before Slurm would kill it (never TIMEOUT)."""
    run_dir = tmp_path / "run"
    job, env = submit(slurm, run_dir, "train.steps=1000000", "train.time_limit_margin_s=20", requeue=False,
                      extra=["--time=1", "--signal=USR1@30"])

    record = wait_for(lambda: job_ended(env, job), 150, "the one-minute job to end")
    assert "JobState=TIMEOUT" not in record and "ExitCode=75:0" in record, record
    stop = [e for e in events(run_dir) if e.get("event") == "stop"]
    assert len(stop) == 1 and stop[0]["reason"] in ("time limit", "signal USR1"), stop
    step_dir = run_dir / "checkpoints" / f"step-{stop[0]['step']:08d}"
    assert (step_dir / "COMPLETE").exists() and stop[0]["step"] >= 1


def test_a_requeue_of_the_same_job_takes_over_the_lock_its_dead_node_left(slurm, tmp_path):
    """A node dies mid-run and Slurm requeues the job (same SLURM_JOB_ID) onto other nodes: the lock the
    dead attempt left looks live from the new host (fresh heartbeat, another hostname), yet it is this
    job's own, so the new attempt takes it over at once and resumes. The dead node is emulated by
    holding the requeued job and writing the lock a crashed attempt 0 on host "dead-node" leaves."""
    run_dir = tmp_path / "run"
    job, env = submit(slurm, run_dir, "train.steps=60", "checkpoint.interval=2")
    wait_for(lambda: len([r for r in events(run_dir) if "event" not in r]) >= 3, 120, "3 steps")
    subprocess.run(["scontrol", "requeuehold", job], env=env, check=True, timeout=30)
    lock = run_dir / ".hpctrain.lock"

    def held_and_released():
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                               text=True).stdout.strip()
        return state == "PENDING" and not lock.exists()
    wait_for(held_and_released, 120, "attempt 0 to end and the job to wait, held")
    lock.write_text(json.dumps({"host": "dead-node", "pid": 1, "job": job, "restart": 0, "token": "dead"}))
    subprocess.run(["scontrol", "release", job], env=env, check=True, timeout=30)
    done = wait_for(lambda: [e for e in events(run_dir) if e.get("reason") == "max steps"], 240, "attempt 1")
    assert done[0]["restart_count"] >= 1 and done[0]["step"] == 60
    log = next(tmp_path.glob("run-*.out")).read_text()
    assert "earlier attempt of this Slurm job" in log and "resumed from" in log, log[-3000:]
