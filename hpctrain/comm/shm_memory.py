"""Backing a shared window with memory before anyone touches it (used by shm.py).

MPICH's ``MPI.Win.Allocate_shared`` maps a SPARSE file: node rank 0 creates
``/dev/shm/mpich_shar_tmpXXXXXX`` (``/tmp/...`` when /dev/shm is not writable), sets its size with one
write at the end, every rank maps it, and rank 0 unlinks it as soon as all have (so the memory goes
back to the system when the last rank exits, killed or not). Where /dev/shm cannot hold the window (a
container's small /dev/shm, or one filled by other jobs' leftovers) the allocation still succeeds and
the first write to an unbacked page kills the process with SIGBUS. ``populate`` asks the kernel to back
the pages now (``madvise(MADV_POPULATE_WRITE)``, Linux >= 5.14), which fails with an error instead, so
``comm.intra_node`` can fall back (auto) or refuse (shm) with the reason. docs/architecture.md,
"Node-local shared memory", has the measured facts.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

from hpctrain.runtime.container import container_kind, shm_fix

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); older kernels answer EINVAL: nothing can be checked
SHM_DIR = "/dev/shm"  # where MPICH (and most MPIs) put the window's file


def populate(address: int, nbytes: int) -> str:
    """Back ``nbytes`` of mapped memory at ``address`` with pages now (contents unchanged). Returns ""
    when backed (or the kernel cannot tell), else one line: why the node cannot hold them."""
    if nbytes <= 0:
        return ""
    page = mmap.PAGESIZE
    start = address - address % page  # madvise wants a page-aligned start; neighbours' pages are harmless
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start),
                      ctypes.c_int(MADV_POPULATE_WRITE))
    if rc == 0:
        return ""
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # an older kernel, or a sandbox: no answer
        return ""
    fix = container_shm_fix()
    return (f"{SHM_DIR} cannot hold it (MADV_POPULATE_WRITE: {os.strerror(err)}; {shm_free_bytes()} bytes free "
            f"there): too small (a container's default?) or full (leftover segments of killed jobs?)"
            + (f"; in this container: {fix}" if fix else ""))


def container_shm_fix(root: str = "/") -> str:
    """How to give the container this process runs in a larger /dev/shm (runtime/container.py); "" outside a
    container it recognises."""
    return shm_fix(container_kind(root))


def shm_free_bytes(path: str = SHM_DIR) -> int | str:
    """Free bytes of the file system at ``path`` (for the message), or "unknown"."""
    try:
        st = os.statvfs(path)
    except OSError:
        return "unknown"
    return st.f_bavail * st.f_frsize


MPI_SHM_FLOOR = 2 << 20  # MPICH's node segment is 2 MiB at 2 ranks: below this, MPI_Init dies of SIGBUS


def too_small_for_mpi(path: str = SHM_DIR, root: str = "/") -> str | None:
    """Before MPI starts (no MPI call may be made: MPI_Init itself would die of SIGBUS): why ``path`` cannot hold
    MPI's shared memory on this node (less than ``MPI_SHM_FLOOR`` free: the least any job needs; more ranks
    need more, and the shared-memory window says so itself later), with the container's fix; None when it
    holds that much or cannot be read."""
    free = shm_free_bytes(path)
    if not isinstance(free, int) or free >= MPI_SHM_FLOOR:
        return None
    fix = container_shm_fix(root)
    return (f"{path} has {free / 2**20:.1f} MiB free; MPI's shared memory on this node needs at least "
            f"{MPI_SHM_FLOOR / 2**20:.0f} MiB (MPI_Init would die of SIGBUS)"
            + (f": in this container, {fix}" if fix else ": remove leftover segments of killed jobs from it, or "
               "enlarge it (mount -o remount,size=1G /dev/shm)"))
