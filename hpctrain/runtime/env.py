"""Every environment variable hpctrain reads, each read in exactly one function here (typed, validated).

Settings (a bad value raises ``EnvError`` naming the variable; an empty variable counts as unset):

    variable                type   default                                  config key      read by
    HPCTRAIN_COMM_TIMEOUT   float  the config key (600)                     comm.timeout_s  comm_timeout_s
    HPCTRAIN_CACHE          path   the config key, else ~/.cache/hpctrain   data.cache_dir  cache_dir
    HPCTRAIN_ERROR_GRACE_S  float  1.0                                      -               error_grace_s
    HPCTRAIN_FAULT          str    "" (no fault; test-only)                 -               fault_spec
    HPCTRAIN_FAULT_ONCE     path   "" (fire on every launch; test-only)     -               fault_once_marker
    HPCTRAIN_GLOO_ADDR      str    loopback, or rank 0's hostname           -               gloo_addr
    HPCTRAIN_NS_DIR         path   /tmp/hpctrain-ns                         -               ns_dir

Precedence, the one rule: a set variable wins over its config key, wherever the key's value came from
(default, file or ``section.key=value``); a value the calling code passes explicitly (e.g.
``ProcessGrid.build(timeout_s=...)``, a command's own ``--comm-timeout``) wins over both.

Facts about the launch, read where they are simple: ``SLURM_RESTART_COUNT`` (``slurm_restart_count``),
``SLURM_JOB_ID`` (``slurm_job_id``), ``SLURM_STEP_ID`` (``slurm_step_id``), ``SLURM_PMI2_PMI_JOBID``
(``slurm_pmi2_jobid``), the batch systems' job ids (``in_batch_job``), ``OMP_NUM_THREADS``
(``omp_num_threads``), ``CUDA_VISIBLE_DEVICES`` (``cuda_visible_devices``), ``MPI4PY_LIBMPI``
(``mpi4py_libmpi``). The launchers' variables
that need interpreting (``SLURM_*``, ``OMPI_*``, ``PMI_*``, ...) are read by ``runtime/launcher.py``
and ``runtime/signals.py`` from an ``env`` mapping. ``child_environ`` builds a child process's
environment. Every function takes ``environ`` (default ``os.environ``) so tests pass a dict.
"""
from __future__ import annotations

import os
from typing import Mapping

from hpctrain.errors import HpcTrainError

SETTINGS = ("HPCTRAIN_COMM_TIMEOUT", "HPCTRAIN_CACHE", "HPCTRAIN_ERROR_GRACE_S", "HPCTRAIN_FAULT",
            "HPCTRAIN_FAULT_ONCE", "HPCTRAIN_GLOO_ADDR", "HPCTRAIN_NS_DIR", "HPCTRAIN_NODE_FAILURE_FILE")
BATCH_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "FLUX_JOB_ID")


class EnvError(HpcTrainError):
    """An environment variable holds a value hpctrain cannot use; the message names it."""


