"""Launching a sweep's runs: one after another with ``mpiexec`` on this machine, or as Slurm jobs.

``MpiexecLauncher.run(run, run_dir, train_args)`` runs ``mpiexec -n R python -m hpctrain.cli train ...``
under a hard timeout (killed, never hung: ``runtime/child_job.py``) and returns "ok" or why not.
``SbatchLauncher`` submits every run as its own job from ``slurm/scaling_study.sbatch`` (``--ntasks=R``,
``--nodes`` from ``--ranks-per-node``), then polls ``squeue`` until all have left the queue (or the
timeout cancels them) and reads each run's exit code from its ``exit_code`` file, which the template
writes.
"""
from __future__ import annotations

import os
import sys
import shutil
import subprocess
import time
from pathlib import Path

from hpctrain.runtime import env
from hpctrain.runtime.child_job import find_launcher, launch_training_job, train_command
from hpctrain.sweep.runs import SweepError

TEMPLATE = Path(__file__).resolve().parent / "scaling_study.sbatch"  # package data (slurm/ links to it)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


class MpiexecLauncher:
    def __init__(self, mpiexec: str = "mpiexec", timeout_s: float = 600, extra_args: list[str] | None = None,
                 ranks_per_node: int = 0):
        self.mpiexec = find_launcher(mpiexec) or mpiexec
        self.timeout_s, self.extra_args = timeout_s, list(extra_args or [])
        self.ranks_per_node = ranks_per_node  # > 0: hydra's -ppn (ranks in blocks of that many per host)

    def run(self, run, run_dir: str, train_args: list[str]) -> str:
        os.makedirs(run_dir, exist_ok=True)
        log = os.path.join(run_dir, "sweep.log")
        ppn = ["-ppn", str(min(run.ranks, self.ranks_per_node))] if self.ranks_per_node else []
        cmd = train_command([self.mpiexec, *self.extra_args], run.ranks, train_args, launcher_args=ppn)
        code = launch_training_job(cmd, Path(log), self.timeout_s)
        if code is None:
            return f"timed out after {self.timeout_s:.0f} s (see {log})"
        return "ok" if code == 0 else f"exit {code}: {_tail(log, 400).strip().splitlines()[-1:] or ''} ({log})"

    def run_all(self, todo, progress) -> dict:
        results = {}
        for i, (run, run_dir, args) in enumerate(todo):
            progress(f"[{i + 1}/{len(todo)}] {run.name}: running")
            results[run.name] = self.run(run, run_dir, args)
        return results


