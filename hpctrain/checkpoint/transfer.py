"""Between a run's ``TrainState`` (checkpoint/contract.py) and the global checkpoint view: what this rank
writes, and how it loads any layout.

Writing: a rank writes the boxes of the flat ranges its optimizer owns (its ZeRO slice, or everything
on dp rank 0 without ZeRO), skipping TP-replicated weights on tp ranks > 0 and the tied-embedding
copy, so every global element is written exactly once. Loading: a rank reads its whole local slab of
every parameter (at ZeRO-3 only the pieces it keeps) and the optimizer state of the ranges it owns NOW — in whatever layout it runs, the
padding rows of a padded vocabulary left out both ways (they are zero) —
all into host memory first (checking CRCs on the bytes it reads), then into the run, so a bad
checkpoint changes nothing. The run is seen only through the contract.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import hpctrain
from hpctrain.checkpoint.format import (BASE_REFERENCE_ATTR, FORMAT_NAME, FORMAT_VERSION, Box, disk_dtype,
                                        local_range_boxes, model_dataset, optim_dataset)
from hpctrain.checkpoint.architecture import (ARCHITECTURE_ATTR, is_weights_only, lora_differences,  # noqa: F401
                                              model_differences)
from hpctrain.checkpoint.architecture import record as record_architecture
from hpctrain.checkpoint.compression_state import check_onebit_adam, read_compression, snapshot_compression
from hpctrain.checkpoint.contract import TrainState
from hpctrain.checkpoint.frozen_state import FrozenState
from hpctrain.checkpoint.items import CheckpointError, Snapshot, WriteItem, to_host
from hpctrain.config import config_to_dict
from hpctrain.errors import HpcTrainError
from hpctrain.parallel.lora import is_adapter


def snapshot(state: TrainState | FrozenState) -> Snapshot:
    """Copy this rank's part of the training state to host memory (the only stall of an async save)."""
    tensors, root = state.tensors(), state.root_state()
    kinds = tensors.state_kinds
    model_dtype, state_dtype = disk_dtype(tensors.model_dtype), disk_dtype(tensors.state_dtype)
    snap = Snapshot(root.step, {})
    for p in tensors.params:
        if p.spec.tied_copy or (p.frozen and state.base_reference is not None):  # referred to, not copied
            continue
        snap.datasets[model_dataset(p.spec.name)] = (p.spec.global_shape, model_dtype.str)
        for kind in () if p.frozen else kinds:
            snap.datasets[optim_dataset(kind, p.spec.name)] = (p.spec.global_shape, state_dtype.str)
    if state.base_reference is None:
        _snapshot_frozen(tensors, snap, model_dtype)
    n = len(kinds) + 1  # per owned range: its parameters, then each state kind
    host = to_host([t for r in tensors.ranges for t in [r.params] + [r.state[k] for k in kinds]])
    for piece in tensors.pieces:
        if not piece.written:
            continue
        params, states = host[piece.owner * n], host[piece.owner * n + 1:(piece.owner + 1) * n]
        name = piece.spec.name
        for box, a, b in local_range_boxes(piece.spec, piece.lo, piece.hi):
            snap.items.append(WriteItem(model_dataset(name), box, _host(piece.take(params, a, b), model_dtype, box)))
            for kind, values in zip(kinds, states):
                snap.items.append(WriteItem(optim_dataset(kind, name), box,
                                            _host(piece.take(values, a, b), state_dtype, box)))
    rng = state.rng_state().numpy()
    snap.datasets["rng/torch_cpu"] = ((state.world_size, rng.size), "|u1")
    snap.items.append(WriteItem("rng/torch_cpu", Box((state.rank, 0), (1, rng.size)), rng.reshape(1, -1).copy()))
    snapshot_compression(state, snap)
    cfg = state.config
    snap.attrs = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "hpctrain_version": hpctrain.__version__,
        "step": root.step, "config": config_to_dict(cfg), "layout": dict(state.layout),
        "sampler": root.sampler, "loss_scaler": root.loss_scaler,
        "optimizer_step": root.optimizer_step, "model_dtype": cfg.train.dtype,
        ARCHITECTURE_ATTR: record_architecture(state.model_config, state.config.moe),
    }
    if state.base_reference is not None:
        snap.attrs[BASE_REFERENCE_ATTR] = state.base_reference
    return snap


