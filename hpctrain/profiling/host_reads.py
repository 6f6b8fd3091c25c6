"""Host reads of device values: the calls that make the host wait for a GPU, found on any device.

On CUDA the host only queues work, until it needs a value the device computes: ``.item()``, ``float(t)``,
``int(t)``, ``bool(t)`` or ``if t:`` (aten ``_local_scalar_dense``, ``is_nonzero``, ``equal``), an op
whose output shape depends on the data (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
without ``output_size``, indexing with a boolean mask), a blocking copy between the GPU and pageable host
memory, or a Python number stored into a tensor element (``v[i] = 0.0``: torch lifts the number into a
host tensor and copies it over, a synchronous host-to-device copy on a GPU). Each of them stalls the
queue until the device has caught up: a sync inside the training step. ``torch.cuda.set_sync_debug_mode``
reports them on a GPU; ``HostReadAudit`` reports the same calls on any device, the CPU included, so the
sync-free step (hpctrain/train/verdict.py) is proven free of them by a test on a machine without a GPU
(tests/mpi/test_host_reads.py).

It is a ``TorchDispatchMode``: every aten op run inside the ``with`` block passes through Python, so it is
slow (a diagnosis and test tool, never on in a run). What it cannot see: ``.tolist()`` and ``.numpy()`` of a
CPU tensor (no aten op runs; on a GPU they need a copy to the host first, which it does see), and work
on other threads. A site is the innermost frame of the ``package`` (default hpctrain) that made the call.
"""
from __future__ import annotations

import collections
import os
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal"})  # a value into Python
DATA_SHAPED = frozenset({"nonzero", "masked_select", "unique_consecutive", "_unique2", "unique_dim",
                         "repeat_interleave", "nonzero_static"})  # output shape depends on the values
HERE = os.path.abspath(__file__)
# torch.cuda.set_sync_debug_mode("warn"): each synchronising CUDA call warns with this text (c10/cuda); the mode's
# one-time notice ("Synchronization debug mode is a prototype feature ...") is not a host read
SYNC_WARNING = "called a synchronizing CUDA operation"


class HostReadAudit(TorchDispatchMode):
    """``with HostReadAudit() as audit: step()`` -> ``audit.sites``: Counter {(op, "path:line in function"): calls}.

    ``package``: the directory whose innermost frame names a site (default: hpctrain's own)."""

    def __init__(self, package: str | None = None):
        super().__init__()
        self.package = os.path.abspath(package or os.path.dirname(os.path.dirname(HERE)))
        self.sites: collections.Counter = collections.Counter()
        self._lifted: weakref.WeakSet = weakref.WeakSet()  # Python numbers torch made into host tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname
        if name == "copy_" and args[1] in self._lifted:
            self.sites[("copy_ of a Python number", self._site())] += 1
        elif _waits_for_device(func, args, kwargs):
            self.sites[(name, self._site())] += 1
        out = func(*args, **kwargs)
        if name == "lift_fresh":
            self._lifted.add(out)
        return out

    def _site(self) -> str:
        for frame in reversed(traceback.extract_stack()):
            path = os.path.abspath(frame.filename)
            if path != HERE and path.startswith(self.package + os.sep):
                return f"{os.path.relpath(path, os.path.dirname(self.package))}:{frame.lineno} in {frame.name}"
        return "outside the package"

    def lines(self) -> list[str]:
        """One line per site, most calls first."""
        return [f"{calls} x {op} at {site}" for (op, site), calls in self.sites.most_common()]


def sync_warnings(messages) -> list[str]:
    """The texts of ``messages`` (warnings or their messages) that torch's sync debug mode gave for a
    synchronising CUDA call: its host reads on a GPU."""
    return [str(getattr(m, "message", m)) for m in messages if SYNC_WARNING in str(getattr(m, "message", m))]


def _waits_for_device(func, args, kwargs) -> bool:
    """Would ``func(*args, **kwargs)`` make the host wait for the device it runs on (on a GPU)?"""
    name = func._opname
    if name in READS:
        return True
    if name in DATA_SHAPED:
        return not (name == "repeat_interleave" and kwargs.get("output_size") is not None)
    if name in ("index", "index_put", "index_put_") and len(args) > 1:  # t[mask], t[mask] = x
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())
    if name == "_to_copy":  # t.to("cpu"), t.cpu(), host.to("cuda")
        source, target, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
    elif name == "copy_":  # host_tensor.copy_(t), device_tensor.copy_(host)
        source, target = args[1], args[0].device
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    else:
        return False
    if non_blocking or not isinstance(source, torch.Tensor) or target is None:
        return False
    here, there = source.device.type, torch.device(target).type
    return (here != "cpu" and there == "cpu") or (here == "cpu" and there != "cpu" and not source.is_pinned())
