"""Between a Trainer and the global checkpoint view: what this rank writes, and how it loads any layout.

Writing: a rank writes the boxes of the flat ranges its optimizer owns (its ZeRO shard, or everything
on dp rank 0 without ZeRO), skipping TP-replicated weights on tp ranks > 0 and the tied-embedding
copy, so every global element is written exactly once. Loading: a rank reads its whole local slab of
every parameter and the optimizer state of the ranges it owns NOW — in whatever layout it runs —
all into host memory first (checking CRCs on the bytes it reads), then into the trainer, so a bad
checkpoint changes nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np
import torch

import hpctrain
from hpctrain.checkpoint.format import (FORMAT_NAME, FORMAT_VERSION, Box, decode_json, disk_dtype, encode_json,
                                        local_range_boxes, model_dataset, optim_dataset)
from hpctrain.config import config_to_dict
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


def _written_pieces(trainer):
    """(ParamPiece, OptimizerShard) this rank writes: each global element exactly once (the ZeRO owner,
    or dp rank 0 without ZeRO; ``ShardSpec.counted_on`` among tp ranks and tied copies)."""
    flat, grid = trainer.flat, trainer.grid
    if not flat.zero and grid.coords["dp"] != 0:
        return
    for piece, shard in trainer.optimizer.owned_pieces():
        if piece.param.spec.counted_on(grid.coords["tp"]):
            yield piece, shard


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors``: device tensors go into pinned buffers with non-blocking copies and ONE
    synchronisation (the stall of a save from GPUs is this device-to-host copy); host tensors pass as is
    (the snapshot copies their pieces below)."""
    if not any(t.is_cuda for t in tensors):
        return tensors
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream())
    done.synchronize()
    return hosts


def snapshot(trainer) -> Snapshot:
    """Copy this rank's part of the training state to host memory (the only stall of an async save)."""
    flat, grid = trainer.flat, trainer.grid
    kinds = trainer.optimizer.state_kinds
    model_dtype = disk_dtype(flat.param_buffer.dtype)
    state_dtype = disk_dtype(trainer.optimizer.master_dtype)
    snap = Snapshot(trainer.step, {})
    for p in flat.params:
        if p.spec.tied_copy:
            continue
        snap.datasets[model_dataset(p.spec.name)] = (p.spec.global_shape, model_dtype.str)
        for kind in kinds:
            snap.datasets[optim_dataset(kind, p.spec.name)] = (p.spec.global_shape, state_dtype.str)
    shards = trainer.optimizer.shards
    host = to_host([flat.param_buffer] + [getattr(sh, k) for sh in shards for k in kinds])
    param_buffer, n = host[0], len(kinds)
    host_shards = {id(sh): replace(sh, **dict(zip(kinds, host[1 + i * n:1 + (i + 1) * n])))
                   for i, sh in enumerate(shards)}
    for piece, shard in _written_pieces(trainer):
        spec, offset = piece.param.spec, piece.flat_lo - piece.param_lo
        for box, a, b in local_range_boxes(spec, piece.param_lo, piece.param_hi):
            values = param_buffer[offset + a:offset + b]
            snap.items.append(WriteItem(model_dataset(spec.name), box, _host(values, model_dtype, box)))
            for kind in kinds:
                values = host_shards[id(shard)].state(kind, offset + a, offset + b)
                snap.items.append(WriteItem(optim_dataset(kind, spec.name), box, _host(values, state_dtype, box)))
    rng = torch.get_rng_state().numpy()
    snap.datasets["rng/torch_cpu"] = ((grid.info.size, rng.size), "|u1")
    snap.items.append(WriteItem("rng/torch_cpu", Box((grid.info.rank, 0), (1, rng.size)), rng.reshape(1, -1).copy()))
    _snapshot_compression(trainer, snap)
    snap.attrs = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "hpctrain_version": hpctrain.__version__,
        "step": trainer.step, "config": config_to_dict(trainer.cfg),
        "layout": {**grid.sizes, "zero": trainer.cfg.parallel.zero, "world": grid.info.size},
        "sampler": trainer.batches.state_dict(), "loss_scaler": trainer.scaler.state_dict(),
        "optimizer_step": trainer.optimizer.step_count, "model_dtype": trainer.cfg.train.dtype,
    }
    return snap


