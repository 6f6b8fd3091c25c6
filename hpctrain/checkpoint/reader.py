"""Reading a checkpoint with plain h5py (serial), whichever writer made it; verifying its checksums."""
from __future__ import annotations

import json
import os

import h5py
import numpy as np

from hpctrain.checkpoint.format import COMPLETE_MARKER, FORMAT_NAME, MASTER_FILE, Box, crc32, decode_json

JSON_ATTRS = ("config", "layout", "sampler", "loss_scaler")


class CheckpointReader:
    """Open ``path`` (a step directory or its checkpoint.h5) read-only. Raises OSError/ValueError with
    the path on a missing, truncated or foreign file; callers turn those into CheckpointError."""

    def __init__(self, path: str):
        self.dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        self.path = os.path.join(path, MASTER_FILE) if os.path.isdir(path) else path
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"{self.path}: no such checkpoint file")
        try:
            self.file = h5py.File(self.path, "r")
        except OSError as exc:
            raise OSError(f"{self.path}: not a readable HDF5 file (truncated or corrupt?): {exc}") from None
        if self.file.attrs.get("format") != FORMAT_NAME:
            raise ValueError(f"{self.path}: not an hpctrain checkpoint (format attribute "
                             f"{self.file.attrs.get('format')!r})")
        self.attrs = {k: (json.loads(v) if k in JSON_ATTRS else _plain(v)) for k, v in self.file.attrs.items()}
        self.manifest = decode_json(self.file["manifest"][()]) if "manifest" in self.file else {}

    @property
    def complete(self) -> bool:
        return os.path.exists(os.path.join(self.dir, COMPLETE_MARKER))

    def shape(self, name: str):
        return self.file[name].shape if name in self.file else None

    def read(self, name: str, box: Box) -> np.ndarray:
        return self.file[name][box.slices()]

    def datasets(self) -> list[str]:
        names = []
        self.file.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) and n != "manifest"
                             else None)
        return sorted(names)

    def boxes(self) -> list[tuple[str, Box, int]]:
        """Every (dataset, box, crc32) of the manifest, in a fixed order."""
        return [(name, Box(tuple(off), tuple(shape)), crc) for name in sorted(self.manifest)
                for off, shape, crc in self.manifest[name]]

    def verify(self, rank: int = 0, size: int = 1) -> list[str]:
        """Check the manifest covers every dataset and recompute the checksums of boxes rank::size.
        Returns a list of problems (empty = good)."""
        problems = []
        if rank == 0:
            for name in self.datasets():
                covered = sum(int(np.prod(s)) for _, s, _ in self.manifest.get(name, []))
                if covered != int(np.prod(self.file[name].shape)):
                    problems.append(f"dataset {name}: manifest covers {covered} of "
                                    f"{int(np.prod(self.file[name].shape))} elements (partial checkpoint)")
        for i, (name, box, crc) in enumerate(self.boxes()):
            if i % size != rank:
                continue
            try:
                actual = crc32(self.read(name, box))
            except (OSError, KeyError, ValueError) as exc:
                problems.append(f"dataset {name} box {box.offset}+{box.shape}: unreadable ({exc})")
                continue
            if actual != crc:
                problems.append(f"dataset {name} box {box.offset}+{box.shape}: checksum mismatch "
                                f"(stored {crc:08x}, data {actual:08x}): corrupted")
        return problems

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value
