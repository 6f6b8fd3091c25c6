"""Which container this process runs in, and the flag that fixes what containers typically get wrong.

A container is recognised by the marker its runtime leaves in the root file system: Kubernetes' service
account mount, podman's ``/run/.containerenv``, docker's ``/.dockerenv``, Apptainer's ``/.singularity.d``.
Errors about /dev/shm (comm/shm_memory.py), the run directory (train/run_lock.py) and the MPI library
(runtime/launcher.py) end with the fix for that runtime (docs/containers.md); outside a container, or in one
these do not recognise, the fix is "" and the message stays as it is.
"""
from __future__ import annotations

import os

KUBERNETES, PODMAN_DOCKER, APPTAINER = "kubernetes", "podman/docker", "apptainer"
MPI_DOC = "docs/containers.md#mpi-inside-vs-host-mpi-bind-mounted"


def container_kind(root: str = "/") -> str:
    """``KUBERNETES``, ``PODMAN_DOCKER``, ``APPTAINER`` or "" (not in a container these leave a marker for)."""
    def exists(path: str) -> bool:
        return os.path.exists(os.path.join(root, path))

    if exists("var/run/secrets/kubernetes.io"):  # first: a pod may run under docker too
        return KUBERNETES
    if exists("run/.containerenv") or exists(".dockerenv"):
        return PODMAN_DOCKER
    if exists(".singularity.d"):
        return APPTAINER
    return ""


def shm_fix(kind: str) -> str:
    """How to give a container of ``kind`` a larger /dev/shm ("" for none)."""
    return {KUBERNETES: "mount an emptyDir with `medium: Memory` at /dev/shm (64 MiB by default; "
                        "containers/k8s/mpijob.yaml)",
            PODMAN_DOCKER: "run it with --shm-size=1g (podman and docker give it 64 MiB by default)",
            APPTAINER: "bind the host's: apptainer exec --bind /dev/shm (or leave out --contain / --containall)",
            }.get(kind, "")


def bind_fix(kind: str, path: str) -> str:
    """How to make ``path`` a writable host directory inside a container of ``kind`` ("" for none)."""
    if kind == KUBERNETES:
        return f"mount a writable volume (a PersistentVolumeClaim, not readOnly) at {path}"
    if kind in (PODMAN_DOCKER, APPTAINER):
        return (f"bind a writable host directory there (podman/docker -v HOST_DIR:{path}, without :ro; "
                f"apptainer --bind HOST_DIR:{path})")
    return ""


def mpi_fix(kind: str) -> str:
    """What to do in a container of ``kind`` when the launcher's MPI and the image's differ ("" for none)."""
    if kind == PODMAN_DOCKER:
        return ("start the ranks with the image's mpiexec inside one container (podman run ... IMAGE mpiexec -n N "
                f"hpctrain ...), or bind the host's MPICH-ABI MPI in and name it with -e MPI4PY_LIBMPI=... ({MPI_DOC})")
    if kind == APPTAINER:
        return ("launch with srun --mpi=pmi2 (the image's MPICH speaks PMI-2), or bind the host's MPICH-ABI MPI in "
                f"(--bind) and name it with --env MPI4PY_LIBMPI=... ({MPI_DOC})")
    if kind == KUBERNETES:
        return f"launch with the image's mpiexec from the MPIJob's launcher pod (containers/k8s/mpijob.yaml; {MPI_DOC})"
    return ""
