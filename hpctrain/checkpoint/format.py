"""The checkpoint format: names, dtypes, boxes and checksums (see docs/checkpoint-format.md).

A checkpoint is a directory ``step-NNNNNNNN/`` holding ``checkpoint.h5`` (and, for the shards writer,
``shards/shard-RRRRR.h5`` files that ``checkpoint.h5`` stitches together with virtual datasets) and a
``COMPLETE`` marker written last. Every tensor is stored at its GLOBAL shape:

    /model/<param name>                 parameters (float32 on disk for bf16/fp16 models: root attr model_dtype)
    /optim/exp_avg/<param name>         AdamW first moment (or SGD momentum), master dtype
    /optim/exp_avg_sq/<param name>      AdamW second moment
    /optim/master/<param name>          float32 master weights (half-precision models only)
    /rng/torch_cpu                      [world, n] uint8, one row per writing rank
    /manifest                           JSON (uint8 bytes): dataset -> [[offset, shape, crc32], ...]

Each rank writes boxes (rectangular hyperslabs) of the global datasets; every element is written by
exactly one rank, and each box's CRC-32 is recorded in the manifest so any reader can verify any
part without hpctrain. Root attributes hold the step, the config, the layout that wrote it, the data
sampler position, loss-scaler state, optimizer step count and the package version. A LoRA run's checkpoint
may leave its frozen base out of ``/model`` and refer to it instead (root attribute ``lora_base``).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch only for annotations: `hpctrain check` lists checkpoints without importing it (2 s)
    import torch

FORMAT_NAME = "hpctrain-checkpoint"
FORMAT_VERSION = 1
MASTER_FILE = "checkpoint.h5"
COMPLETE_MARKER = "COMPLETE"
LATEST_POINTER = "latest"
STEP_PREFIX = "step-"
BASE_REFERENCE_ATTR = "lora_base"  # a LoRA checkpoint's reference to its frozen base (interop/base_ref.py)

_DISK_DTYPES = {"torch.float64": np.float64, "torch.float32": np.float32, "torch.bfloat16": np.float32,
                "torch.float16": np.float32}  # by str(dtype)


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def model_dataset(name: str) -> str:
    return f"model/{name}"


def optim_dataset(kind: str, name: str) -> str:
    return f"optim/{kind}/{name}"


def disk_dtype(dtype: torch.dtype):
    return np.dtype(_DISK_DTYPES[str(dtype)])


@dataclass(frozen=True)
class Box:
    """A rectangle of a global dataset: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


def local_range_boxes(spec, a: int, b: int) -> list[tuple[Box, int, int]]:
    """Elements [a, b) of this rank's C-ordered local slab of ``spec`` as global boxes.

    Returns (box, a_i, b_i) pieces in increasing local order (which is also the global row-major order
    of those elements, since they lie in one slab): 1 for a 1-D tensor, at most 3 for a 2-D tensor (partial
    first row, full rows, partial last row), at most 2 n - 1 for an n-D one (an MoE layer's experts, 3-D:
    the same split, recursively, inside the partial first and last rows). Padding rows (a padded vocabulary:
    the slab's elements from ``spec.valid_numel`` on) have no place in the global tensor: they are left out.
    """
    origin = tuple(s.start or 0 for s in spec.local_slices())
    a, b = min(a, spec.valid_numel), min(b, spec.valid_numel)
    if a >= b:
        return []
    return [(Box(tuple(o + i for o, i in zip(origin, offset)), shape), lo, hi)
            for offset, shape, lo, hi in _range_boxes(tuple(spec.local_shape), a, b)]


def _range_boxes(shape: tuple[int, ...], a: int, b: int, base: int = 0) -> list:
    """Elements [a, b) (0 <= a < b <= numel) of a C-ordered array of ``shape`` as (offset, box shape, base + a_i,
    base + b_i) rectangles, in order."""
    if len(shape) == 1:
        return [((a,), (b - a,), base + a, base + b)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    row_a, off_a = divmod(a, inner)
    row_b, off_b = divmod(b, inner)

    def within(row, lo, hi):  # a part of one row: the same split one dimension down
        return [((row,) + off, (1,) + box, lo_i, hi_i)
                for off, box, lo_i, hi_i in _range_boxes(shape[1:], lo, hi, base + row * inner)]

    if row_a == row_b:
        return within(row_a, off_a, off_b)
    pieces = []
    if off_a:
        pieces += within(row_a, off_a, inner)
        row_a += 1
    if row_b > row_a:
        pieces.append(((row_a,) + (0,) * (len(shape) - 1), (row_b - row_a,) + tuple(shape[1:]),
                       base + row_a * inner, base + row_b * inner))
    if off_b:
        pieces += within(row_b, 0, off_b)
    return pieces


def crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data) & 0xFFFFFFFF


def encode_json(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8)


def decode_json(array) -> Any:
    return json.loads(bytes(np.asarray(array, dtype=np.uint8)).decode())


def layout_text(layout: dict | None) -> str:
    """A saved layout record whole: ``dp2 x pp1 x cp1 x tp1 x ep2, ZeRO-1`` (ep and the stage where recorded)."""
    layout = layout or {}
    axes = " x ".join(f"{axis}{size}" for axis, size in layout.items() if axis not in ("zero", "world"))
    return axes + (f", ZeRO-{layout['zero']}" if "zero" in layout else "")


def layout_differences(theirs: dict | None, ours: dict) -> str:
    """What differs between two layout records, by config key: ``parallel.ep 2 there, 4 here``."""
    theirs = theirs or {}
    names = {"world": "ranks"}
    keys = [k for k in ours if theirs.get(k) != ours[k]] + [k for k in theirs if k not in ours]
    return "; ".join(f"{names.get(k, 'parallel.' + k)} {theirs.get(k, 'unrecorded')} there, "
                     f"{ours.get(k, 'unrecorded')} here" for k in keys)
