"""Reading a checkpoint with plain h5py (serial), whichever writer made it; verifying its checksums.

Two ways to verify: ``verify()`` re-reads boxes and recomputes their CRCs (``hpctrain ckpt verify``,
the check after a save), and ``read_checked()`` serves a load from whole manifest boxes, checking each
box's CRC on the bytes it reads anyway, so a resume reads every byte once (``checked`` and ``problems``
record what it saw, ``bytes_read`` counts every byte read; ``verify(skip=...)`` then covers only the boxes
no rank loaded).
"""
from __future__ import annotations

import json
import os

import h5py
import numpy as np

from hpctrain.checkpoint.format import COMPLETE_MARKER, FORMAT_NAME, MASTER_FILE, Box, crc32, decode_json

JSON_ATTRS = ("config", "layout", "sampler", "loss_scaler", "lora_base", "architecture")


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
        self._boxes = self.boxes()
        self._by_dataset: dict[str, list[int]] = {}
        for i, (name, _, _) in enumerate(self._boxes):
            self._by_dataset.setdefault(name, []).append(i)
        self._cache: dict[int, np.ndarray | None] = {}  # None: the box failed its check
        self._taken: dict[int, int] = {}  # box index -> elements copied out of its cached data so far
        self.checked: set[int] = set()  # manifest box indices whose CRC read_checked() has computed
        self.problems: list[str] = []    # what read_checked() found wrong
        self.bytes_read = 0              # bytes read from the file so far, by read() and all that uses it

    @property
    def complete(self) -> bool:
        return os.path.exists(os.path.join(self.dir, COMPLETE_MARKER))

    def shape(self, name: str):
        return self.file[name].shape if name in self.file else None

    def read(self, name: str, box: Box) -> np.ndarray:
        data = self.file[name][box.slices()]
        self.bytes_read += data.nbytes
        return data

    def datasets(self, prefix: str = "") -> list[str]:
        """Every dataset's full name (under the group ``prefix`` when given), sorted."""
        group = prefix.rstrip("/")
        if group and group not in self.file:
            return []
        root = self.file[group] if group else self.file
        names = []
        root.visititems(lambda n, obj: names.append(f"{group}/{n}" if group else n)
                        if isinstance(obj, h5py.Dataset) and n != "manifest" else None)
        return sorted(names)

    def boxes(self) -> list[tuple[str, Box, int]]:
        """Every (dataset, box, crc32) of the manifest, in a fixed order."""
        return [(name, Box(tuple(off), tuple(shape)), crc) for name in sorted(self.manifest)
                for off, shape, crc in self.manifest[name]]

    def verify(self, rank: int = 0, size: int = 1, skip: frozenset | set = frozenset()) -> list[str]:
        """Check the manifest covers every dataset and recompute the checksums of boxes rank::size,
        except the box indices in ``skip`` (already checked by a read_checked() somewhere).
        Returns a list of problems (empty = good)."""
        problems = []
        if rank == 0:
            for name in self.datasets():
                covered = sum(int(np.prod(s)) for _, s, _ in self.manifest.get(name, []))
                if covered != int(np.prod(self.file[name].shape)):
                    problems.append(f"dataset {name}: manifest covers {covered} of "
                                    f"{int(np.prod(self.file[name].shape))} elements (partial checkpoint)")
        for i in range(rank, len(self._boxes), size):
            if i not in skip:
                self._checked_box(i, problems)
        return problems

    def _checked_box(self, i: int, problems: list[str]) -> np.ndarray | None:
        """Read manifest box ``i`` whole and check its CRC; None (and a problem) if unreadable."""
        name, box, crc = self._boxes[i]
        try:
            data = self.read(name, box)
        except (OSError, KeyError, ValueError) as exc:
            problems.append(f"dataset {name} box {box.offset}+{box.shape}: unreadable ({exc})")
            return None
        actual = crc32(data)
        if actual != crc:
            problems.append(f"dataset {name} box {box.offset}+{box.shape}: checksum mismatch "
                            f"(stored {crc:08x}, data {actual:08x}): corrupted")
        return data

    def read_checked(self, name: str, box: Box) -> np.ndarray:
        """``read(name, box)`` assembled from the whole manifest boxes it overlaps, each read once and
        CRC-checked (results in ``checked``/``problems``; a bad box never raises here). Datasets
        without manifest entries are read plainly (``verify`` reports them as uncovered)."""
        indices = self._by_dataset.get(name)
        if not indices:
            return self.read(name, box)
        out = np.zeros(box.shape, dtype=self.file[name].dtype)
        covered = 0
        for i in indices:
            written = self._boxes[i][1]
            lo = [max(a, b) for a, b in zip(box.offset, written.offset)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(box.offset, box.shape, written.offset, written.shape)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            if i not in self._cache:
                self.checked.add(i)
                self._cache[i] = self._checked_box(i, self.problems)
            cached = self._cache[i]
            if cached is not None:
                out[tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, box.offset))] = \
                    cached[tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, written.offset))]
            taken = int(np.prod([y - x for x, y in zip(lo, hi)]))
            covered += taken
            self._taken[i] = self._taken.get(i, 0) + taken
            if self._taken[i] >= written.size and cached is not None:  # every element copied out: forget it
                del self._cache[i]  # (asked again, it is read and checked again), so a resume holds its
                self._taken[i] = 0  # state once beside the run's, not twice
        if covered != box.size:
            self.problems.append(f"dataset {name} box {box.offset}+{box.shape}: the manifest covers {covered} "
                                 f"of its {box.size} elements (partial checkpoint)")
        return out

    def drop_cache(self) -> None:
        self._cache.clear()
        self._taken.clear()

    def close(self) -> None:
        self._cache.clear()
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
