"""What one rank contributes to a checkpoint: the write items of a ``Snapshot``, in host memory, and the
checkpoint error every reader and writer raises."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hpctrain.checkpoint.format import Box
from hpctrain.errors import HpcTrainError


class CheckpointError(HpcTrainError):
    """A checkpoint cannot be written or read; the message names the file and the problem."""


@dataclass
class WriteItem:
    dataset: str
    box: Box
    data: np.ndarray  # host copy, disk dtype, shape == box.shape


@dataclass
class Snapshot:
    """Everything one rank contributes to a checkpoint, copied to host memory (safe to write later)."""

    step: int
    datasets: dict  # name -> (shape, numpy dtype str): this rank's view; the union is taken at write time
    items: list[WriteItem] = field(default_factory=list)
    attrs: dict = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)  # datasets of ``items`` with inf/NaN, set by the writer


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors``: device tensors go into pinned buffers with non-blocking copies and ONE
    synchronisation (the stall of a save from GPUs is this device-to-host copy); host tensors pass as is
    (the snapshot copies their pieces below). Callable from a background thread (the asynchronous save's)."""
    if not any(t.is_cuda for t in tensors):
        return tensors
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    device = next(t.device for t in tensors if t.is_cuda)  # the copies ran on its current stream, from any thread
    with torch.cuda.device(device):
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
    done.synchronize()
    return hosts
