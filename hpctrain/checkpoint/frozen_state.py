"""A run's state as ``snapshot`` reads it, frozen at one moment without copying the big tensors: what lets an
asynchronous save take its snapshot on its own thread while the next step's forward and backward run."""
from __future__ import annotations

import torch

from hpctrain.checkpoint.contract import TrainState


class _ReducerAsTaken:
    """A reducer's state and signature as they were when ``FrozenState`` was taken (read-only)."""

    def __init__(self, reducer):
        self._state = {key: value.detach().clone() for key, value in reducer.state_dict().items()}
        self._signature = reducer.signature()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def signature(self) -> dict:
        return self._signature

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise TypeError("a FrozenState is read-only")


class FrozenState:
    """What ``snapshot`` needs of a run, taken at once (``root_state``, ``rng_state`` and the reducer's state: they
    change in the next forward and backward), with the live ``tensors()`` (parameters and optimizer state: they
    change only at the next update). ``snapshot(FrozenState(state))`` on another thread therefore equals
    ``snapshot(state)`` now, as long as it ends before the next update (``TrainState.before_next_update``).
    Everything else is the live state's."""

    def __init__(self, state: TrainState):
        self._live = state
        self._root = state.root_state()
        self._rng = state.rng_state().clone()
        self.reducer = _ReducerAsTaken(state.reducer)
        self.base_reference = state.base_reference

    def root_state(self):
        return self._root

    def rng_state(self) -> torch.Tensor:
        return self._rng

    def __getattr__(self, name: str):
        return getattr(self._live, name)
