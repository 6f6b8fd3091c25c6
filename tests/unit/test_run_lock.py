"""The run lock (hpctrain/train/run_lock.py): atomic takeover, ownership, heartbeat thread, Slurm requeue,
the checkpoint directory locked too."""
import json
import os
import socket
import time

import pytest

from hpctrain.train.run_lock import LOCK_NAME, STALE_S, TAKEOVER_SUFFIX, RunDirInUse, RunLock


def foreign_lock(directory, age=0.0, **owner):
    path = directory / LOCK_NAME
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": "other-node", "pid": 1, "token": "theirs", **owner}))
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_heartbeat_and_release_never_touch_a_lock_this_job_does_not_own(tmp_path):
    lock = RunLock(str(tmp_path), enabled=True)
    assert lock.acquire() is None
    path = foreign_lock(tmp_path, age=1000)  # another job took the directory over meanwhile
    lock.heartbeat()
    assert time.time() - path.stat().st_mtime > 900  # not refreshed
    lock.release()
    assert json.loads(path.read_text())["token"] == "theirs"  # not deleted


def test_only_one_contender_takes_over_a_stale_lock(tmp_path):
    foreign_lock(tmp_path, age=STALE_S + 10)
    (tmp_path / (LOCK_NAME + TAKEOVER_SUFFIX)).write_text("{}")  # another contender is mid-takeover
    with pytest.raises(RunDirInUse, match="taking it at the same moment"):
        RunLock(str(tmp_path), enabled=True).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "theirs"
    os.unlink(tmp_path / (LOCK_NAME + TAKEOVER_SUFFIX))
    winner = RunLock(str(tmp_path), enabled=True)
    assert "no heartbeat" in winner.acquire()
    with pytest.raises(RunDirInUse, match="in use by"):  # the loser now sees a live lock
        RunLock(str(tmp_path), enabled=True).acquire()
    winner.release()
    assert sorted(os.listdir(tmp_path)) == []  # no temporary or takeover files left


def test_a_requeued_slurm_job_takes_over_its_own_lock_from_another_node_at_once(tmp_path):
    foreign_lock(tmp_path, age=1, job="55", restart=0)  # fresh heartbeat, a dead node
    with pytest.raises(RunDirInUse):
        RunLock(str(tmp_path), enabled=True, environ={"SLURM_JOB_ID": "56"}).acquire()
    with pytest.raises(RunDirInUse):  # the same attempt twice is not a requeue
        RunLock(str(tmp_path), enabled=True, environ={"SLURM_JOB_ID": "55", "SLURM_RESTART_COUNT": "0"}).acquire()
    requeued = RunLock(str(tmp_path), enabled=True, environ={"SLURM_JOB_ID": "55", "SLURM_RESTART_COUNT": "1"})
    assert "earlier attempt of this Slurm job" in requeued.acquire()
    owner = json.loads((tmp_path / LOCK_NAME).read_text())
    assert (owner["job"], owner["restart"], owner["host"]) == ("55", 1, socket.gethostname())
    requeued.release()


def test_a_step_relaunched_in_the_same_allocation_takes_over_its_ended_steps_lock_from_another_node(tmp_path):
    foreign_lock(tmp_path, age=1, job="55", restart=0, step=0)  # fresh heartbeat: the node died with step 0
    job = {"SLURM_JOB_ID": "55", "SLURM_RESTART_COUNT": "0"}
    with pytest.raises(RunDirInUse):  # the same step is no relaunch
        RunLock(str(tmp_path), enabled=True, environ={**job, "SLURM_STEP_ID": "0"}).acquire()
    with pytest.raises(RunDirInUse, match=r"an earlier step of this job \(step 0\) still running"):
        RunLock(str(tmp_path), enabled=True, environ={**job, "SLURM_STEP_ID": "1"}).acquire()  # two sruns at once
    relaunched = RunLock(str(tmp_path), enabled=True,
                         environ={**job, "SLURM_STEP_ID": "1", "HPCTRAIN_EARLIER_STEPS_ENDED": "1"})  # train.sbatch's
    assert "earlier job step of this Slurm job (step 0, ended" in relaunched.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["step"] == 1
    relaunched.release()


def test_a_shared_checkpoint_dir_is_locked_too(tmp_path):
    shared = tmp_path / "ckpts"
    first = RunLock(str(tmp_path / "a"), enabled=True, checkpoint_dir=str(shared))
    first.acquire()
    assert (shared / LOCK_NAME).exists()
    second = RunLock(str(tmp_path / "b"), enabled=True, checkpoint_dir=str(shared))
    with pytest.raises(RunDirInUse, match="checkpoint.dir="):
        second.acquire()
    assert not (tmp_path / "b" / LOCK_NAME).exists()  # the lock it had taken is released
    first.release()
    inside = RunLock(str(tmp_path / "c"), enabled=True, checkpoint_dir=str(tmp_path / "c" / "checkpoints"))
    assert len(inside.locks) == 1  # the default layout: one lock covers both


def test_the_heartbeat_thread_keeps_the_lock_fresh_between_steps(tmp_path):
    lock = RunLock(str(tmp_path), enabled=True, heartbeat_s=0.05)
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK_NAME, (old, old))
    deadline = time.time() + 10
    while time.time() - (tmp_path / LOCK_NAME).stat().st_mtime > 500 and time.time() < deadline:
        time.sleep(0.05)
    assert time.time() - (tmp_path / LOCK_NAME).stat().st_mtime < 500
    lock.release()
    assert not lock.held and not (tmp_path / LOCK_NAME).exists()


def test_a_start_that_fails_leaves_no_directory_it_made_but_keeps_anything_written(tmp_path):
    run_dir = tmp_path / "made" / "run"
    lock = RunLock(str(run_dir), enabled=True)
    lock.acquire()
    assert (run_dir / LOCK_NAME).exists()
    lock.release()  # nothing was written: the directories the lock made are gone, not the ones before it
    assert not (tmp_path / "made").exists() and tmp_path.exists()
    lock = RunLock(str(run_dir), enabled=True)
    lock.acquire()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert (run_dir / "metrics.jsonl").exists() and not (run_dir / LOCK_NAME).exists()