def compression_group(rank: int) -> str:
    return f"compression/rank{rank:05d}"


def _snapshot_compression(trainer, snap: Snapshot) -> None:
    """The reducer's state (error-feedback residuals, PowerSGD Q) as this world rank's own 1-D datasets
    ``compression/rankRRRRR/<key>``, with the reducer's signature beside them (JSON bytes)."""
    reducer, rank = trainer.flat.reducer, trainer.grid.info.rank
    state = reducer.state_dict()
    if not state and not reducer.signature():
        return
    group = compression_group(rank)
    host = to_host(list(state.values()))
    for key, value in zip(state, host):
        array = value.detach().to("cpu").numpy().reshape(-1).copy()
        snap.datasets[f"{group}/{key}"] = ((array.size,), array.dtype.str)
        snap.items.append(WriteItem(f"{group}/{key}", Box((0,), (array.size,)), array))
    signature = encode_json(reducer.signature())
    snap.datasets[f"{group}/signature"] = ((signature.size,), "|u1")
    snap.items.append(WriteItem(f"{group}/signature", Box((0,), (signature.size,)), signature))


def _read_compression(trainer, reader, staged) -> None:
    """Stage this rank's reducer state if the checkpoint holds state of the SAME reducer signature (same
    method, layout, buckets, node split); otherwise the reducer starts fresh and ``staged.compression_note``
    says why (the documented rule: docs/compression.md)."""
    reducer, rank = trainer.flat.reducer, trainer.grid.info.rank
    mine = reducer.signature()
    group = compression_group(rank)
    shape = reader.shape(f"{group}/signature")
    if not mine:
        return
    if shape is None:
        staged.compression_note = "the checkpoint has no compression state for this rank"
        return
    theirs = decode_json(reader.read_checked(f"{group}/signature", Box((0,), shape)))
    if theirs != json.loads(json.dumps(mine)) or reader.attrs["layout"].get("world") != trainer.grid.info.size:
        staged.compression_note = "it was written by another compression method, layout or bucket split"
        return
    state = {}
    for name in reader.datasets(prefix=group + "/"):
        key = name[len(group) + 1:]
        if key != "signature":
            state[key] = torch.from_numpy(reader.read_checked(name, Box((0,), reader.shape(name))).copy())
    staged.compression = state


def _host(values: torch.Tensor, dtype, box: Box) -> np.ndarray:
    return values.detach().to(torch.float64 if dtype == np.float64 else torch.float32).numpy() \
        .astype(dtype, copy=True).reshape(box.shape)


ANOTHER_MODEL = "written for another model"  # in every incompatibility message: resume tells it from damage


def check_compatible(trainer, reader) -> None:
    """Raise CheckpointError if this rank's parameters are missing or shaped differently in the checkpoint
    (a weights-only checkpoint: also if any architecture key of its model config differs)."""
    if is_weights_only(reader.attrs):
        from hpctrain.config import architecture_differences, config_from_dict

        differences = architecture_differences(config_from_dict(reader.attrs["config"]).model, trainer.model_cfg)
        if differences:
            raise CheckpointError(f"{reader.path}: weights-only checkpoint {ANOTHER_MODEL} than this config: "
                                  f"{'; '.join(differences)}")
    for p in trainer.flat.params:
        name = model_dataset(p.spec.name)
        shape = reader.shape(name)
        if shape is None:
            raise CheckpointError(f"{reader.path}: {ANOTHER_MODEL}: it has no dataset {name} (check model.* "
                                  f"settings against its config)")
        if tuple(shape) != tuple(p.spec.global_shape):
            raise CheckpointError(f"{reader.path}: checkpoint of another model shape ({ANOTHER_MODEL}): {name} is {tuple(shape)} "
                                  f"in the checkpoint but {tuple(p.spec.global_shape)} in this model")


