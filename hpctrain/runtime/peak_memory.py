"""The peak memory of this rank, for the run's memory-per-GPU report (``hpctrain/train/loop.py``).

``peak_memory(device)`` -> (bytes, source): on CUDA ``torch.cuda.max_memory_allocated`` (the tensors the
caching allocator handed out at the peak, as ``hpctrain plan`` models them; the allocator's reserve and the
CUDA context come on top); on the host the process's peak resident set size (``resource.getrusage``:
ru_maxrss, KiB on Linux, bytes on macOS), a stand-in that includes the Python interpreter, torch and the
corpus. Per process, no communication.
"""
from __future__ import annotations

import resource
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
