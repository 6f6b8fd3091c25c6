"""One side of a loss comparison ("NP:OVERRIDES"): its launcher command and a fresh run directory; the
child job itself runs through ``runtime/child_job.py`` (shared with ``hpctrain sweep``)."""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hpctrain.runtime import child_job
from hpctrain.runtime.outputs import mark, why_not_replaceable


class CompareError(Exception):
    """A problem that stops the comparison (bad arguments, a failed run, unreadable metrics): exit 2."""


@dataclass
class RunSpec:
    label: str
    nprocs: int
    overrides: list[str]


def parse_run_spec(label: str, text: str) -> RunSpec:
    """``"NP:OVERRIDES"`` -> RunSpec; OVERRIDES may be empty (``"2:"``)."""
    nprocs, colon, overrides = text.partition(":")
    try:
        n = int(nprocs.strip())
    except ValueError:
        n = 0
    if not colon or n < 1:
        raise CompareError(f"--{label.lower()} {text!r}: expected NP:OVERRIDES, e.g. "
                           f"'2:parallel.tp=2 train.lr=1e-3' (NP = number of ranks >= 1)")
    words = shlex.split(overrides)
    bad = [w for w in words if "=" not in w or "." not in w.partition("=")[0]]
    if bad:
        raise CompareError(f"--{label.lower()}: malformed override(s) {bad}: expected section.key=value")
    return RunSpec(label, n, words)


def resolve_launcher(launcher: str) -> list[str]:
    """The launcher command as a list; a bare program name is looked up beside ``sys.executable``
    first (a venv's ``mpiexec`` belongs to the MPI that mpi4py uses), then on PATH."""
    words = shlex.split(launcher)
    if not words:
        raise CompareError("--launcher is empty: give a launcher such as 'mpiexec' or 'srun --mpi=pmi2'")
    if os.sep not in words[0]:
        found = child_job.find_launcher(words[0])
        if found is None:
            raise CompareError(f"launcher {words[0]!r} not found beside {sys.executable} nor on PATH: install "
                               f"an MPI (pip install -e '.[mpi]') or pass --launcher with a full path")
        words[0] = found
    return words


def side_command(launcher: list[str], spec: RunSpec, run_dir: Path, config: str | None, common: list[str],
                 steps: int | None) -> list[str]:
    """The ``hpctrain train`` command of one side, writing into ``run_dir``."""
    args = ["--config", config] if config else []
    args += common + spec.overrides + [f"train.run_dir={run_dir}"]
    if steps is not None:
        args.append(f"train.steps={steps}")
    return child_job.train_command(launcher, spec.nprocs, args)


def run_side(cmd: list[str], run_dir: Path, timeout: float, label: str, console) -> None:
    """Run one side's training job (output to ``<run_dir>/train.log``); raise CompareError if it fails."""
    fresh_run_dir(run_dir)
    log_path = run_dir / "train.log"
    console.print(f"[bold]run {label}[/bold]: {shlex.join(cmd)}", highlight=False, soft_wrap=True)
    code = child_job.launch_training_job(cmd, log_path, timeout)
    if code is None:
        raise CompareError(f"run {label} timed out after {timeout:.0f} s (--timeout); its output is in "
                           f"{log_path}:\n{_tail(log_path)}")
    if code != 0:
        raise CompareError(f"run {label} failed with exit status {code}; its output is in {log_path}:\n"
                           f"{_tail(log_path)}")


def fresh_run_dir(run_dir: Path) -> None:
    """An empty ``run_dir``, marked as this tool's (``runtime/outputs.py``): a previous comparison's run
    there is removed (the metrics file is appended to and a checkpoint could be resumed, so an old run
    must not survive); a directory this tool did not write (a training run, anything else) is refused."""
    if run_dir.exists():
        problem = why_not_replaceable(str(run_dir), f"--out: {run_dir}")
        if problem:
            raise CompareError(problem)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    mark(str(run_dir), "hpctrain.tools.loss_compare")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join("    " + line for line in text[-lines:]) or "    (no output)"
