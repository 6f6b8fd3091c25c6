"""Compression state in a checkpoint: each world rank's reducer state (error-feedback residuals, PowerSGD's
Q, 1-bit Adam's worker and server errors) as its own 1-D datasets ``compression/rankRRRRR/<key>``, with the
reducer's signature beside them; read back only into a reducer of the same signature (docs/compression.md)."""
from __future__ import annotations

import json

import torch

from hpctrain.checkpoint.contract import TrainState
from hpctrain.checkpoint.format import Box, decode_json, encode_json
from hpctrain.checkpoint.items import CheckpointError, Snapshot, WriteItem, to_host
from hpctrain.checkpoint.frozen_state import FrozenState

def compression_group(rank: int) -> str:
    return f"compression/rank{rank:05d}"


def snapshot_compression(state: TrainState | FrozenState, snap: Snapshot) -> None:
    """The reducer's state (error-feedback residuals, PowerSGD Q) as this world rank's own 1-D datasets
    ``compression/rankRRRRR/<key>``, with the reducer's signature beside them (JSON bytes)."""
    reducer = state.reducer
    saved = reducer.state_dict()
    if not saved and not reducer.signature():
        return
    group = compression_group(state.rank)
    host = to_host(list(saved.values()))
    for key, value in zip(saved, host):
        array = value.detach().to("cpu").numpy().reshape(-1).copy()
        snap.datasets[f"{group}/{key}"] = ((array.size,), array.dtype.str)
        snap.items.append(WriteItem(f"{group}/{key}", Box((0,), (array.size,)), array))
    signature = encode_json(reducer.signature())
    snap.datasets[f"{group}/signature"] = ((signature.size,), "|u1")
    snap.items.append(WriteItem(f"{group}/signature", Box((0,), (signature.size,)), signature))


def check_onebit_adam(state: TrainState, reader) -> None:
    """CheckpointError when 1-bit Adam is entered from another compressing method's checkpoint or left (a
    onebit-adam checkpoint resumed with another method, ``none`` too: ``ANOTHER_METHOD``), or when
    ``compression.warmup_steps`` changes after the variance froze, or to below the optimizer steps already
    made (``OTHER_FREEZE``). A change inside the warm-up, to at least those steps, is fine."""
    from hpctrain.config import config_from_dict

    ours, theirs = state.config.compression, config_from_dict(reader.attrs["config"]).compression
    if ours.method != theirs.method and "onebit-adam" in (ours.method, theirs.method) and theirs.method != "none":
        raise CheckpointError(f"compression.method={ours.method!r}: {reader.path} was written with "
                              f"compression.method={theirs.method!r}; {ANOTHER_METHOD} (1-bit Adam's "
                              f"error buffers and frozen variance do not carry over): resume with "
                              f"compression.method={theirs.method!r}, or start a new run")
    steps = int(reader.attrs.get("optimizer_step", 0))  # the optimizer steps made: dense while < warmup_steps
    if ours.method == theirs.method == "onebit-adam" and ours.warmup_steps != theirs.warmup_steps \
            and (steps >= theirs.warmup_steps or steps > ours.warmup_steps):
        raise CheckpointError(f"compression.warmup_steps={ours.warmup_steps}: {reader.path} (optimizer step "
                              f"{steps}) was written with compression.warmup_steps={theirs.warmup_steps}: "
                              f"{OTHER_FREEZE}: resume with compression.warmup_steps={theirs.warmup_steps}, or "
                              f"start a new run")


def read_compression(state: TrainState, reader, staged) -> None:
    """Stage this rank's reducer state if the checkpoint holds state of the SAME reducer signature (same
    method, layout, buckets, node split); otherwise the reducer starts fresh and ``staged.compression_note``
    says why (the documented rule: docs/compression.md)."""
    mine, rank = state.reducer.signature(), state.rank
    group = compression_group(rank)
    shape = reader.shape(f"{group}/signature")
    if not mine:
        return
    if shape is None:
        staged.compression_note = "the checkpoint has no compression state for this rank"
        return
    theirs = decode_json(reader.read_checked(f"{group}/signature", Box((0,), shape)))
    if theirs != json.loads(json.dumps(mine)) or reader.attrs["layout"].get("world") != state.world_size:
        staged.compression_note = "it was written by another compression method, layout or bucket split"
        return
    for name in reader.datasets(prefix=group + "/"):
        key = name[len(group) + 1:]
        if key != "signature":
            staged.compression[key] = torch.from_numpy(reader.read_checked(name, Box((0,), reader.shape(name))).copy())


ANOTHER_METHOD = "another compression method's checkpoint"  # onebit-adam <-> another method: no fallback
OTHER_FREEZE = ("1-bit Adam's warm-up may change only while it runs, to at least the optimizer steps made (its "
                "end freezes the variance)")  # no fallback
