"""Stand-ins for CUDA on a CPU-only torch, so that the CUDA-only code paths run in the CPU tests.

- ``FakeCuda().install(monkeypatch)``: ``torch.cuda``'s Event, Stream, current_stream, current_device,
  device (a context, per thread), is_available, device properties and peak-memory reset, with every stream
  operation, event record and query appended to ``log`` in order. An event is complete when the device
  work queued on its stream before ``record`` is (``Work.done``, set by a fake NCCL kernel) and it is not
  ``held`` by the test.
- ``as_cuda(t)``: a real CPU tensor that says it lives on ``cuda:0``; its ``data_ptr`` is real host memory,
  so a fake NCCL kernel (tests/fake_nccl.py) can run on it.
- ``fake_cuda_tensors()``: torch's ``FakeTensorMode`` with the few Python bindings that would ask for a CUDA
  device guard (indexing, ``copy_``, ``to``, ``~``) routed to their aten ops: ``torch.zeros(..., device="cuda")``
  makes a fake CUDA tensor, and an op mixing a CUDA tensor with a (non-scalar) host tensor raises
  ``FakeTensorDeviceMismatchError``, as on a GPU. ``_fused_adamw_`` is checked the same way (its fake kernel
  is not). ``Pinning.copies`` records every copy between host and device: (direction, non_blocking, pinned).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode


class Work:
    """Device work queued on a stream (a fake kernel); ``done`` once it has run."""

    def __init__(self, what: str):
        self.what, self.done = what, False


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str):
        self.cuda, self.name, self.cuda_stream = cuda, name, next(cuda.handles)  # cuda_stream: the raw handle
        self.queued: list[Work] = []
        cuda.streams[self.cuda_stream] = self

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.id))

    def synchronize(self) -> None:
        self.cuda.log.append(("synchronize", self.name))


class FakeEvent:
    def __init__(self, cuda: FakeCuda, enable_timing: bool = False, **_):
        self.cuda, self.id, self.enable_timing = cuda, next(cuda.event_ids), enable_timing
        self.after: list[Work] = []  # the work queued on the recorded stream before ``record``
        self.held = cuda.hold_events  # the test keeps the event incomplete
        self.synchronized = 0
        cuda.events.append(self)

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.compute
        self.after = list(stream.queued)
        self.cuda.log.append(("record", self.id, stream.name))

    def query(self) -> bool:
        self.cuda.log.append(("query", self.id, threading.current_thread().name, self.cuda.current_device()))
        return not self.held and all(work.done for work in self.after)

    def synchronize(self) -> None:
        assert not self.held, "synchronize on an event that never completes: a hang on a GPU"
        self.synchronized += 1
        self.cuda.log.append(("event_synchronize", self.id))

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.enable_timing and end.enable_timing, "elapsed_time needs events made with enable_timing=True"
        return self.cuda.elapsed_ms.pop(0)


class FakeCuda:
    """One process's fake CUDA runtime: ``index`` is the device ``set_device`` bound (the main thread's)."""

    def __init__(self, index: int = 0, name: str = "NVIDIA H100 80GB HBM3", uuid: str = "GPU-0", count: int = 4):
        self.index, self.name, self.uuid, self.count = index, name, uuid, count
        self.handles, self.event_ids = itertools.count(1000), itertools.count()
        self.log: list[tuple] = []
        self.streams: dict[int, FakeStream] = {}
        self.elapsed_ms: list[float] = []  # what the next elapsed_time calls return
        self.events: list[FakeEvent] = []  # every event made
        self.hold_events = False  # events made while True stay incomplete until the test sets ``held = False``
        self.local = threading.local()  # a ``torch.cuda.device`` context of this thread
        self.compute = FakeStream(self, "compute")

    def current_device(self) -> int:
        inside = getattr(self.local, "device", None)
        if inside is not None:
            return inside
        return self.index if threading.current_thread() is threading.main_thread() else 0  # a new thread: GPU 0

    @contextlib.contextmanager
    def device(self, index):
        before = getattr(self.local, "device", None)
        self.local.device = int(index)
        try:
            yield
        finally:
            self.local.device = before

    def install(self, monkeypatch, available: bool = True) -> FakeCuda:
        """Patch ``torch.cuda``; ``available=False`` leaves ``is_available`` (False): under ``fake_cuda_tensors``
        a torch that believes in CUDA would try to allocate some tensors (``torch.tensor``) for real."""
        props = SimpleNamespace(name=self.name, uuid=self.uuid, total_memory=80 << 30)
        for name, value in {"is_available": lambda: available, "current_device": self.current_device,
                            "device": self.device, "Event": lambda **kw: FakeEvent(self, **kw),
                            "Stream": lambda *a, **kw: FakeStream(self, f"side{len(self.streams)}"),
                            "current_stream": lambda device=None: self.compute,
                            "get_device_properties": lambda device=None: props,
                            "get_device_name": lambda device=None: self.name,
                            "reset_peak_memory_stats": lambda device=None: self.log.append(("reset_peak", device)),
                            "set_device": lambda index: setattr(self, "index", int(index)),
                            "device_count": lambda: self.count}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        return self


class _CudaLooking(torch.Tensor):
    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):  # type: ignore[override]
        return True


def as_cuda(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (CPU, contiguous), reporting ``cuda:0`` as its device; same storage, same ``data_ptr``."""
    return tensor.as_subclass(_CudaLooking)


