"""How a training run ends, in one place: which ending, what is saved, what is said, and the exit code.

The endings (the codes: ``hpctrain/exit_codes.py``; docs/fault-tolerance.md, "Exit codes"):

- **finished** (the last step, or ``--max-steps``): the last save, the stop event, exit 0;
- **stopped early** (a signal, ``train.exit_signals``, the scheduler's time limit: an agreed stop,
  ``train/stop.py``): the same save, then under Slurm with ``train.requeue = "auto"`` rank 0 runs
  ``scontrol requeue`` after MPI is finalised (every rank exits 0: the requeued job resumes with ``--resume
  auto``), else exit 75 (``STOPPED``);
- **diverged** (``train/guard.py``): nothing saved, the newest checkpoint named, exit 4;
- **a node-local save that failed in the background** (agreed in the tier, stopped through the step's stop
  slots): a global save in flight finishes, then the tier's ``NodeFailure`` is raised on every rank: exit 5;
- **an error** (any exception on any rank): ``runtime/errors_exit.run_and_exit`` prints it and agrees on the
  exit (2 for a user error, 5 for a ``NodeFailure``, 1 for a bug) or aborts the job.

``save_and_stop`` decides and logs the ending (collective); ``leave`` says it on rank 0, releases the run lock,
closes the grid and returns this rank's exit code (``leave_with``: rank 0 leaves last).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from hpctrain.checkpoint.directory import list_checkpoints
from hpctrain.checkpoint.items import CheckpointError
from hpctrain.exit_codes import DIVERGED as DIVERGED_EXIT
from hpctrain.exit_codes import STOPPED as STOPPED_EXIT
from hpctrain.runtime import env
from hpctrain.runtime.errors_exit import leave_with
from hpctrain.runtime.signals import requeue_slurm_job, slurm_job_to_requeue
from hpctrain.train.run import Run
from hpctrain.train.stop import LOCAL_TIER_FAILED, decode, encode


@dataclass
class Ending:
    """How the run ends (``save_and_stop``): its stop event's reason, step and fields, and the exit code."""
    reason: str
    step: int
    event: dict
    exit_code: int
    requeue: str | None = None  # the Slurm job to requeue after MPI is finalised
    message: str = ""  # a diverged run's one line for the user


def save_and_stop(run: Run) -> Ending:
    """How the run ends, with its stop event logged (metrics.jsonl): diverged (nothing saved: the newest
    checkpoint named), or finished / stopped early after the last save (unless this step is saved already:
    an async save of it may still be in flight, so wait first)."""
    cfg, trainer, checkpoints = run.cfg, run.trainer, run.checkpoints
    if trainer.agreed_stop == LOCAL_TIER_FAILED:  # raise its agreed NodeFailure on every rank
        checkpoints.wait()  # a global save in flight is a good checkpoint: it ends first (its thread calls MPI)
        checkpoints.local.wait()
    if trainer.diverged:
        try:  # background saves of earlier steps end before MPI does (their threads call MPI)
            checkpoints.close()
        except CheckpointError as exc:
            print(f"hpctrain: WARNING: {exc}", file=sys.stderr, flush=True)
        kept = [r for r in list_checkpoints(checkpoints.dir) if r["complete"]] if run.is_root else []
        event = {"reason": trainer.diverged.stop, "step": trainer.step, "detail": trainer.diverged.detail,
                 "checkpoint": kept[-1]["path"] if kept else None}
        newest = f"the newest checkpoint is step {kept[-1]['step']} ({kept[-1]['path']})" if kept else "no checkpoint"
        ending = Ending(trainer.diverged.stop, trainer.step, event, DIVERGED_EXIT,
                        message=f"stopped at {trainer.diverged.detail}; the update was not applied and nothing "
                                f"was saved; {newest}; exit {DIVERGED_EXIT}")
    else:
        reason = stronger(trainer.agreed_stop, "max steps" if trainer.step >= run.last_step else "")
        start = time.perf_counter()
        checkpoints.wait()  # an async save of this very step may still be in flight: never save a step twice
        if trainer.step not in checkpoints.saved_steps and trainer.step != run.resumed_step:
            checkpoints.save(trainer.state, sync=True)
        checkpoints.close()  # waits for an async save still in flight
        save_s = time.perf_counter() - start
        run.monitor.on_saved(trainer.step, checkpoints.saved_steps, checkpoints.last_phases)
        early = reason.startswith("signal") or reason == "time limit"
        job = slurm_job_to_requeue() if early and cfg.train.requeue == "auto" else None
        timing = run.policy.signal_timing(trainer.step) if reason.startswith("signal") else {}
        event = {"reason": reason, "step": trainer.step, "save_s": round(save_s, 3),
                 "restart_count": env.slurm_restart_count(), "requeue": job, **timing}
        ending = Ending(reason, trainer.step, event, STOPPED_EXIT if early else 0, job)
    run.log.event({"event": "stop", **ending.event})
    return ending


def leave(run: Run, ending: Ending) -> int:
    """Say how it ended (rank 0), close the grid, then requeue if asked: ``scontrol requeue`` kills the job's
    tasks at once, so everything is on disk and MPI is finalised first (a task killed inside MPI leaves
    shared-memory segments that the requeued attempt, with the same step id, would attach to). Returns this
    rank's exit code: 0, DIVERGED_EXIT or STOPPED_EXIT on rank 0 (it leaves last: ``leave_with``)."""
    grid, early = run.grid, ending.exit_code == STOPPED_EXIT
    if run.is_root:
        if ending.exit_code == DIVERGED_EXIT:
            print(f"hpctrain train: {ending.message}", flush=True)
        elif early:
            print(f"hpctrain train: stopped at step {ending.step} ({ending.reason}); checkpoint saved in "
                  f"{ending.event['save_s']:.1f} s" + (f"; requeueing Slurm job {ending.requeue}"
                                                        if ending.requeue else ""), flush=True)
    grid.world.barrier()
    run.lock.release()  # before a requeue: the next attempt must find the directory free
    grid.close()
    if not ending.requeue:
        if run.is_root and early:
            print(f"hpctrain train: exit {STOPPED_EXIT}; continue with --resume auto", flush=True)
        return leave_with(ending.exit_code, grid.info.rank, grid.info.node, grid.watchdog.peers)
    from mpi4py import MPI  # here, not at the top: importing mpi4py initialises MPI

    MPI.Finalize()
    problem = requeue_slurm_job(ending.requeue) if run.is_root else None
    if problem:  # rank 0 alone carries the 75 (``leave_with``); the others exit 0
        print(f"hpctrain train: {problem}; exit {STOPPED_EXIT}; continue with --resume auto", flush=True)
    return leave_with(STOPPED_EXIT if problem else 0, grid.info.rank, grid.info.node, grid.watchdog.peers)


def stronger(*reasons: str) -> str:
    """The reason with the highest stop code (a signal beats the time limit beats max steps)."""
    return decode(max(encode(r) for r in reasons))
