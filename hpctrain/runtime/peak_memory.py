"""The peak memory of this rank, for the run's memory-per-GPU report (``hpctrain/train/loop.py``).

``peak_memory(device)`` -> (bytes, source): on CUDA ``torch.cuda.max_memory_allocated`` (the tensors the
caching allocator handed out at the peak, as ``hpctrain plan`` models them; the allocator's reserve and the
CUDA context come on top); on the host the process's peak resident set size (``resource.getrusage``:
ru_maxrss, KiB on Linux, bytes on macOS), a stand-in that includes the Python interpreter, torch and the
corpus. Per process, no communication.

``available_memory(device)`` -> (bytes, what was read) or None: what a model may still take before it is
allocated: on CUDA the device's free memory (``torch.cuda.mem_get_info``); on the host ``MemAvailable``
of /proc/meminfo, or less when this process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)
leaves less; None where neither can be read (not Linux).
"""
from __future__ import annotations

import os
import resource
import socket
import sys

import torch

CUDA_SOURCE = "torch.cuda.max_memory_allocated"
HOST_SOURCE = "peak RSS of the process (getrusage; CPU stand-in for device memory)"


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(peak bytes of this process on ``device``, how it was measured)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), CUDA_SOURCE
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024), HOST_SOURCE


def available_memory(device: torch.device, root: str = "/") -> tuple[int, str] | None:
    """(bytes a new allocation on ``device`` may still take, where the figure comes from), or None if unknown.
    ``root``: prefix of /proc and /sys (tests)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device} (torch.cuda.mem_get_info)"
    try:
        with open(os.path.join(root, "proc/meminfo"), encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    where = f"available on host {socket.gethostname()} (MemAvailable)"
    limited = _cgroup_room(root)
    if limited is not None and limited < available:
        return limited, f"left under the memory limit of this process's cgroup on host {socket.gethostname()}"
    return available, where


def _cgroup_room(root: str) -> int | None:
    """The memory limit of this process's cgroup minus its usage (v2, else v1), or None when unlimited."""
    base = os.path.join(root, "sys/fs/cgroup")
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(base, limit_file), encoding="ascii") as f:
                limit = f.read().strip()
            with open(os.path.join(base, usage_file), encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes "unlimited" as ~2**63
            return None
        return max(0, int(limit) - usage)
    return None
