"""The checkpoints directory: step directories, the ``latest`` pointer, crash-safe retiring and recovery.

Layout (docs/checkpoint-format.md): ``<dir>/step-NNNNNNNN/`` (complete when it holds ``COMPLETE``),
``<dir>/latest`` (the name of the newest published one), transient ``.tmp-step-*`` (being written),
``.retired-*`` (being deleted) and ``step-N.replaced`` (moved aside by a re-save of step N). Pure file
system functions, no MPI: the manager calls them on rank 0 (or on every rank, read-only).
"""
from __future__ import annotations

import errno
import os
import shutil

from hpctrain.checkpoint.format import COMPLETE_MARKER, LATEST_POINTER, MASTER_FILE, STEP_PREFIX


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_size(nbytes: float) -> str:
    for unit in _UNITS:
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return ""


def free_bytes(path: str) -> int:
    """Bytes this user may still write on the file system holding ``path`` (``statvfs``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


METADATA_BYTES = 1 << 20  # room kept for HDF5's metadata on top of a checkpoint's data


def space_shortfall(step: int, data_bytes: int, free: int, where: str) -> str | None:
    """Why the checkpoint of ``step`` (``data_bytes`` of tensors, every rank's) cannot be written in
    ``where`` with ``free`` bytes left, saying by how much; None when it fits (with its metadata)."""
    needed = data_bytes + METADATA_BYTES
    if needed <= free:
        return None
    unit = human_size(needed).split()[1]  # the three figures in one unit, so they add up as printed

    def size(n: int) -> str:
        text = f"{n / 1024 ** _UNITS.index(unit):.1f} {unit}"
        return human_size(n) if unit == "B" or text.startswith("0.0 ") else text
    return (f"the checkpoint of step {step} does not fit in {where}: it needs {size(needed)} with metadata "
            f"({human_size(data_bytes)} of data + {human_size(METADATA_BYTES)}), {size(free)} free: "
            f"{size(needed - free)} short")


def enospc_detail(error: str, data_bytes: int, path: str, where: str) -> str:
    """``error`` (a failed write's line), with the space figures added when the OS said "no space left on
    device" (ENOSPC): the free space of ``path``'s file system now and what the checkpoint needs."""
    if os.strerror(errno.ENOSPC).lower() not in error.lower():
        return error
    try:
        free = f"{human_size(free_bytes(path))} free"
    except OSError:
        free = "free space unknown"
    return (f"{error} (no space left on device: {free} in {where} now, the checkpoint needs "
            f"{human_size(data_bytes + METADATA_BYTES)} with metadata)")


def fsync_path(path: str) -> None:
    """fsync one file or directory by path (what a save does to every file and directory it writes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


RETIRED_PREFIX = ".retired-"


def retire(path: str) -> None:
    """Delete a published checkpoint crash-safely: rename it out of the step namespace first (atomic),
    then delete. A kill midway leaves a ``.retired-*`` directory that no listing shows as a checkpoint
    and that the next save removes, never a half-deleted ``step-*``."""
    parent, name = os.path.split(path)
    retired = os.path.join(parent, RETIRED_PREFIX + name)
    os.rename(path, retired)
    fsync_path(parent)
    shutil.rmtree(retired, ignore_errors=True)


def list_checkpoints(directory: str) -> list[dict]:
    """Published step directories, oldest first: {step, path, complete, latest}."""
    if not os.path.isdir(directory):
        return []
    latest = read_latest(directory)
    records = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(STEP_PREFIX) and os.path.isdir(path):
            try:
                step = int(name[len(STEP_PREFIX):])
            except ValueError:
                continue
            records.append({"step": step, "path": path, "complete": os.path.exists(os.path.join(path, COMPLETE_MARKER)),
                            "latest": name == latest})
    return sorted(records, key=lambda r: r["step"])


REPLACED_SUFFIX = ".replaced"


def recover_replaced(directory: str) -> list[str]:
    """Rank 0: put back a published step directory that a save of the same step moved aside
    (``step-N.replaced``) when the new copy never took its name (a kill between the two renames).
    Returns the steps put back."""
    restored: list[str] = []
    if not os.path.isdir(directory):
        return restored
    for name in os.listdir(directory):
        final = os.path.join(directory, name.removesuffix(REPLACED_SUFFIX))
        if name.startswith(STEP_PREFIX) and name.endswith(REPLACED_SUFFIX) and not os.path.exists(final):
            os.rename(os.path.join(directory, name), final)
            restored.append(os.path.basename(final))
    return restored


def resolve_latest(path: str) -> str:
    """``path`` itself, or, for a checkpoints directory (or a run directory with ``checkpoints/``) without a
    checkpoint.h5 of its own, the step directory its ``latest`` names (e.g. what ``hpctrain import-hf`` wrote)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, MASTER_FILE)):
        return path
    checkpoints = os.path.join(path, "checkpoints")
    directory = checkpoints if os.path.isdir(checkpoints) else path
    latest = read_latest(directory)
    return os.path.join(directory, latest) if latest else path


def read_latest(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, LATEST_POINTER), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
