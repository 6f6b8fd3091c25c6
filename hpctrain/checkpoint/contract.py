"""The state contract between a training run and the checkpoint code: what a checkpoint saves and restores.

``TrainState`` is ALL that ``hpctrain/checkpoint`` and ``hpctrain/interop`` know of a run; the Trainer's
implementation is ``hpctrain/train/state.py`` (``trainer.state``), and tests/unit/test_state_contract.py
fails if code here names anything else of the trainer. Every member is this rank's and local: nothing
communicates. Tensors are views: copying into them changes the run.

What a checkpoint holds of a rank (docs/checkpoint-format.md):
  model slabs       ``tensors().params``: the local slab of every parameter this rank holds; a FROZEN one
                    (a LoRA run's base weights) has no optimizer state and is written whole by one rank
  optimizer pieces  ``tensors().pieces``: the parameter elements whose optimizer state this rank owns,
                    with ``state_kinds`` per element, inside the owned ``tensors().ranges``
  frozen pieces     ``tensors().frozen_pieces``: ZeRO-3's frozen base, the elements this rank keeps, inside
                    ``tensors().frozen_slices`` (no optimizer state)
  reducer state     ``reducer``: error-feedback residuals, PowerSGD's Q (docs/compression.md)
  root attributes   ``root_state()`` (step, optimizer step, sampler, loss scaler), ``rng_state()``, and
                    the run's ``config`` and ``layout``; restored through ``set_steps`` and the ``load_*``
                    / ``set_rng_state`` methods
  base reference    ``base_reference``: a LoRA run's frozen base, referred to instead of copied; a load
                    reads it through ``open_base``
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from hpctrain.config import Config, ModelConfig
    from hpctrain.parallel.slab import SlabSpec
    from hpctrain.profiling.timers import PhaseTimer


@dataclass(frozen=True, eq=False)
class ModelSlab:
    """One parameter this rank holds: ``data`` is its local slab, shape ``spec.local_shape``, of the global
    parameter ``spec.name`` (``spec``: its SlabSpec: ``global_shape``, ``local_slices()``, ``tied_copy``;
    a padded vocabulary's slab has zero padding rows past ``spec.valid_local()``, never saved or loaded).

    ``frozen``: not trained (a LoRA run's base weights): no optimizer state, so no OptimizerPiece writes it;
    ``written`` (frozen ones only): this rank writes its real slab (each global element by exactly one rank:
    dp x cp replica 0, the tp rank ``SlabSpec.counted_on`` names, never a tied copy).
    ``sliced``: ZeRO-3, ``data`` is not held between steps: the values are this rank's ``OptimizerPiece``s
    of it (written and loaded through them, in ``TrainTensors.ranges[...].params``; a frozen one's in
    ``TrainTensors.frozen_pieces``, in ``frozen_slices``)."""

    spec: SlabSpec
    data: torch.Tensor
    frozen: bool = False
    written: bool = False
    sliced: bool = False


@dataclass(frozen=True, eq=False)
class OwnedRange:
    """A flat range whose optimizer state this rank owns (a dp bucket, or its ZeRO-1 1/dp slice): ``params``
    the parameter values there (model dtype), ``state[kind]`` that optimizer state (state dtype); all 1-D,
    one length. A separate ``"master"`` copy must follow ``params`` when the parameters change."""

    params: torch.Tensor
    state: dict[str, torch.Tensor]


@dataclass(frozen=True)
class OptimizerPiece:
    """Elements [lo, hi) of the flattened local slab of parameter ``spec.name``; they lie at [at, at + hi - lo)
    of the tensors of ``TrainTensors.ranges[owner]``. ``written``: this rank writes them to a checkpoint
    (every global element is written by exactly one rank: its ZeRO-1 owner, or dp rank 0 without ZeRO;
    among tp ranks and tied copies the one ``SlabSpec.counted_on`` names)."""

    spec: SlabSpec
    lo: int
    hi: int
    owner: int
    at: int
    written: bool

    def take(self, tensor: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Slab elements [a, b) (lo <= a <= b <= hi) of this piece in ``tensor``: one of its range's
        tensors, or a copy of one."""
        return tensor[self.at + a - self.lo:self.at + b - self.lo]


@dataclass(frozen=True)
class TrainTensors:
    """This rank's tensors in a checkpoint (views into the run)."""

    params: list[ModelSlab]  # every parameter this rank holds, in model order (tied copy included)
    ranges: list[OwnedRange]  # the flat ranges whose optimizer state this rank owns
    pieces: list[OptimizerPiece]  # every parameter piece inside ``ranges``, in flat order
    state_kinds: tuple[str, ...]  # ("exp_avg", "exp_avg_sq"), + "master" when it is a separate copy
    model_dtype: torch.dtype  # of the parameters
    state_dtype: torch.dtype  # of the optimizer state
    # ZeRO-3 with a frozen base: the 1-D slices this rank keeps of it, and the pieces of the frozen parameters
    # in them (``OptimizerPiece.owner``: an index into ``frozen_slices``; ``written``: this rank writes them)
    frozen_slices: list[torch.Tensor] = field(default_factory=list)
    frozen_pieces: list[OptimizerPiece] = field(default_factory=list)


@dataclass(frozen=True)
class Resumed:
    """What a resume loaded (``CheckpointManager.resume``): ``tier`` "global" (a checkpoint directory, any
    layout) or "local" (the node-local tier's pieces), ``path`` its step directory, ``step``, and ``rebuilt``:
    the ranks whose local piece came from a partner's replica. ``str()`` is how the start-up line names it."""

    tier: str
    path: str
    step: int
    rebuilt: tuple[int, ...] = ()

    @property
    def is_global(self) -> bool:
        """A global checkpoint of this step exists (a local piece alone is none: the step must still be saved)."""
        return self.tier == "global"

    def __str__(self) -> str:
        if self.tier == "global":
            return self.path
        shown = ", ".join(map(str, self.rebuilt[:8])) + (f" and {len(self.rebuilt) - 8} more"
                                                          if len(self.rebuilt) > 8 else "")
        return f"the local tier ({self.path}" + (f"; rank(s) {shown} rebuilt from replicas" if self.rebuilt else "") + ")"


@dataclass(frozen=True)
class RootState:
    """The run's scalars a checkpoint saves as root attributes."""

    step: int  # training steps taken: the checkpoint's step
    optimizer_step: int  # optimizer updates taken (Adam's bias correction): skipped fp16 steps not counted
    sampler: dict  # the position in the data order (GlobalBatchIterator.state_dict)
    loss_scaler: dict  # the dynamic loss scale (DynamicLossScaler.state_dict)


class ReducerState(Protocol):
    """The dp gradient reducer's checkpointed state (``hpctrain.compression.GradReducer``)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Named tensors (error-feedback residuals, PowerSGD's Q); empty for a stateless reducer."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict()``; an empty dict starts the reducer fresh."""

    def signature(self) -> dict:
        """What must match for ``state_dict`` to be restored as is (JSON-able); empty: nothing to keep."""


class BaseWeights(Protocol):
    """The frozen base weights a checkpoint refers to (``hpctrain.interop.base_ref.ReferencedBase``)."""

    reference: dict  # the reference, with the path where the base is now

    def verify_share(self, rank: int, size: int) -> None:
        """Raise HpcTrainError if a tensor of share ``rank`` of ``size`` differs from the reference's checksums."""

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The global tensor of parameter ``name`` (or its ``index`` slab), in the base's own dtype."""

    def close(self) -> None:
        ...


@runtime_checkable
class TrainState(Protocol):
    """One rank's training state, as checkpoints (checkpoint/transfer.py) and ``model.init_from``
    (interop/sources.py) save and restore it."""

    rank: int  # world rank
    world_size: int
    config: Config  # the run's config: saved whole (``config``; ``train.dtype`` as ``model_dtype``)
    model_config: ModelConfig  # resolved: what weights-only checkpoints and init_from must match
    layout: dict  # saved as ``layout``: {axis: size for each grid axis, "ep", "zero": the stage, "world": world_size}
    timer: PhaseTimer  # the blocking part of a save is its "checkpoint" phase
    reducer: ReducerState
    base_reference: dict | None  # saved as ``lora_base`` in place of the frozen weights; None: they are copied

    def open_base(self, reference: dict, what: str) -> BaseWeights:
        """The base a checkpoint (``what``, for messages) refers to: at its recorded path, else at this run's
        model.init_from. Raises HpcTrainError (naming both) when it is in neither place."""

    def tensors(self) -> TrainTensors:
        """Model and optimizer pieces of this rank (fixed once the run is built)."""

    def root_state(self) -> RootState:
        """The scalars now."""

    def before_next_update(self, wait: Callable[[], None]) -> None:
        """Call ``wait()`` once, before the next step applies anything of its update (the optimizer step, and a
        reducer's commit into the optimizer state such as 1-bit Adam's momentum): until then the parameters and
        the optimizer state (``tensors()``) do not change, so a copy of them may run meanwhile."""

    def set_steps(self, step: int, optimizer_step: int) -> None:
        """Set the training step and the optimizer's update count (the two differ after skipped steps)."""

    def check_sampler(self, state: dict) -> None:
        """Raise (an HpcTrainError naming the mismatch) if ``RootState.sampler`` from a checkpoint cannot
        continue this run's data order (seed, seq_len); changes nothing. Called while reading, so a
        mismatch is found before any weight is copied."""

    def load_sampler(self, state: dict) -> None:
        """Restore ``RootState.sampler``: the data order goes on from there."""

    def load_loss_scaler(self, state: dict) -> None:
        """Restore ``RootState.loss_scaler``; ignored by a run without loss scaling."""

    def rng_state(self) -> torch.Tensor:
        """This rank's torch CPU generator state (uint8, 1-D)."""

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore ``rng_state()``."""