def reached_first_step(run_dir: str) -> bool:
    """True once any rank of the run has recorded a training step in ``run_dir/metrics.jsonl``: the run started
    (MPI came up, the model was built, a step ran). A job without one either never started or is still starting."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            return any('"step"' in line and '"event"' not in line for line in f)
    except OSError:
        return False


def started_up(run_dir: str) -> bool:
    """True once the run got through MPI's start-up: rank 0 holds (or held) the run directory's lock, which
    it takes after every rank built the process grid, or a step was recorded."""
    return os.path.exists(os.path.join(run_dir, ".hpctrain.lock")) or reached_first_step(run_dir)


class SbatchLauncher:
    """Submits every run as a job and watches them. A job that never starts (running for ``start_timeout_s``
    without getting through MPI's start-up, or gone from the queue failed before its first step and not
    with hpctrain's exit 2 for a user error) is cancelled and resubmitted, at most ``resubmits`` times per run, each said in
    the output: on clusters a launch now and then dies or hangs inside the PMI before Python runs (Slurm's
    pmi2 plugin garbling ``MPI_Init``'s key-value put), which is not the run's fault and says nothing of its
    speed. A job that started and then ran slowly is left alone until the sweep's ``timeout_s``."""

    def __init__(self, timeout_s: float = 3600, ranks_per_node: int = 0, sbatch_args: list[str] | None = None,
                 poll_s: float = 2.0, start_timeout_s: float = 600, resubmits: int = 2):
        for tool in ("sbatch", "squeue", "scancel"):
            if shutil.which(tool) is None:
                raise SweepError(f"--launcher sbatch needs `{tool}` on PATH (run the sweep on a Slurm login node)")
        self.timeout_s, self.ranks_per_node, self.poll_s = timeout_s, ranks_per_node, poll_s
        self.start_timeout_s, self.resubmits = start_timeout_s, resubmits
        self.sbatch_args = list(sbatch_args or [])

    def submit(self, run, run_dir: str, train_args: list[str]) -> str:
        os.makedirs(run_dir, exist_ok=True)
        layout = [f"--ntasks={run.ranks}"]
        if self.ranks_per_node:
            layout += [f"--nodes={-(-run.ranks // self.ranks_per_node)}",
                       f"--ntasks-per-node={min(run.ranks, self.ranks_per_node)}"]
        cmd = ["sbatch", "--parsable", f"--job-name=sweep-{run.name}", f"--output={run_dir}/slurm-%j.out",
               *layout, *self.sbatch_args, str(TEMPLATE), *train_args]
        child = env.child_environ({"HPCTRAIN_DIR": os.getcwd(), "HPCTRAIN_PYTHON": sys.executable,
                                   "HPCTRAIN_SWEEP_RUN_DIR": run_dir})
        done = subprocess.run(cmd, capture_output=True, text=True, env=child, stdin=subprocess.DEVNULL, timeout=120)
        if done.returncode != 0:
            raise SweepError(f"sbatch refused {run.name}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip().split(";")[0]

    def run_all(self, todo, progress) -> dict:
        watch = _JobWatch(self, progress)
        for run, run_dir, args in todo:
            watch.submit(run, run_dir, args)
        progress(f"submitted {len(watch.waiting)} jobs: {', '.join(sorted(watch.waiting, key=int))}")
        deadline = time.monotonic() + self.timeout_s
        while watch.waiting:
            if time.monotonic() > deadline:
                subprocess.run(["scancel", *watch.waiting], capture_output=True, timeout=60)
                break
            time.sleep(self.poll_s)
            watch.poll(self._states(watch.waiting))
        for job in watch.waiting:
            watch.final[watch.jobs[job][0].name] = f"cancelled after the {self.timeout_s:.0f} s timeout (job {job})"
        return watch.final

    def _states(self, jobs: set[str]) -> dict[str, str] | None:
        """Job id -> Slurm state (RUNNING, PENDING, ...) of those still in the queue; None if squeue failed."""
        queued = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(sorted(jobs))], capture_output=True,
                                text=True, timeout=60)
        if queued.returncode != 0:
            return None
        return dict(line.split(None, 1) for line in queued.stdout.splitlines() if len(line.split(None, 1)) == 2)


class _JobWatch:
    """The sweep's jobs while they run: which are live, how often each run was submitted, how each ended."""

    def __init__(self, launcher: SbatchLauncher, progress):
        self.launcher, self.progress = launcher, progress
        self.jobs: dict[str, tuple] = {}  # job id -> (run, run_dir, train_args), every submission
        self.waiting: set[str] = set()  # job ids still in the queue
        self.attempts: dict[str, int] = {}  # run name -> submissions so far
        self.running_since: dict[str, float] = {}  # job id -> when squeue first showed it RUNNING
        self.final: dict[str, str] = {}  # run name -> "ok" or why not

    def submit(self, run, run_dir: str, args: list[str]) -> str:
        job = self.launcher.submit(run, run_dir, args)
        self.jobs[job] = (run, run_dir, args)
        self.waiting.add(job)
        self.attempts[run.name] = self.attempts.get(run.name, 0) + 1
        return job

    def poll(self, states: dict[str, str] | None) -> None:
        """One look at the queue (``states`` from squeue; None: unknown this time, nothing decided)."""
        if states is None:
            return
        now = time.monotonic()
        for job in sorted(self.waiting):
            run, run_dir, _ = self.jobs[job]
            state = states.get(job)
            if state == "RUNNING":
                since = self.running_since.setdefault(job, now)
                if now - since > self.launcher.start_timeout_s and not started_up(run_dir):
                    subprocess.run(["scancel", job], capture_output=True, timeout=60)
                    self.waiting.discard(job)
                    self._again(job, f"ran {self.launcher.start_timeout_s:.0f} s and never got through MPI's "
                                     f"start-up")
            elif state is None:  # left the queue
                self.waiting.discard(job)
                self.progress(f"job {job} ({run.name}) left the queue")
                code = _tail(os.path.join(run_dir, "exit_code")).strip()
                if code == "0":
                    self.final[run.name] = "ok"
                elif code != "2" and not reached_first_step(run_dir):
                    self._again(job, f"failed before its first step (exit {code or 'unknown'})")
                else:
                    self.final[run.name] = f"job {job} failed (exit {code or 'unknown'}; see {run_dir}/slurm-{job}.out)"

    def _again(self, job: str, why: str) -> None:
        """Resubmit the run of ``job``, which never started, unless it has used its resubmissions."""
        run, run_dir, args = self.jobs[job]
        used, allowed = self.attempts[run.name] - 1, self.launcher.resubmits
        if used >= allowed:
            self.progress(f"job {job} ({run.name}) {why}; not resubmitted ({allowed} resubmissions used)")
            self.final[run.name] = (f"never started in {used + 1} jobs (last: job {job}, {why}; see "
                                    f"{run_dir}/slurm-{job}.out)")
            return
        try:
            os.remove(os.path.join(run_dir, "exit_code"))
        except OSError:
            pass
        new = self.submit(run, run_dir, args)
        self.progress(f"job {job} ({run.name}) {why}: resubmitted as job {new} (resubmission {used + 1} of {allowed})")
