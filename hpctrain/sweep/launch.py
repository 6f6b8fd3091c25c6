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


class SbatchLauncher:
    def __init__(self, timeout_s: float = 3600, ranks_per_node: int = 0, sbatch_args: list[str] | None = None,
                 poll_s: float = 2.0):
        for tool in ("sbatch", "squeue", "scancel"):
            if shutil.which(tool) is None:
                raise SweepError(f"--launcher sbatch needs `{tool}` on PATH (run the sweep on a Slurm login node)")
        self.timeout_s, self.ranks_per_node, self.poll_s = timeout_s, ranks_per_node, poll_s
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
        jobs = {}
        for run, run_dir, args in todo:
            jobs[self.submit(run, run_dir, args)] = (run, run_dir)
        progress(f"submitted {len(jobs)} jobs: {', '.join(jobs)}")
        deadline, waiting = time.monotonic() + self.timeout_s, set(jobs)
        while waiting:
            if time.monotonic() > deadline:
                subprocess.run(["scancel", *waiting], capture_output=True, timeout=60)
                break
            time.sleep(self.poll_s)
            queued = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(waiting)], capture_output=True,
                                    text=True, timeout=60)
            still = set(queued.stdout.split()) if queued.returncode == 0 else waiting
            for job in sorted(waiting - still):
                progress(f"job {job} ({jobs[job][0].name}) left the queue")
            waiting &= still
        results = {}
        for job, (run, run_dir) in jobs.items():
            code = _tail(os.path.join(run_dir, "exit_code")).strip()
            if job in waiting:
                results[run.name] = f"cancelled after the {self.timeout_s:.0f} s timeout (job {job})"
            elif code == "0":
                results[run.name] = "ok"
            else:
                results[run.name] = (f"job {job} failed (exit {code or 'unknown'}; see "
                                     f"{run_dir}/slurm-{job}.out)")
        return results
