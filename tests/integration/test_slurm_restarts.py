"""slurm/train.sbatch --restarts N on a real (local) Slurm: a failed job step is launched again inside the same
allocation (one job id, no requeue), from the node-local tier when it is intact; a node lost with no spare
left shrinks the run onto the nodes that are left (dp smaller, global batch kept), from the global tier."""
import re
import subprocess

from test_slurm_sbatch import events, submit, wait_for


def ended(env, job, timeout):
    """Wait until ``job`` left the running states; its ``scontrol show job`` record."""
    def record():
        out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                             timeout=30).stdout
        return out if not re.search(r"JobState=(RUNNING|PENDING|COMPLETING|CONFIGURING)", out) else None
    return wait_for(record, timeout, f"job {job} to end")


def losses(run_dir):
    """{step: loss} of the run's last attempt (a redone step keeps its last record)."""
    return {r["step"]: r["loss"] for r in events(run_dir) if "event" not in r}


def log_of(tmp_path, name, job):
    return (tmp_path / f"{name}-{job}.out").read_text()


def test_a_killed_rank_is_relaunched_in_the_allocation_from_the_local_tier(slurm, tmp_path):
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    local = ["checkpoint.local_dir=" + str(tmp_path / "local" / "{hostname}"), "checkpoint.local_interval=2",
             "train.steps=10", "train.dtype=float64", "checkpoint.interval=4"]
    # (a global checkpoint at step 4: --resume auto starts afresh while the run has no global checkpoint)
    # the uninterrupted run goes alongside, on the other node
    reference, env = submit(slurm, whole, *local[2:], requeue=False, extra=["-N1", "-w", "n2"])
    fault = {"HPCTRAIN_FAULT": "rank=1,step=8,phase=forward,action=kill",
             "HPCTRAIN_FAULT_ONCE": str(tmp_path / "fired")}
    job, _ = submit(dict(slurm, **fault), run_dir, *local, "--restarts", "1", extra=["-N1", "-w", "n1"])
    record = ended(env, job, 150)
    ended(env, reference, 60)
    log = log_of(tmp_path, "run", job)
    assert "JobState=COMPLETED" in record and "Restarts=0" in record, record + log[-3000:]
    assert "fault injection: rank 1 kill at forward of step 8" in log, log[-3000:]
    relaunch = re.findall(r"train.sbatch: relaunch attempt 1/1: step exit (\d+); excluded: none; on 1 node", log)
    assert relaunch and relaunch[0] not in ("0", "75"), log[-3000:]
    # step 6's pieces are written in the background during step 7; a slow write leaves step 4 (as new as the
    # global checkpoint: the local tier still wins)
    assert re.search(r"resumed from the local tier \(\S+step-0000000([46])\) at step \1", log), log[-3000:]
    done = [e for e in events(run_dir) if e.get("reason") == "max steps"]
    assert len(done) == 1 and done[0]["restart_count"] == 0 and done[0]["step"] == 10, done
    got, want = losses(run_dir), losses(whole)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    assert all(abs(got[s] - want[s]) <= 1e-10 for s in want), (got, want)


def test_a_lost_node_without_a_spare_shrinks_the_run_onto_the_nodes_left(slurm, tmp_path):
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    common = ["train.steps=40", "checkpoint.interval=2", "train.micro_batch_size=2", "parallel.microbatches=1",
              "train.dtype=float64"]  # global_batch 8: 2 micro-batches per replica at dp=2, 4 at dp=1
    job, env = submit(slurm, run_dir, *common, "--restarts", "1", extra=["-N2", "--no-kill"])
    try:
        step4 = run_dir / "checkpoints" / "step-00000004" / "COMPLETE"
        wait_for(step4.exists, 120, "the step-4 checkpoint")
        subprocess.run(["scontrol", "update", "nodename=n2", "state=down", "reason=hpctrain-test"], env=env,
                       check=True, timeout=30)
        record = ended(env, job, 150)
    finally:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], env=env, timeout=30)
    wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-n", "n2", "-o", "%T"], env=env, text=True,
                                              capture_output=True).stdout, 60, "n2 to be idle again")
    log = log_of(tmp_path, "run", job)
    assert "JobState=COMPLETED" in record, record + log[-3000:]
    assert "dp=2 x pp=1 x tp=2" in log and "dp=1 x pp=1 x tp=2" in log, log[-3000:]
    assert re.search(r"relaunch attempt 1/1: step exit \d+; excluded: n2; shrunk onto 1 node\(s\)", log), log[-3000:]
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", log)
    assert len(resumed) == 1 and "resumed from the local tier" not in log, log[-3000:]  # the global tier
    at = int(resumed[0][1])
    sbatch_whole, _ = submit(slurm, whole, *common, requeue=False, extra=["-N1"])
    ended(env, sbatch_whole, 120)
    got, want = losses(run_dir), losses(whole)
    assert max(got) == max(want) == 40
    after = [s for s in got if s > at]
    assert after and all(abs(got[s] - want[s]) <= 1e-10 for s in after), {s: (got[s], want[s]) for s in after}