# ---------------------------------------------------------------------------- fake CUDA tensors
def _view(x, index):
    """``x[index]`` through aten's view ops, or None where ``index`` holds a tensor (not needed here)."""
    index = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in index):
        return None
    if Ellipsis in index:
        at, rest = index.index(Ellipsis), sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:at] + (slice(None),) * (x.dim() - rest) + index[at + 1:]
    out, dim = x, 0
    for i in index:
        if i is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif isinstance(i, int):
            out = out.select(dim, i)
        else:
            start, stop, step = i.indices(out.shape[dim])
            out, dim = torch.ops.aten.slice.Tensor(out, dim, start, max(stop, start), step), dim + 1
    return out


class Pinning:
    """Pinned host tensors made under ``fake_cuda_tensors`` and the host <-> device copies made there."""

    def __init__(self):
        self._pinned: dict[int, weakref.ref] = {}  # id -> the tensor (tensors compare by value: no WeakSet)
        self.copies: list[tuple[str, bool, bool]] = []  # ("to_device" | "to_host", non_blocking, host side pinned)

    def pin(self, tensor) -> None:
        self._pinned[id(tensor)] = weakref.ref(tensor)

    def is_pinned(self, tensor) -> bool:
        ref = self._pinned.get(id(tensor))
        return ref is not None and ref() is tensor

    def copied(self, src, dst_device, non_blocking) -> None:
        if src.device.type != torch.device(dst_device).type:
            way = "to_host" if torch.device(dst_device).type == "cpu" else "to_device"
            self.copies.append((way, bool(non_blocking), self.is_pinned(src) if way == "to_device" else None))


class _NoDeviceGuard(TorchFunctionMode):
    """Routes the Python bindings that take a CUDA device guard (absent from a CPU-only torch) to aten."""

    def __init__(self, pinning: Pinning):
        super().__init__()
        self.pinning = pinning

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and (out := _view(args[0], args[1])) is not None:
            return out
        if func is torch.Tensor.__setitem__ and (out := _view(args[0], args[1])) is not None:
            value = args[2]
            if not isinstance(value, torch.Tensor):
                return out.fill_(value)
            self.pinning.copied(value, out.device, False)
            return torch.ops.aten.copy_.default(out, value)
        if func is torch.Tensor.__invert__:
            return torch.bitwise_not(args[0])
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if src.device.type != "cpu" and dst.device.type == "cpu":  # to the host: is the target pinned?
                self.pinning.copies.append(("to_host", bool(non_blocking), self.pinning.is_pinned(dst)))
            else:
                self.pinning.copied(src, dst.device, non_blocking)
            return torch.ops.aten.copy_.default(dst, src, non_blocking)
        if func is torch.Tensor.to:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            x = args[0]
            if (device is None or device == x.device) and (dtype is None or dtype == x.dtype):
                return x
            self.pinning.copied(x, device or x.device, non_blocking)
            return torch.ops.aten._to_copy.default(x, dtype=dtype or x.dtype, device=device or x.device,
                                                   non_blocking=non_blocking)
        if func is torch.Tensor.pin_memory:  # aten's pin_memory has no fake kernel: the same tensor, marked
            self.pinning.pin(args[0])
            return args[0]
        if func is torch._fused_adamw_:  # the CUDA kernel takes one device; its fake kernel does not check
            devices = {t.device for a in list(args) + list(kwargs.values())
                       for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)}
            if len(devices) > 1:
                raise RuntimeError(f"_fused_adamw_: tensors on {sorted(map(str, devices))}: expected one device")
        out = func(*args, **kwargs)
        if kwargs.get("pin_memory") and isinstance(out, torch.Tensor):
            self.pinning.pin(out)
        return out


@contextlib.contextmanager
def fake_cuda_tensors():
    """``with fake_cuda_tensors() as pinning:`` tensors made there with device="cuda" are fake CUDA tensors."""
    pinning = Pinning()
    with FakeTensorMode(), _NoDeviceGuard(pinning):
        yield pinning