def _get(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or None


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also rejects nan
        raise EnvError(f"${name}={text!r}: expected a number of seconds >= 0 (unset it for the default)")
    return value


def _count(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise EnvError(f"${name}={text!r}: expected an integer >= {minimum}")
    return value


# ---------------------------------------------------------------- hpctrain settings
def comm_timeout_s(configured: float, environ: Mapping[str, str] | None = None) -> float:
    """``$HPCTRAIN_COMM_TIMEOUT`` when set, else ``configured`` (``comm.timeout_s``); 0 = no watchdog."""
    text = _get("HPCTRAIN_COMM_TIMEOUT", environ)
    return float(configured) if text is None else _seconds("HPCTRAIN_COMM_TIMEOUT", text)


def cache_dir(configured: str = "", environ: Mapping[str, str] | None = None) -> str:
    """``$HPCTRAIN_CACHE`` when set, else ``configured`` (``data.cache_dir``), else ``~/.cache/hpctrain``."""
    text = _get("HPCTRAIN_CACHE", environ)
    return text or configured or os.path.join(os.path.expanduser("~"), ".cache", "hpctrain")


def node_failure_file(environ: Mapping[str, str] | None = None) -> str | None:
    """``$HPCTRAIN_NODE_FAILURE_FILE``: where a job that ends with a node failure (exit 5) writes the names of
    the failed nodes, one per line (``slurm/train.sbatch --restarts`` sets it and relaunches without them)."""
    return _get("HPCTRAIN_NODE_FAILURE_FILE", environ)


def earlier_steps_ended(environ: Mapping[str, str] | None = None) -> bool:
    """``$HPCTRAIN_EARLIER_STEPS_ENDED=1``: every earlier job step of this Slurm job (and attempt) has returned
    (``slurm/train.sbatch --restarts`` runs its steps one after the other), so a run lock one of them left on
    another host is taken over at once."""
    return _get("HPCTRAIN_EARLIER_STEPS_ENDED", environ) == "1"


def error_grace_s(environ: Mapping[str, str] | None = None) -> float:
    """``$HPCTRAIN_ERROR_GRACE_S`` (default 1 s): how long a failing rank waits for its peers to print
    their errors (or a hang report to be forwarded) before the job is aborted."""
    text = _get("HPCTRAIN_ERROR_GRACE_S", environ)
    return 1.0 if text is None else _seconds("HPCTRAIN_ERROR_GRACE_S", text)


def fault_spec(environ: Mapping[str, str] | None = None) -> str:
    """``$HPCTRAIN_FAULT`` (test-only; ``""`` = none), parsed and validated by ``runtime/faults.py``."""
    return _get("HPCTRAIN_FAULT", environ) or ""


def fault_once_marker(environ: Mapping[str, str] | None = None) -> str:
    """``$HPCTRAIN_FAULT_ONCE`` (test-only): a file path; the fault fires only while it does not exist and
    creates it, so a resubmitted or requeued job runs clean (``""`` = fire every launch)."""
    return _get("HPCTRAIN_FAULT_ONCE", environ) or ""


def gloo_addr(environ: Mapping[str, str] | None = None) -> str | None:
    """``$HPCTRAIN_GLOO_ADDR``: the address rank 0 offers to gloo in ``bench comm`` (None = choose)."""
    return _get("HPCTRAIN_GLOO_ADDR", environ)


def ns_dir(environ: Mapping[str, str] | None = None) -> str:
    """``$HPCTRAIN_NS_DIR`` (default ``/tmp/hpctrain-ns``): the state of ``scripts/two_hosts.sh``."""
    return _get("HPCTRAIN_NS_DIR", environ) or "/tmp/hpctrain-ns"


# ---------------------------------------------------------------- facts about the launch
def slurm_restart_count(environ: Mapping[str, str] | None = None) -> int:
    """``$SLURM_RESTART_COUNT``: how often Slurm requeued this job (0 outside Slurm)."""
    text = _get("SLURM_RESTART_COUNT", environ)
    return 0 if text is None else _count("SLURM_RESTART_COUNT", text, 0)


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SLURM_JOB_ID``, or None outside a Slurm job."""
    return _get("SLURM_JOB_ID", environ)


def launcher_local_rank(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's rank on its node as the launcher set it before MPI starts (hydra's ``MPI_LOCALRANKID``,
    Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``, Slurm's ``SLURM_LOCALID``), or None: only for saying something
    once per node before MPI can be asked (``runtime/launcher.py`` asks MPI afterwards)."""
    return next((v for v in (_get(n, environ) for n in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                                                        "SLURM_LOCALID")) if v is not None), None)


def slurm_step_id(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SLURM_STEP_ID`` (set in the tasks of an ``srun`` step), or None."""
    return _get("SLURM_STEP_ID", environ)


def slurm_pmi2_jobid(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SLURM_PMI2_PMI_JOBID``: the PMI job id Slurm's pmi2 plugin uses instead of "jobid.stepid" when set."""
    return _get("SLURM_PMI2_PMI_JOBID", environ)


def in_batch_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a batch scheduler (Slurm, PBS, LSF, Cobalt, Flux) started this process."""
    return any(_get(name, environ) for name in BATCH_JOB_VARIABLES)


def batch_job_id(environ: Mapping[str, str] | None = None) -> str:
    """The batch scheduler's job id (the first of ``BATCH_JOB_VARIABLES`` set), else ""."""
    return next((value for name in BATCH_JOB_VARIABLES if (value := _get(name, environ))), "")


def omp_num_threads(environ: Mapping[str, str] | None = None) -> int:
    """``$OMP_NUM_THREADS`` (its first level when nested, ``4,2``), default 1: torch's CPU threads."""
    text = _get("OMP_NUM_THREADS", environ)
    return 1 if text is None else _count("OMP_NUM_THREADS", text.split(",")[0].strip(), 1)


def mpi4py_libmpi(environ: Mapping[str, str] | None = None) -> str | None:
    """``$MPI4PY_LIBMPI`` (the MPI library mpi4py loads instead of its default; for messages), or None."""
    return _get("MPI4PY_LIBMPI", environ)


def inductor_compile_threads_set(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``$TORCHINDUCTOR_COMPILE_THREADS`` is set (inductor reads it itself; hpctrain then leaves its
    compile workers alone)."""
    return _get("TORCHINDUCTOR_COMPILE_THREADS", environ) is not None


def cuda_visible_devices(environ: Mapping[str, str] | None = None) -> str | None:
    """``$CUDA_VISIBLE_DEVICES`` as given (for messages), or None when unset."""
    return (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")


# ---------------------------------------------------------------- children
def child_environ(set_: Mapping[str, str] | None = None, defaults: Mapping[str, str] | None = None,
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: ``defaults`` where unset, then ``set_`` over it."""
    child = dict(os.environ if environ is None else environ)
    for name, value in (defaults or {}).items():
        child.setdefault(name, value)
    child.update(set_ or {})
    return child
