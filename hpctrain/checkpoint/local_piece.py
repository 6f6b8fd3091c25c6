"""One rank's piece of the node-local tier: its whole training state for THIS layout, as one raw file.

A piece is ``<name>.bin`` (every tensor's bytes, 64-byte aligned, back to back) and ``<name>.json`` (its
index: per tensor name, dtype, shape, byte offset, CRC-32; the root state; the layout it was written for).
The json is written last and renamed into place, so a piece whose json exists is complete; the CRCs catch
what happened to the bytes since. Nothing here communicates (local_tier.py moves pieces between ranks).

What a piece holds of a rank (``piece_tensors``, through the ``TrainState`` contract only):
  ``range<i>/params`` and ``range<i>/<kind>``  each owned optimizer range (parameters, Adam moments, masters)
  ``frozen<i>``         ZeRO-3: this rank's slice of a unit's frozen base (a LoRA run's)
  ``param<i>/<name>``   a parameter's local slab, unless an owned range holds all of it in the same storage
                        (sharded ZeRO-3 parameters never: their values are the ranges or frozen slices)
  ``reducer/<key>``     the dp reducer's state (error-feedback residuals, PowerSGD Q)
  ``rng``               the torch CPU generator
Loading needs the same layout: the same names, dtypes and shapes, checked before anything is copied.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from hpctrain.checkpoint.contract import TrainState
from hpctrain.checkpoint.directory import fsync_path
from hpctrain.checkpoint.format import crc32
from hpctrain.errors import HpcTrainError

PIECE_FORMAT = "hpctrain-local-piece"
PIECE_VERSION = 1
ALIGN = 64


def taken_at_once(name: str) -> bool:
    """The RNG and the reducer's state: they change in the next forward and backward (copied in the step), and
    their shapes may differ between runs of one layout (not compared by ``problems_of``)."""
    return name == "rng" or name.startswith("reducer/")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def piece_tensors(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors of a piece, in a fixed order (views into the run: copying into them restores it)."""
    tensors = state.tensors()
    out: list[tuple[str, torch.Tensor]] = []
    for i, owned in enumerate(tensors.ranges):
        out.append((f"range{i}/params", owned.params))
        out.extend((f"range{i}/{kind}", owned.state[kind]) for kind in tensors.state_kinds)
    out.extend((f"frozen{i}", values) for i, values in enumerate(tensors.frozen_slices))  # ZeRO-3's frozen base
    owned_elements: dict[str, int] = {}
    for piece in tensors.pieces:
        owned_elements[piece.spec.name] = owned_elements.get(piece.spec.name, 0) + piece.hi - piece.lo
    range_storages = {r.params.untyped_storage().data_ptr() for r in tensors.ranges}
    for i, p in enumerate(tensors.params):
        in_ranges = (owned_elements.get(p.spec.name, 0) == p.data.numel()
                     and p.data.untyped_storage().data_ptr() in range_storages)
        if not p.sliced and not in_ranges:
            out.append((f"param{i}/{p.spec.name}", p.data))
    out.extend((f"reducer/{key}", value) for key, value in state.reducer.state_dict().items())
    out.append(("rng", state.rng_state()))
    return out


@dataclass
class Entry:
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # bytes into the .bin
    nbytes: int
    crc: int = 0


@dataclass
class Piece:
    """A piece in host memory: ``data`` (uint8, the .bin's bytes) and ``meta`` (the .json: ``entries`` and
    the root state under ``root``)."""

    data: torch.Tensor
    entries: list[Entry]
    meta: dict = field(default_factory=dict)

    def view(self, entry: Entry) -> torch.Tensor:
        raw = self.data[entry.offset:entry.offset + entry.nbytes]
        return raw.view(getattr(torch, entry.dtype)).view(entry.shape)

    def index(self) -> dict:
        """The .json document."""
        return {**self.meta, "format": PIECE_FORMAT, "version": PIECE_VERSION, "nbytes": self.data.numel(),
                "tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes, e.crc] for e in self.entries]}


def layout_of(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[Entry], int]:
    """Entries (offsets 64-byte aligned) for ``tensors`` and the bytes they need."""
    entries, at = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(Entry(name, _dtype_name(t), tuple(t.shape), at, nbytes))
        at += -(-nbytes // ALIGN) * ALIGN
    return entries, at


class SnapshotBuffer:
    """A host buffer reused by every local save of a run (no allocation, no page faults in the step). ``take``
    copies the small tensors (reducer state, RNG: they change in the next forward and backward) at once and
    returns the copies of the rest (parameters, optimizer state: unchanged until the next update) as a
    callable, for a background thread (from a GPU into pinned memory, each copy complete when it returns)."""

    def __init__(self):
        self.piece: Piece | None = None

    def take(self, state: TrainState, meta: dict) -> tuple[Piece, Callable[[], None]]:
        tensors = piece_tensors(state)
        entries, total = layout_of(tensors)
        cuda = any(t.is_cuda for _, t in tensors)
        if self.piece is None or self.piece.data.numel() != total or \
                [(e.name, e.dtype, e.shape) for e in entries] != [(e.name, e.dtype, e.shape) for e in self.piece.entries]:
            self.piece = Piece(torch.empty(total, dtype=torch.uint8, pin_memory=cuda), entries)
        piece = self.piece
        piece.meta = meta
        now = [(t, e) for (name, t), e in zip(tensors, piece.entries) if taken_at_once(name)]
        later = [(t, e) for (name, t), e in zip(tensors, piece.entries) if not taken_at_once(name)]

        def copy(pairs) -> None:  # blocking copies: done when it returns, on whichever thread (and its device)
            for t, entry in pairs:
                piece.view(entry).copy_(t.detach())
        copy(now)
        return piece, lambda: copy(later)


def _crc(piece: Piece, e: Entry) -> int:
    return crc32(piece.data.numpy()[e.offset:e.offset + e.nbytes])


def checksum(piece: Piece) -> None:
    """Fill every entry's CRC-32 (the background thread's work, off the step)."""
    for e in piece.entries:
        e.crc = _crc(piece, e)


def write_piece(piece: Piece, directory: str, name: str) -> str:
    """Write ``<directory>/<name>.bin`` then ``.json`` (each to a temporary name, fsynced, renamed): the json's
    presence means a complete piece. Returns the json's path."""
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, name)
    for suffix, write in ((".bin", lambda f: f.write(piece.data.numpy().data)),
                          (".json", lambda f: f.write(json.dumps(piece.index()).encode()))):
        tmp = base + suffix + ".tmp"
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, base + suffix)
    fsync_path(directory)
    return base + ".json"


