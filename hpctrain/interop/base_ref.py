"""A LoRA run's checkpoints REFER to their frozen base weights instead of copying them
(``lora.checkpoint_base = "reference"``, the default when the run starts from ``model.init_from``).

The reference is the checkpoint's root attribute ``lora_base`` (JSON, docs/checkpoint-format.md):

    {"path":     absolute path of the base: a Hugging Face directory or an hpctrain checkpoint step directory,
     "tensors":  {parameter name: CRC-32 of the global tensor's bytes, as the base stores them},
     "checksum": sha256 (hex) of the sorted (name, CRC-32) pairs: one value to compare and print}

Every check reads the base whole once, spread over the ranks (rank r takes the sorted names r, r + size, ...,
at most ``READ_BYTES`` at a time): when the reference is made (after ``model.init_from``) and when a
checkpoint is resumed. A base whose bytes changed, or one that is gone, stops the resume with one line that
names it; ``model.init_from`` of the resumed run is where the base is looked for when its recorded path is gone.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib

import torch

from hpctrain.errors import HpcTrainError, everywhere
from hpctrain.interop.hf import parameter_shapes

READ_BYTES = 64 << 20  # the most of a tensor one read takes (whole rows)
MISMATCH = "not the base its adapters were trained on"  # in every mismatch message: resume does not fall back


def tensor_crc(source, name: str, shape: tuple[int, ...]) -> int:
    """CRC-32 of the global tensor ``name`` of ``source`` (``sources.open_source``), read ``READ_BYTES`` of rows at a time."""
    if not shape:
        return zlib.crc32(_bytes(source.read(name)))
    row_bytes = max(1, int(torch.Size(shape[1:]).numel()) * 8)  # at most 8 bytes an element
    rows = max(1, READ_BYTES // row_bytes)
    crc, rest = 0, tuple(slice(None) for _ in shape[1:])
    for lo in range(0, shape[0], rows):
        crc = zlib.crc32(_bytes(source.read(name, (slice(lo, min(lo + rows, shape[0])),) + rest)), crc)
    return crc


def _bytes(tensor: torch.Tensor):
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def checksum(crcs: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(crcs.items())).encode()).hexdigest()


def crcs_of_share(source, model_cfg, rank: int, size: int) -> dict[str, int]:
    """{name: CRC-32} of this rank's share of the base parameters (sorted names rank::size)."""
    shapes = parameter_shapes(model_cfg)
    names = sorted(shapes)[rank::size]
    return {name: tensor_crc(source, name, shapes[name]) for name in names}


def make_reference(path: str, model_cfg, world, open_source) -> dict:
    """Collective over ``world``: the ``lora_base`` reference of the base at ``path`` (an HF directory or an
    hpctrain checkpoint, opened by ``open_source``: ``sources.open_source``; a LoRA checkpoint that refers to
    its own base passes that base on). Raises HpcTrainError on every rank if any rank cannot read its share."""
    mine, problem, where = {}, None, os.path.abspath(path)
    try:
        source = open_source(path)
        try:
            where = os.path.abspath(getattr(source, "base_path", None) or source.dir)  # a step dir, not "latest"
            mine = crcs_of_share(source, model_cfg, world.rank, world.size)
        finally:
            source.close()
    except (HpcTrainError, OSError) as exc:
        problem = str(exc)
    results = world.allgather_object((mine, problem, where))
    problems = [p for _, p, _ in results if p]
    if problems:
        raise everywhere(HpcTrainError(f"lora.checkpoint_base=reference: cannot checksum the base {path}: "
                                       f"{problems[0]}"))
    crcs = {name: crc for share, _, _ in results for name, crc in share.items()}
    return {"path": results[0][2], "tensors": crcs, "checksum": checksum(crcs)}


def locate(reference: dict, fallback: str, what: str) -> str:
    """Where the referenced base is now: its recorded path, else ``fallback`` (the run's model.init_from).
    HpcTrainError naming both when neither exists."""
    path = reference.get("path", "")
    if path and os.path.exists(path):
        return path
    if fallback and os.path.exists(fallback):
        return os.path.abspath(fallback)
    raise HpcTrainError(f"{what} refers to its LoRA base weights at {path} (lora.checkpoint_base=reference), which "
                        f"is gone: put the base back there, or set model.init_from to where it is now (its "
                        f"checksum {reference.get('checksum', '?')[:16]} is checked)")


def differences(reference: dict, crcs: dict[str, int]) -> list[str]:
    """Names of ``crcs`` whose CRC differs from (or is missing in) the reference."""
    recorded = reference.get("tensors", {})
    return sorted(name for name, crc in crcs.items() if recorded.get(name) != crc)


def mismatch_message(path: str, what: str, reference: dict, bad: list[str]) -> str:
    return (f"the LoRA base at {path} is {MISMATCH} ({what}): {len(bad)} tensor(s) differ from the checksums it "
            f"recorded (first: {bad[0]}; recorded base {reference.get('path')}, checksum "
            f"{reference.get('checksum', '?')[:16]}). Point model.init_from at the original base")


class ReferencedBase:
    """The base weights a checkpoint refers to, opened where ``locate`` finds them. ``verify_share(rank, size)``
    checks this rank's share of the checksums (the sorted names rank::size); ``read(name, index)`` reads like a
    source (``verify_all`` first: each tensor is checked the first time it is read). ``reference``: the
    reference with the path where the base is now (what the run's next checkpoints record). ``open_source``:
    ``sources.open_source``."""

    def __init__(self, reference: dict, fallback: str, model_cfg, what: str, open_source, verify_all: bool = False):
        self.path = locate(reference, fallback, what)
        recorded = reference.get("path", "")
        self.gone = recorded if recorded and not os.path.exists(recorded) else None  # the fallback stands in
        self.what, self.model_cfg, self.verify_all = what, model_cfg, verify_all
        self.source = open_source(self.path)
        self.base_path = getattr(self.source, "base_path", None) or self.path
        self.reference = {**reference, "path": self.base_path}
        self.shapes = parameter_shapes(model_cfg)
        self._checked: set[str] = set()

    def verify_share(self, rank: int, size: int) -> None:
        """Raise HpcTrainError (``MISMATCH``) if a tensor of this rank's share differs from the reference."""
        crcs = crcs_of_share(self.source, self.model_cfg, rank, size)
        self._raise_if_different(crcs)
        self._checked.update(crcs)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        if self.verify_all and name not in self._checked:
            self._raise_if_different({name: tensor_crc(self.source, name, self.shapes[name])})
            self._checked.add(name)
        return self.source.read(name, index)

    def _raise_if_different(self, crcs: dict[str, int]) -> None:
        bad = differences(self.reference, crcs)
        if bad and self.gone:  # the recorded base is gone; model.init_from (or --base) holds another one
            raise HpcTrainError(f"{self.what} refers to its LoRA base weights at {self.gone}, which is gone; "
                                f"{self.path}, where it was looked for instead, is {MISMATCH}: {len(bad)} "
                                f"tensor(s) differ (first: {bad[0]}; checksum "
                                f"{self.reference.get('checksum', '?')[:16]}). Put the base back at {self.gone}, "
                                f"or point model.init_from (export, generate: --base) at a copy of it")
        if bad:
            raise HpcTrainError(mismatch_message(self.path, self.what, self.reference, bad))

    def drop_cache(self) -> None:
        """Forget what the base's source cached (a Hugging Face directory caches nothing)."""
        drop = getattr(self.source, "drop_cache", None)
        if drop is not None:
            drop()

    def close(self) -> None:
        self.source.close()
