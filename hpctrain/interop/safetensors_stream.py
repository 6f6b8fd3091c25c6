"""Safetensors files written tensor by tensor: an export never holds more than one tensor.

``safetensors.torch.save_file`` takes every tensor at once. The format is simple and fixed (8 bytes of
little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes,
with no holes), and the shapes are known before any tensor is read (a checkpoint's datasets), so the header
is written first and each tensor's bytes follow as it is produced, then dropped. Files are cut at
``max_shard_bytes`` as ``save_pretrained`` cuts them: one ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``weight_map``, ``total_size``),
which transformers, PEFT and ``safetensors.safe_open`` read.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def shard_names(count: int, prefix: str = "model") -> list[str]:
    """The files ``count`` shards are written to (``save_pretrained``'s names)."""
    return [f"{prefix}.safetensors"] if count == 1 else \
        [f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def plan_shards(entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``entries`` (name, shape), in order, cut into shards of at most ``max_shard_bytes`` each (a tensor larger
    than that alone in its shard)."""
    size = torch.empty((), dtype=dtype).element_size()
    shards: list[list] = [[]]
    used = 0
    for name, shape in entries:
        n = size * int(torch.Size(shape).numel())
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += n
    return shards


def _header(entries, dtype: torch.dtype, metadata: dict) -> tuple[bytes, int]:
    """The JSON header (padded with spaces to a multiple of 8, as safetensors writes it) and the data size."""
    size = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": metadata}
    at = 0
    for name, shape in entries:
        n = size * int(torch.Size(shape).numel())
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8), at


def write_streamed(directory: str, entries: list[tuple[str, tuple[int, ...]]], produce: Callable[[str], torch.Tensor],
                   dtype: torch.dtype, max_shard_bytes: int, metadata: dict | None = None) -> list[str]:
    """Write ``entries`` (name, shape) into ``directory`` as safetensors of ``dtype``: ``produce(name)`` gives each
    tensor when its turn comes (cast here; its shape must be the one declared). Returns the files written."""
    shards = plan_shards(entries, dtype, max_shard_bytes)
    names = shard_names(len(shards))
    weight_map, total = {}, 0
    for file, shard in zip(names, shards):
        header, data = _header(shard, dtype, metadata or {"format": "pt"})
        with open(os.path.join(directory, file), "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for name, shape in shard:
                t = produce(name)
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{name}: produced shape {tuple(t.shape)}, declared {tuple(shape)}")
                f.write(t.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
                weight_map[name] = file
                del t
        total += data
    if len(names) == 1:
        return names
    with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        f.write("\n")
    return names + [INDEX]