def _snapshot_frozen(tensors, snap: Snapshot, model_dtype) -> None:
    """The frozen parameters (a LoRA run's base weights) this rank writes, copied whole into the checkpoint
    (``lora.checkpoint_base = "copy"``, or a run without a base to refer to: a checkpoint that stands alone)."""
    frozen = [p for p in tensors.params if p.frozen and p.written and not p.sliced and p.spec.valid_numel]
    host = to_host([p.data[p.spec.valid_local()] for p in frozen])
    for p, values in zip(frozen, host):
        box = Box(tuple(s.start or 0 for s in p.spec.local_slices()), p.spec.valid_shape)
        snap.items.append(WriteItem(model_dataset(p.spec.name), box, _host(values, model_dtype, box)))
    if tensors.frozen_pieces:  # ZeRO-3: the frozen base's elements this rank keeps
        slices = to_host(tensors.frozen_slices)
        for piece in tensors.frozen_pieces:
            if piece.written:
                for box, a, b in local_range_boxes(piece.spec, piece.lo, piece.hi):
                    snap.items.append(WriteItem(model_dataset(piece.spec.name), box,
                                                _host(piece.take(slices[piece.owner], a, b), model_dtype, box)))


def frozen_piece_copies(tensors, read) -> list:
    """(target, values) for every box of the frozen pieces this rank keeps (ZeRO-3's frozen base);
    ``read(name, box)``: the values of parameter ``name`` inside the global ``box``, or None to skip it."""
    copies = []
    for piece in tensors.frozen_pieces:
        for box, a, b in local_range_boxes(piece.spec, piece.lo, piece.hi):
            values = read(piece.spec.name, box)
            if values is not None:
                copies.append((piece.take(tensors.frozen_slices[piece.owner], a, b), values.reshape(-1)))
    return copies


BASE_UNUSABLE = "its LoRA base weights cannot be used"  # in every message of a referred base: no fallback


def _read_base(state: TrainState, reader, staged: StagedState) -> dict:
    """Stage this rank's slabs of the frozen base the checkpoint refers to, after checking this rank's share
    of its checksums (the ranks split the tensors, so the base is read whole once in all); returns the
    reference with the base's path now. CheckpointError (``BASE_UNUSABLE``) when it is gone or differs."""
    try:
        base = state.open_base(reader.attrs[BASE_REFERENCE_ATTR], f"checkpoint {reader.dir}")
        try:
            base.verify_share(state.rank, state.world_size)
            tensors = state.tensors()
            for p in tensors.params:
                if p.frozen and p.spec.valid_numel and not p.sliced:
                    staged.copies.append((p.data[p.spec.valid_local()], base.read(p.spec.name, p.spec.local_slices())))
            staged.copies += frozen_piece_copies(tensors, lambda name, box: base.read(name, box.slices()))
            return base.reference
        finally:
            base.close()
    except (HpcTrainError, OSError) as exc:
        raise CheckpointError(f"{BASE_UNUSABLE}: {exc}") from None


def _host(values: torch.Tensor, dtype, box: Box) -> np.ndarray:
    return values.detach().to(torch.float64 if dtype == np.float64 else torch.float32).numpy() \
        .astype(dtype, copy=True).reshape(box.shape)


ANOTHER_MODEL = "written for another model"  # in every incompatibility message: resume tells it from damage


def check_compatible(state: TrainState, reader) -> None:
    """Raise CheckpointError if the checkpoint was written for another model: any of its architecture keys
    (``checkpoint/architecture.py``: sizes, heads, vocab_size, rope_theta, norm_eps, window, mlp, positions,
    tied embeddings) differs from this run's, each named; any but a weights-only one without adapters: if
    lora.rank, lora.targets or lora.alpha differ; or if this rank's parameters are missing or shaped
    differently in it."""
    differences = model_differences(reader.attrs, state.config)
    if differences:
        kind = "weights-only checkpoint" if is_weights_only(reader.attrs) else "checkpoint"
        hint = ("; a checkpoint resumes with its own adapters (model.init_from takes its base weights into a "
                "run with another lora.rank/targets; `hpctrain export --merge-lora` its merged weights)") \
            if any(d.startswith("lora.") for d in differences) else ""
        raise CheckpointError(f"{reader.path}: {kind} {ANOTHER_MODEL} than this config: {'; '.join(differences)}{hint}")
    for p in state.tensors().params:
        name = model_dataset(p.spec.name)
        shape = reader.shape(name)
        if shape is None and is_weights_only(reader.attrs) and is_adapter(p.spec.name):
            continue  # base weights into a LoRA run: the adapters keep their initial values
        if shape is None and p.frozen and reader.attrs.get(BASE_REFERENCE_ATTR):
            continue  # the base it refers to (read_state checks it)
        if shape is None:
            raise CheckpointError(f"{reader.path}: {ANOTHER_MODEL}: it has no dataset {name} (check model.* "
                                  f"settings against its config)")
        if tuple(shape) != tuple(p.spec.global_shape):
            raise CheckpointError(f"{reader.path}: checkpoint of another model shape ({ANOTHER_MODEL}): {name} is {tuple(shape)} "
                                  f"in the checkpoint but {tuple(p.spec.global_shape)} in this model")


