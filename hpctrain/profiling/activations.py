"""Activation memory as the engine holds it: the bytes autograd saves for backward, plus what a pipeline rank
keeps between its actions (received inputs, outputs to send, a zero-bubble schedule's deferred W), counted
by distinct storage with the model state left out. The planner's ``activation_bytes`` (plan/memory.py)
predicts the peak of this, which a CPU's resident set cannot show (it is mostly the Python and torch runtime).

    meter = ActivationMeter(state=lambda: [*model.parameters(), *flat.state_tensors()])
    with meter.saving():                    # torch.autograd.graph.saved_tensors_hooks
        ...forward and backward...
        meter.sample(extra_tensors)         # after each pipeline action: live bytes, the peak so far

Local to the process: no communication. The hooks keep a weak reference to every saved tensor (autograd's own
reference keeps it alive exactly as long as the graph needs it), so metering changes no lifetime; it costs a
Python call per saved tensor and a pass over the live ones per sample.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage under ``tensor`` (a view counts its whole base)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class ActivationMeter:
    """Live and peak activation bytes of one process. ``state``: returns the model-state tensors (parameters,
    flat buffers), whose storages are never counted; asked again at every sample (ZeRO-3 gathers and frees
    parameters). ``total_saved``: the distinct storages saved for backward since the meter was made (a
    one-micro-batch step's activation memory, without sampling)."""

    def __init__(self, state: Callable[[], Iterable[torch.Tensor]] = tuple):
        self.state = state
        self.excluded = self._state_storages()
        self._live: list[weakref.ref] = []
        self._ever: set[int] = set()
        self.total_saved = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The saved-tensor pack hook: remember ``tensor`` weakly, hand it back unchanged."""
        ptr, nbytes = storage_key(tensor)
        if ptr not in self.excluded:
            self._live.append(weakref.ref(tensor))
            if ptr not in self._ever:
                self._ever.add(ptr)
                self.total_saved += nbytes
        return tensor

    @contextmanager
    def saving(self) -> Iterator["ActivationMeter"]:
        """Meter every tensor autograd saves inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            yield self

    def _state_storages(self) -> set[int]:
        return {storage_key(t)[0] for t in self.state()}

    def live_bytes(self, extra: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the distinct storages of the saved tensors still alive and of ``extra`` (None skipped)."""
        self.excluded = self._state_storages()
        alive = [t for ref in self._live if (t := ref()) is not None]
        self._live = [weakref.ref(t) for t in alive]
        seen: dict[int, int] = {}
        for t in (*alive, *(t for t in extra if t is not None)):
            ptr, nbytes = storage_key(t)
            if ptr not in self.excluded:
                seen[ptr] = nbytes
        return sum(seen.values())

    def sample(self, extra: Iterable[torch.Tensor] = ()) -> int:
        """``live_bytes(extra)`` now, folded into ``peak``; returns it."""
        now = self.live_bytes(extra)
        self.peak = max(self.peak, now)
        return now


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def tensors_in(*containers) -> Iterator[torch.Tensor]:
    """Every tensor in ``containers``: dicts' values, lists and tuples, nested."""
    for item in containers:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            yield from tensors_in(*item.values())
        elif isinstance(item, (list, tuple)):
            yield from tensors_in(*item)
