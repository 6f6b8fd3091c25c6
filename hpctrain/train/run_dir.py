"""What a training start does with a run directory that already holds a run.

``hpctrain train`` never mixes two runs: a fresh start never appends to another run's
``metrics.jsonl`` and never silently replaces its checkpoints. Rank 0 decides, under the run lock,
before anything is written (``decide_start``), and every rank follows the broadcast decision; the earlier
run is set aside only once every start-up check has passed (``set_aside_agreed``: a start that fails, say
on a Prometheus port in use, leaves it where it was):

| ``--resume``  | checkpoints found | what happens                                                      |
|---------------|-------------------|-------------------------------------------------------------------|
| not given     | yes               | refused (exit 2): use ``--resume auto`` or ``--resume none``      |
| not given     | no                | fresh start; an earlier run's files are set aside (below)         |
| ``none``      | any               | fresh start; the earlier run's files and checkpoints set aside    |
| ``auto``      | yes               | resume from the newest usable checkpoint (metrics appended)       |
|               |                   | (a node-local tier's pieces of the run count as checkpoints too)  |
| ``auto``      | no                | fresh start; an earlier run's files are set aside                 |
| ``PATH``      | any               | resume from PATH (metrics appended)                               |

Inside a batch job (``SLURM_JOB_ID``, ``PBS_JOBID``, ...) a missing ``--resume`` means ``auto``, so a
requeued or resubmitted job continues. "Set aside" moves the earlier run's outputs into
``<run_dir>/superseded/<UTC time>/`` (and the contents of a ``checkpoint.dir`` outside the run
directory into ``<checkpoint.dir>/superseded/<UTC time>/``): nothing is deleted; remove them by hand.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from hpctrain.errors import HpcTrainError, everywhere
from hpctrain.runtime import env
from hpctrain.train.run_lock import LOCK_NAME

SUPERSEDED = "superseded"
# What a run writes into its run directory (the lock stays: the new run holds it).
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "config.json", "hang-report.txt", "trace")


class RunDirHoldsARun(HpcTrainError):
    """A fresh start was asked for implicitly in a run directory that holds checkpoints."""


@dataclass
class StartDecision:
    resume: str  # "auto", "none" or a checkpoint path: what CheckpointManager.resume gets
    set_aside: str | None = None  # where the earlier run's files went (``carry_out``), or None
    problem: str | None = None  # refuse to start (identical message on every rank)
    earlier: list[str] = field(default_factory=list)  # the earlier run's files a fresh start sets aside

    def start_over(self, world, run_dir: str, checkpoint_dir: str) -> None:
        """Collective over ``world``: ``--resume auto`` found nothing it could resume (an announced start-over):
        a fresh start, so the earlier run's files (as rank 0 lists them) are set aside like ``--resume
        none``'s by ``set_aside_agreed``, never appended to."""
        self.earlier = world.broadcast_object(_earlier_outputs(run_dir, checkpoint_dir) if world.rank == 0 else None,
                                              root=0)


def default_resume(environ=None) -> str | None:
    """``auto`` inside a batch job (a requeued job must continue), else None (decided by the table above)."""
    return "auto" if env.in_batch_job(environ) else None


def _complete_steps(checkpoint_dir: str) -> list[int]:
    from hpctrain.checkpoint.directory import list_checkpoints

    return [r["step"] for r in list_checkpoints(checkpoint_dir) if r["complete"]]


def _earlier_outputs(run_dir: str, checkpoint_dir: str) -> list[str]:
    """Paths of an earlier run that a fresh start must not append to or replace."""
    found = [os.path.join(run_dir, name) for name in RUN_OUTPUTS if os.path.lexists(os.path.join(run_dir, name))]
    if os.path.isdir(checkpoint_dir):
        found += [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)
                  if name != SUPERSEDED and not name.startswith(LOCK_NAME)]  # the new run holds the lock
    return found


