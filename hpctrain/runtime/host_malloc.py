"""Host memory that a training step frees is kept for the next step (``train.host_malloc``), not given back.

A step on the CPU allocates and frees the same activations, gradients and messages every micro-batch. glibc's
malloc serves a request above its mmap threshold (128 KiB, raised dynamically up to 32 MiB) with a fresh
``mmap`` and returns it to the kernel on free, and trims the top of its heap above 128 KiB: the next step's
allocations then fault every page in again (zeroed by the kernel), which costs system time in proportion to the
bytes held between passes. A zero-bubble schedule, which keeps each linear's (x, dy) from its B to its W, paid
it most (docs/benchmarks.md, "Pipeline schedules").

``keep_freed_host_memory`` sets, through ``mallopt``, the mmap threshold to its ceiling (32 MiB on 64-bit: only
larger requests are mapped) and the trim threshold to ``TRIM_THRESHOLD`` (the heap is not shrunk below it), so a
freed block is reused. The peak resident memory is that of the largest step, as before; it is not returned
between steps. Only glibc has ``mallopt``: elsewhere nothing changes. Process-wide, local to this rank.
"""
from __future__ import annotations

import ctypes
import functools

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 2**31 - 1  # the heap shrinks only past 2 GiB free at its top (mallopt takes an int)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (module docstring); False where this is not glibc or it
    refused a setting."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                      TRIM_THRESHOLD))


def configure_host_malloc(setting: str, device: torch.device) -> str:
    """``train.host_malloc`` ("auto": keep on a CPU device, where every activation is host memory; "keep";
    "system": glibc's own behaviour) for a rank training on ``device``: the words for ``--verbose``."""
    if setting == "system" or (setting == "auto" and torch.device(device).type != "cpu"):
        return "host malloc: the C library's own (train.host_malloc=" + setting + ")"
    if keep_freed_host_memory():
        return (f"host malloc: freed memory kept for reuse (glibc mallopt: mmap above {MMAP_THRESHOLD >> 20} MiB, "
                f"heap trimmed past 2 GiB free; train.host_malloc={setting})")
    return f"host malloc: the C library's own (not glibc; train.host_malloc={setting})"
