"""Who am I and where am I: rank, size, node and local rank, from MPI, cross-checked with the launcher.

MPI is the source of truth (``COMM_WORLD`` and ``Split_type(COMM_TYPE_SHARED)``); the launcher's
environment (Open MPI, MPICH Hydra, Slurm srun, Cray PALS, PMIx) is only read to detect launch mistakes,
the commonest being ``srun`` without ``--mpi=pmi2`` (or an mpi4py built against another MPI), which
starts N independent 1-rank worlds. No TCP rendezvous and no ``hostname -I``: ranks find each other
through MPI alone.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpctrain.errors import LaunchError
from hpctrain.runtime.container import MPI_DOC, container_kind, mpi_fix


@dataclass(frozen=True)
class LauncherEnv:
    """What the launcher's environment says about this process (fields None when not provided)."""

    name: str  # "openmpi" | "hydra" | "slurm" | "pals" | "pmix" | "pmi" | "none"
    rank: int | None = None
    size: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    source: str = ""  # the variables read, for error messages


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def read_launcher_env(env: Mapping[str, str] | None = None) -> LauncherEnv:
    """Identify the launcher from environment variables, most specific first.

    mpiexec inside a Slurm batch script inherits the batch shell's ``SLURM_*`` variables, so MPI
    launchers' own variables win over Slurm's; Slurm counts only inside an ``srun`` step.
    """
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_SIZE" in env:
        return LauncherEnv("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                           _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                           "OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}")
    if "PMI_RANK" in env and "MPI_LOCALRANKID" in env:
        return LauncherEnv("hydra", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                           _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"),
                           "PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS")
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return LauncherEnv("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS"),
                           _int(env, "SLURM_LOCALID"), None,
                           "SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID")
    if "PALS_RANKID" in env:
        return LauncherEnv("pals", _int(env, "PALS_RANKID"), None, _int(env, "PALS_LOCAL_RANKID"), None,
                           "PALS_RANKID, PALS_LOCAL_RANKID")
    if "PMIX_RANK" in env:
        return LauncherEnv("pmix", _int(env, "PMIX_RANK"), None, None, None, "PMIX_RANK")
    if "PMI_RANK" in env:
        return LauncherEnv("pmi", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"), None, None, "PMI_RANK, PMI_SIZE")
    return LauncherEnv("none")


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job. ``node`` indexes nodes 0..num_nodes-1 in order of their lowest rank."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    hostname: str
    launcher: LauncherEnv
    mpi_library: str
    node_of_rank: tuple[int, ...] = field(repr=False, default=())  # node index of every world rank
    local_rank_of_rank: tuple[int, ...] = field(repr=False, default=())


def check_launcher_agreement(mpi_rank: int, mpi_size: int, mpi_local_rank: int, launcher: LauncherEnv,
                             mpi_library: str = "", container: str = "") -> list[str]:
    """Compare MPI's view with the launcher's. Raises LaunchError on rank/size mismatch; returns warnings.
    ``mpi_library``: MPI's own name for the library this process loaded, named in the error; ``container``:
    ``runtime.container.container_kind()``, whose fix (the image's mpiexec, or the host MPI bound in) the
    error then gives."""
    loaded = f" (this process loaded {mpi_library})" if mpi_library else ""
    fix = mpi_fix(container)
    if launcher.size is not None and launcher.size != mpi_size:
        if launcher.name == "slurm":
            hint = "srun started the tasks without a PMI that this MPI understands: use `srun --mpi=pmi2` " \
                   "(or set MpiDefault=pmi2)"
        elif fix:
            hint = f"the launcher's MPI is not this container's; {fix}"
        else:
            hint = ("the launcher and mpi4py use different MPI libraries: rebuild mpi4py against the launcher's MPI "
                    "(`MPICC=... pip install --no-binary=mpi4py mpi4py`) or launch with the matching mpiexec")
        raise LaunchError(
            f"launch mismatch: {launcher.name} started {launcher.size} tasks ({launcher.source}) but this "
            f"process's MPI world has {mpi_size} rank(s){loaded}; {hint}.")
    if launcher.rank is not None and launcher.rank != mpi_rank:
        raise LaunchError(
            f"launch mismatch: {launcher.name} says rank {launcher.rank} ({launcher.source}) but MPI says rank "
            f"{mpi_rank}{loaded}; the launcher and mpi4py's MPI library disagree"
            + (f"; {fix}." if fix else "."))
    notes = []
    if launcher.local_rank is not None and launcher.local_rank != mpi_local_rank:
        notes.append(f"{launcher.name} local rank {launcher.local_rank} differs from MPI's node-local rank "
                     f"{mpi_local_rank}; hpctrain uses MPI's (device binding follows it)")
    return notes


THREAD_LEVEL_HELP = ("Cray MPICH: export MPICH_MAX_THREAD_SAFETY=multiple; Open MPI: use a build with "
                     "MPI_THREAD_MULTIPLE support (ompi_info | grep -i thread); MPICH and Intel MPI provide it by "
                     "default; mpi4py requests it unless MPI4PY_RC_THREAD_LEVEL (or mpi4py.rc.thread_level) says "
                     "otherwise")


def missing_thread_multiple(feature: str, needed: str = "MULTIPLE") -> str | None:
    """Why ``feature`` (which calls MPI from a helper thread) cannot run, or None: the MPI library gave
    less than MPI_THREAD_``needed`` (MULTIPLE: calls from two threads at once; SERIALIZED: from any thread,
    one at a time; ``MPI.Query_thread``). The message names the level provided and how to get MULTIPLE
    on common MPIs."""
    from mpi4py import MPI

    provided = MPI.Query_thread()
    if provided >= {"SERIALIZED": MPI.THREAD_SERIALIZED, "MULTIPLE": MPI.THREAD_MULTIPLE}[needed]:
        return None
    names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
    return (f"{feature} calls MPI from a helper thread, which needs MPI_THREAD_{needed}, but this MPI "
            f"provides MPI_THREAD_{names.get(provided, provided)}. {THREAD_LEVEL_HELP}")


def import_mpi():
    """``mpi4py.MPI``, initialising MPI; a library mpi4py cannot load (a host MPI bound into a container that
    is not MPICH-ABI, a missing dependency, a wrong ``MPI4PY_LIBMPI``) is one LaunchError line naming it."""
    try:
        from mpi4py import MPI
    except ModuleNotFoundError as exc:
        if exc.name not in ("mpi4py", "mpi4py.MPI"):
            raise
        raise LaunchError("mpi4py is not installed: pip install 'hpctrain[mpi]' (mpi4py and the PyPI MPICH), or "
                          "mpi4py built against your MPI (MPICC=mpicc pip install --no-binary=mpi4py mpi4py)") from exc
    except (ImportError, OSError, RuntimeError) as exc:
        from hpctrain.runtime.env import mpi4py_libmpi

        reason = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        named = mpi4py_libmpi()
        raise LaunchError(f"cannot load the MPI library for mpi4py: {reason}"
                          + (f" (MPI4PY_LIBMPI={named})" if named else "")
                          + f"; a host MPI named by MPI4PY_LIBMPI must be MPICH-ABI (MPICH, Cray MPICH, Intel MPI, "
                            f"MVAPICH) and, in a container, be bound in with the libraries it needs ({MPI_DOC})") from exc
    return MPI


def discover(mpi_world=None, env: dict | None = None) -> RankInfo:
    """Collective over ``mpi_world`` (an mpi4py communicator; default COMM_WORLD): find rank, node and
    local rank of every process."""
    from mpi4py import MPI

    mpi_world = MPI.COMM_WORLD if mpi_world is None else mpi_world
    rank, size = mpi_world.Get_rank(), mpi_world.Get_size()
    node_comm = mpi_world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
        node_leader = node_comm.allreduce(rank, op=MPI.MIN)
    finally:
        node_comm.Free()
    launcher = read_launcher_env(env)
    library = " ".join((MPI.Get_library_version().splitlines() or [""])[0].split())
    if mpi_world is MPI.COMM_WORLD:  # a sub-world (tests' COMM_SELF reference runs) is not the launch
        # every rank checks itself, so a bad launch fails everywhere without communication
        for note in check_launcher_agreement(rank, size, local_rank, launcher, library, container_kind()):
            warnings.warn(f"rank {rank}: {note}", stacklevel=2)
    leaders_and_locals = mpi_world.allgather((node_leader, local_rank))
    leaders = sorted({leader for leader, _ in leaders_and_locals})
    node_of_rank = tuple(leaders.index(leader) for leader, _ in leaders_and_locals)
    return RankInfo(
        rank=rank, size=size, local_rank=local_rank, local_size=local_size,
        node=node_of_rank[rank], num_nodes=len(leaders), hostname=MPI.Get_processor_name(),
        launcher=launcher, mpi_library=library,
        node_of_rank=node_of_rank, local_rank_of_rank=tuple(loc for _, loc in leaders_and_locals))


def bind_device(info: RankInfo):
    """Pick this rank's accelerator by node-local rank; returns a ``torch.device``.

    Respects ``CUDA_VISIBLE_DEVICES`` (torch only sees the visible devices): with one visible device
    per rank (Slurm's ``--gpus-per-task``) every rank uses its device 0.
    """
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = info.local_rank % count
    if info.local_size > count:
        warnings.warn(f"rank {info.rank}: {info.local_size} ranks share {count} visible GPU(s) on "
                      f"{info.hostname}; GPUs are oversubscribed", stacklevel=2)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
