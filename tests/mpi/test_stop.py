"""Stopping on a signal or a time limit: all ranks agree, save, exit 75; the resumed run ends bit for bit
equal to an uninterrupted one. Real ranks, real signals (SIGUSR1 to mpiexec, which forwards it)."""
import json
import signal
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, ckpt, mpi_env, mpiexec, run_mpi

FAST = ["--config", "configs/tiny.toml", "data.max_bytes=300000", "train.seq_len=32", "train.global_batch=8",
        "train.warmup_steps=2", "model.n_layers=2", "train.progress=false", "parallel.tp=1", "parallel.pp=2",
        "parallel.microbatches=2", "checkpoint.async=false"]


def records(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start(run_dir, *overrides):
    cmd = mpiexec() + ["-n", "2", sys.executable, "-m", "hpctrain.cli", "train", *FAST,
                       f"train.run_dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=str(ROOT), env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)


def finish(proc, timeout=180):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"hung: {out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


def test_usr1_stops_saves_and_the_resumed_run_is_bitwise_equal(tmp_path):
    run, whole, steps = tmp_path / "run", tmp_path / "whole", 80
    proc = start(run, f"train.steps={steps}")
    deadline = time.time() + 120
    while len([r for r in records(run) if "event" not in r]) < 5 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)  # hydra's mpiexec forwards it to every rank
    code, out, err = finish(proc)
    stop = records(run)[-1]
    assert code == 75, (code, out[-2000:], err[-2000:])
    assert stop["event"] == "stop" and stop["reason"] == "signal USR1" and 5 <= stop["step"] < steps, stop
    assert (run / "checkpoints" / f"step-{stop['step']:08d}" / "COMPLETE").exists()
    assert f"stopped at step {stop['step']} (signal USR1)" in out and "exit 75" in out
    resumed = run_mpi(2, "hpctrain.cli", "train", *FAST, f"train.run_dir={run}", f"train.steps={steps}",
                      "--resume", "auto", module=True, timeout=240)
    assert f"resumed from" in resumed.stdout and records(run)[-1]["reason"] == "max steps"
    run_mpi(2, "hpctrain.cli", "train", *FAST, f"train.run_dir={whole}", f"train.steps={steps}", module=True,
            timeout=240)
    diff = ckpt("diff", str(run), str(whole), "--atol", "0", check=False)
    assert diff.returncode == 0, diff.output


@pytest.mark.alone  # a deadline against the steps' own times
def test_time_limit_stops_in_time_with_a_checkpoint(tmp_path):
    """The deadline (train.time_limit_s after start-up) lies between ``began`` + limit and the first step's
    record + limit. The policy stops when now + (last step + margin) would pass it, so the checkpoint is
    published after deadline - margin - last step, and before the deadline but for what the final step and
    save took beyond the margin (both recorded; start-up, slow on a loaded machine, is not in the bound)."""
    limit, margin = 8, 2
    began = time.time()
    proc = start(tmp_path, "train.steps=1000000", f"train.time_limit_s={limit}", f"train.time_limit_margin_s={margin}")
    first_step_seen = None
    while proc.poll() is None and time.time() < began + 120:
        if any("event" not in r for r in records(tmp_path)):
            first_step_seen = time.time()
            break
        time.sleep(0.1)
    code, out, err = finish(proc)
    *steps, stop = records(tmp_path)
    assert code == 75 and stop["reason"] == "time limit", (code, stop, err[-2000:])
    assert first_step_seen is not None and steps and stop["step"] == steps[-1]["step"]
    published = (tmp_path / "checkpoints" / f"step-{stop['step']:08d}" / "COMPLETE").stat().st_mtime
    slowest_step = max(r["step_time_s"] for r in steps)
    assert published >= began + limit - margin - slowest_step - 0.5, (published - began, slowest_step)
    overrun = steps[-1]["step_time_s"] + stop["save_s"] + 5  # the final step, the save, scheduling gaps
    assert published <= first_step_seen + limit + overrun, (published - first_step_seen, overrun)


# a bad train.exit_signals name: tests/mpi/test_bad_input.py


def test_a_second_job_on_a_live_run_directory_is_refused_and_changes_nothing(tmp_path):
    first = start(tmp_path, "train.steps=100000")  # runs until the test stops it (USR1): no race with the second
    deadline = time.time() + 120
    while not any("event" not in r for r in records(tmp_path)) and time.time() < deadline:
        time.sleep(0.2)
    before = sorted(p.name for p in tmp_path.iterdir())
    second = run_mpi(2, "hpctrain.cli", "train", *FAST, f"train.run_dir={tmp_path}", "train.steps=5",
                     module=True, check=False)
    assert second.returncode == 2 and "is in use by pid" in second.stderr, second.output[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    first.send_signal(signal.SIGUSR1)  # hydra's mpiexec forwards it to every rank
    code, out, err = finish(first)
    assert code == 75 and records(tmp_path)[-1]["reason"] == "signal USR1", err[-2000:]
    assert not (tmp_path / ".hpctrain.lock").exists()  # released at the end


def test_the_lock_of_a_dead_job_is_taken_over(tmp_path):
    import socket

    (tmp_path / ".hpctrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7}))
    result = run_mpi(2, "hpctrain.cli", "train", *FAST, f"train.run_dir={tmp_path}", "train.steps=2",
                     module=True)
    assert "took over the stale lock" in result.stderr and records(tmp_path)[-1]["reason"] == "max steps"