def read_index(path_json: str) -> dict:
    """The .json of a piece (OSError, ValueError on a missing or damaged one)."""
    with open(path_json, encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("format") != PIECE_FORMAT:
        raise ValueError(f"{path_json}: not an hpctrain local piece")
    return doc


def piece_from(doc: dict, data: torch.Tensor) -> Piece:
    entries = [Entry(n, d, tuple(s), o, b, c) for n, d, s, o, b, c in doc["tensors"]]
    meta = {k: v for k, v in doc.items() if k not in ("tensors", "format", "version", "nbytes")}
    return Piece(data, entries, meta)


def read_piece(path_json: str) -> Piece:
    """The piece whose index is ``path_json`` (its .bin beside it, mapped copy-on-write: no copy, no page
    faults on a fresh buffer; on /dev/shm the bytes are read in place), unchecked."""
    doc = read_index(path_json)
    path_bin = path_json.removesuffix(".json") + ".bin"
    nbytes = int(doc["nbytes"])
    with open(path_bin, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != nbytes:
            raise ValueError(f"{path_bin}: {size} bytes, its index says {nbytes} (truncated)")
        data = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8) if nbytes \
            else torch.empty(0, dtype=torch.uint8)
    return piece_from(doc, data)


def checksum_problem(piece: Piece) -> str | None:
    """The first tensor whose bytes do not match their stored CRC-32, named, or None."""
    for e in piece.entries:
        actual = _crc(piece, e)
        if actual != e.crc:
            return f"tensor {e.name}: checksum mismatch (stored {e.crc:08x}, data {actual:08x}): corrupted"
    return None


def problems_of(piece: Piece, state: TrainState) -> str | None:
    """Why ``piece`` cannot be loaded into this rank's run (a checksum, a tensor of another name, dtype or
    shape: another layout or model), or None."""
    problem = checksum_problem(piece)
    if problem:
        return problem
    signature = json.loads(json.dumps(state.reducer.signature()))
    if piece.meta.get("signature", {}) != signature:
        return "written with another gradient reducer (compression.* or layout differ)"
    try:
        state.check_sampler(piece.meta["root"]["sampler"])
    except HpcTrainError as exc:
        return str(exc)
    ours = [(n, _dtype_name(t), tuple(t.shape)) for n, t in piece_tensors(state) if not taken_at_once(n)]
    theirs = [(e.name, e.dtype, e.shape) for e in piece.entries if not taken_at_once(e.name)]
    if ours != theirs:
        differing = next((f"{a} here, {b} there" for a, b in zip(ours, theirs) if a != b),
                         f"{len(ours)} tensors here, {len(theirs)} there")
        return f"written for another layout or model ({differing})"
    return None


@torch.no_grad()
def apply_piece(piece: Piece, state: TrainState) -> None:
    """Copy a checked piece (``problems_of`` None) into the run: tensors, reducer, RNG, steps, sampler, scaler."""
    live = dict(piece_tensors(state))
    reducer = {}
    for e in piece.entries:
        if e.name.startswith("reducer/"):
            reducer[e.name.removeprefix("reducer/")] = piece.view(e).clone()
        elif e.name == "rng":
            state.set_rng_state(piece.view(e).clone())
        else:
            live[e.name].copy_(piece.view(e))
    root = piece.meta["root"]
    state.set_steps(int(root["step"]), int(root["optimizer_step"]))
    state.load_sampler(root["sampler"])
    if root.get("loss_scaler"):
        state.load_loss_scaler(root["loss_scaler"])
    state.reducer.load_state_dict(reducer)
    if piece.meta.get("base_reference") is not None:
        state.base_reference = piece.meta["base_reference"]