@dataclass
class StagedState:
    """What a load read, on the host, before anything in the trainer changes: (target tensor, source)
    copies in order (source: a numpy array, or a view of the parameter buffer for master weights
    written by a float32 run, taken after the parameters are copied), plus the root attributes."""

    copies: list = field(default_factory=list)
    attrs: dict = field(default_factory=dict)
    rng_row: np.ndarray | None = None
    compression: dict = field(default_factory=dict)  # the reducer's state_dict, when restorable
    compression_note: str | None = None  # why the reducer's state was not restored


def is_weights_only(attrs: dict) -> bool:
    """A weights-only checkpoint (root attribute ``weights_only``, e.g. from ``hpctrain import-hf``) holds
    ``/model`` alone: it loads as a fresh start from those weights (zero optimizer moments, the run's own
    sampler, loss scaler and RNG), in any layout, and its model config must match the run's exactly."""
    return bool(attrs.get("weights_only", False))


def read_state(trainer, reader) -> StagedState:
    """Read (through ``reader.read_checked``: each byte once, CRCs checked on the way) everything this
    rank needs from a checkpoint of any layout: its whole local slab of every parameter and the
    optimizer state of the ranges it owns NOW. Changes nothing in the trainer."""
    check_compatible(trainer, reader)
    weights_only = is_weights_only(reader.attrs)
    flat, opt = trainer.flat, trainer.optimizer
    staged = StagedState(attrs=reader.attrs)
    for p in flat.params:
        slab = Box(tuple(s.start or 0 for s in p.spec.local_slices()), p.spec.local_shape)
        staged.copies.append((p.data, reader.read_checked(model_dataset(p.spec.name), slab)))
    for piece, shard in opt.owned_pieces():
        spec, offset = piece.param.spec, piece.flat_lo - piece.param_lo
        for box, a, b in local_range_boxes(spec, piece.param_lo, piece.param_hi):
            for kind in opt.state_kinds:
                name, target = optim_dataset(kind, spec.name), shard.state(kind, offset + a, offset + b)
                if kind == "master" and reader.shape(name) is None:  # written by a float32 run, or weights only
                    staged.copies.append((target, flat.param_buffer[offset + a:offset + b]))
                elif weights_only:  # fresh moments
                    staged.copies.append((target, torch.zeros_like(target)))
                else:
                    staged.copies.append((target, reader.read_checked(name, box).reshape(-1)))
    rng_shape = reader.shape("rng/torch_cpu")
    if rng_shape is not None and rng_shape[0] == trainer.grid.info.size:
        row = reader.read_checked("rng/torch_cpu", Box((trainer.grid.info.rank, 0), (1, rng_shape[1])))
        staged.rng_row = row.reshape(-1).copy()
    if not weights_only:  # else the reducer starts fresh, as in a new run
        _read_compression(trainer, reader, staged)
    reader.drop_cache()
    return staged


@torch.no_grad()
def apply_state(trainer, staged: StagedState) -> None:
    """Copy a staged checkpoint into the trainer; restores step, sampler, scaler, optimizer, RNG."""
    for target, source in staged.copies:
        target.copy_(torch.from_numpy(source) if isinstance(source, np.ndarray) else source)
    attrs = staged.attrs
    trainer.step = int(attrs["step"])
    trainer.optimizer.step_count = int(attrs["optimizer_step"])
    if is_weights_only(attrs):  # the run's own data order, loss scale and RNG, from the start
        return
    trainer.batches.load_state_dict(attrs["sampler"])
    if trainer.scaler.enabled and attrs.get("loss_scaler"):
        trainer.scaler.load_state_dict(attrs["loss_scaler"])
    if staged.rng_row is not None:
        torch.set_rng_state(torch.from_numpy(staged.rng_row))
    trainer.flat.reducer.load_state_dict(staged.compression)


def load_into(trainer, reader) -> None:
    """Read, check and apply a checkpoint in one go (raises CheckpointError on a problem, before the
    trainer changes). The manager splits these phases to agree between them across ranks."""
    staged = read_state(trainer, reader)
    if reader.problems:
        raise CheckpointError(f"{reader.path}: " + "; ".join(reader.problems[:3]))
    apply_state(trainer, staged)