def set_aside(paths: list[str], run_dir: str, checkpoint_dir: str, stamp: str | None = None) -> str:
    """Move ``paths`` (inside ``run_dir`` or ``checkpoint_dir``) into ``superseded/<stamp>/`` folders by
    rename (same file system: atomic per entry, nothing copied or deleted). Returns the run's folder."""
    stamp = stamp or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    run_dir, checkpoint_dir = os.path.abspath(run_dir), os.path.abspath(checkpoint_dir)
    inside = os.path.dirname(checkpoint_dir) == run_dir
    target = os.path.join(run_dir, SUPERSEDED, stamp)
    suffix = 1
    while os.path.exists(target):  # two fresh starts in one second
        suffix += 1
        target = os.path.join(run_dir, SUPERSEDED, f"{stamp}-{suffix}")
    for path in paths:
        path = os.path.abspath(path)
        parent = os.path.dirname(path)
        if parent == run_dir:
            dest = os.path.join(target, os.path.basename(path))
        elif inside:  # <run_dir>/checkpoints/<entry> -> <target>/checkpoints/<entry>
            dest = os.path.join(target, os.path.basename(checkpoint_dir), os.path.basename(path))
        else:
            dest = os.path.join(checkpoint_dir, SUPERSEDED, os.path.basename(target), os.path.basename(path))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(path, dest)
    return target


def decide_start(run_dir: str, checkpoint_dir: str, resume: str | None, local_step: int | None = None) -> StartDecision:
    """Rank 0, under the run lock: how this start treats what ``run_dir`` already holds (table above).
    ``resume`` is the ``--resume`` argument, None where it was not given (outside a batch job); ``local_step``
    the newest step any node's local tier (``checkpoint.local_dir``) holds of this run: checkpoints too."""
    if resume not in (None, "none", "auto"):
        return StartDecision(resume)
    steps = _complete_steps(checkpoint_dir)
    if resume is None and (steps or local_step is not None):
        where = (f"checkpoints up to step {max(steps)} in {checkpoint_dir}" if steps else
                 f"local checkpoints up to step {local_step} in checkpoint.local_dir")
        return StartDecision("none", problem=(
            f"train.run_dir={run_dir} already holds a run ({where}): continue it with --resume auto, or start "
            f"over with --resume none (its files are moved to {os.path.join(run_dir, SUPERSEDED)}/), or choose "
            f"another train.run_dir"))
    if resume == "auto" and (steps or local_step is not None):
        return StartDecision("auto")
    return StartDecision("none", earlier=_earlier_outputs(run_dir, checkpoint_dir))


def carry_out(decision: StartDecision, run_dir: str, checkpoint_dir: str) -> str | None:
    """Rank 0: move the earlier run's files of ``decision`` (those still there) into ``superseded/``
    (``set_aside``); returns, and sets ``decision.set_aside`` to, where they went (None: nothing to move)."""
    still = [path for path in decision.earlier if os.path.lexists(path)]
    decision.set_aside = set_aside(still, run_dir, checkpoint_dir) if still else None
    return decision.set_aside


def set_aside_agreed(world, decision: StartDecision, run_dir: str, checkpoint_dir: str) -> None:
    """Collective over ``world`` (the world Communicator; every rank holds the same ``decision``), once every
    start-up check has passed: rank 0 carries out the set-aside and says where; an error, on every rank."""
    if not decision.earlier:
        return
    problem = None
    if world.rank == 0:
        try:
            where = carry_out(decision, run_dir, checkpoint_dir)
            if where:
                print(f"hpctrain train: a fresh start: the earlier run's files in {run_dir} were moved to {where}",
                      flush=True)
        except OSError as exc:
            problem = f"train.run_dir={run_dir}: cannot set the earlier run aside: {exc}"
    problem = world.broadcast_object(problem, root=0)
    if problem:
        raise everywhere(HpcTrainError(problem))