@dataclass
class StagedState:
    """What a load read, on the host, before anything in the run changes: (target tensor, source)
    copies in order (source: a numpy array, or a view of the parameters for master weights written by a
    float32 run, taken after the parameters are copied), plus the root attributes."""

    copies: list = field(default_factory=list)
    attrs: dict = field(default_factory=dict)
    rng_row: np.ndarray | None = None
    base_reference: dict | None = None  # the LoRA base the checkpoint refers to (its path where it is now)
    compression: dict = field(default_factory=dict)  # the reducer's state_dict, when restorable
    compression_note: str | None = None  # why the reducer's state was not restored


def read_state(state: TrainState, reader) -> StagedState:
    """Read (through ``reader.read_checked``: each byte once, CRCs checked on the way) everything this
    rank needs from a checkpoint of any layout: its whole local slab of every parameter and the
    optimizer state of the ranges it owns NOW. Changes nothing in the run."""
    check_compatible(state, reader)
    weights_only = is_weights_only(reader.attrs)
    if not weights_only:  # a data order, or 1-bit Adam state, this run cannot continue: found before any byte is read
        state.check_sampler(reader.attrs["sampler"])
        check_onebit_adam(state, reader)
    tensors = state.tensors()
    staged = StagedState(attrs=reader.attrs)
    if reader.attrs.get(BASE_REFERENCE_ATTR):
        staged.base_reference = _read_base(state, reader, staged)
    for p in tensors.params:  # the real part of each slab (padding rows stay zero)
        if (staged.base_reference is not None and p.frozen) or p.sliced:  # sharded: through the pieces below
            continue
        if p.spec.valid_numel and not (weights_only and reader.shape(model_dataset(p.spec.name)) is None):
            slab = Box(tuple(s.start or 0 for s in p.spec.local_slices()), p.spec.valid_shape)
            staged.copies.append((p.data[p.spec.valid_local()], reader.read_checked(model_dataset(p.spec.name), slab)))
    if staged.base_reference is None:  # ZeRO-3's frozen base (else _read_base staged it)
        staged.copies += frozen_piece_copies(tensors, lambda name, box: None if weights_only and reader.shape(
            model_dataset(name)) is None else reader.read_checked(model_dataset(name), box))
    sharded = {p.spec.name for p in tensors.params if p.sliced}
    for piece in tensors.pieces:
        owned = tensors.ranges[piece.owner]
        for box, a, b in local_range_boxes(piece.spec, piece.lo, piece.hi):
            if piece.spec.name in sharded and not (weights_only and reader.shape(model_dataset(piece.spec.name)) is None):
                staged.copies.append((piece.take(owned.params, a, b),
                                      reader.read_checked(model_dataset(piece.spec.name), box).reshape(-1)))
            for kind in tensors.state_kinds:
                name, target = optim_dataset(kind, piece.spec.name), piece.take(owned.state[kind], a, b)
                if kind == "master" and reader.shape(name) is None:  # written by a float32 run, or weights only
                    staged.copies.append((target, piece.take(owned.params, a, b)))
                elif weights_only:  # fresh moments
                    staged.copies.append((target, torch.zeros_like(target)))
                else:
                    staged.copies.append((target, reader.read_checked(name, box).reshape(-1)))
    rng_shape = reader.shape("rng/torch_cpu")
    if rng_shape is not None and rng_shape[0] == state.world_size:
        row = reader.read_checked("rng/torch_cpu", Box((state.rank, 0), (1, rng_shape[1])))
        staged.rng_row = row.reshape(-1).copy()
    if not weights_only:  # else the reducer starts fresh, as in a new run
        read_compression(state, reader, staged)
    reader.drop_cache()
    return staged


@torch.no_grad()
def apply_state(state: TrainState, staged: StagedState) -> None:
    """Copy a staged checkpoint into the run; restores step, sampler, scaler, optimizer, RNG, reducer."""
    for target, source in staged.copies:
        target.copy_(torch.from_numpy(source) if isinstance(source, np.ndarray) else source)
    attrs = staged.attrs
    state.set_steps(int(attrs["step"]), int(attrs["optimizer_step"]))
    if staged.base_reference is not None and state.config.lora.checkpoint_base == "reference":
        state.base_reference = staged.base_reference  # the next checkpoints refer to the same base
    if is_weights_only(attrs):  # the run's own data order, loss scale and RNG, from the start
        return
    state.load_sampler(attrs["sampler"])
    if attrs.get("loss_scaler"):
        state.load_loss_scaler(attrs["loss_scaler"])
    if staged.rng_row is not None:
        state.set_rng_state(torch.from_numpy(staged.rng_row))
    state.reducer.load_state_dict(staged.compression)
