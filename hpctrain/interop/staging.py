"""What import and export write, shared by commands/interop.py and commands/peft.py: ``staged_output``
(a temporary directory beside ``--out``, renamed at the end: nothing half-written) and the weights-only
step-0 checkpoint with its ``model.toml``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from hpctrain.errors import HpcTrainError
from hpctrain.runtime.dtypes import torch_dtype
from hpctrain.runtime.outputs import mark, why_not_replaceable


@contextlib.contextmanager
def staged_output(out: str, force: bool, tool: str, source: str):
    """Yield a fresh temporary directory beside ``out``; on success it becomes ``out`` (an existing one is
    replaced only when empty, or with ``force`` when ``tool`` wrote it: ``runtime/outputs.py``), on failure
    it is removed. ``out`` may never be, hold or lie inside ``source``."""
    out = os.path.abspath(out.rstrip("/") or out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise HpcTrainError(f"--out {out}: exists and is not a directory")
    problem = why_not_replaceable(out, f"--out {out}", (source,))
    if problem:
        raise HpcTrainError(problem)
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise HpcTrainError(f"--out {out}: exists and is not empty; use --force to replace it")
    parent, base = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        yield tmp
        mark(tmp, tool)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for root, _, files in os.walk(tmp):
            for name in files:
                path = os.path.join(root, name)
                os.chmod(path, 0o666 & ~umask)  # safetensors (0.8) writes its files 0600
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if os.path.isdir(out):
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(out, os.path.join(old, base))
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_toml(m, moe=None) -> str:
    """The ``[model]`` TOML section of the resolved model ``m`` (what a training config needs), and the
    ``[moe]`` section ``moe`` of a model with experts (num_experts > 0)."""
    from hpctrain.config import config_to_dict

    lines = ["[model]"]
    for key, value in config_to_dict(m).items():
        if key != "init_from":
            lines.append(f"{key} = {json.dumps(value)}")
    if moe is not None and moe.num_experts:
        lines += ["", "[moe]"] + [f"{key} = {json.dumps(value)}" for key, value in config_to_dict(moe).items()]
    return "\n".join(lines) + "\n"


def window_note(m, comment: str = "# ") -> str:
    """A line on the sliding window of the model ``m`` (none without one): train.seq_len must hold it."""
    if not m.attention_window:
        return ""
    return (f"{comment}model.attention_window = {m.attention_window} (Mistral's sliding_window) is part of the "
            f"model: train it with train.seq_len >= {m.attention_window} (a window must fit the sequence).\n")


class _OneRank:
    """The communicator the checkpoint writers need, for one process without MPI."""

    rank, size = 0, 1

    def allgather_object(self, obj):
        return [obj]

    def gather_object(self, obj, root: int = 0):
        return [obj]


def write_weights_only(directory: str, cfg, tensors: dict, dtype: str, source: str) -> str:
    """Write ``tensors`` (hpctrain name -> global tensor) as a published weights-only checkpoint of step 0 in
    the checkpoints directory ``directory`` (shards writer, verified); returns the step directory."""
    import hpctrain
    from hpctrain.checkpoint.format import (COMPLETE_MARKER, FORMAT_NAME, FORMAT_VERSION, LATEST_POINTER, Box,
                                            disk_dtype, model_dataset, step_dirname)
    from hpctrain.checkpoint.architecture import ARCHITECTURE_ATTR, record
    from hpctrain.checkpoint.reader import CheckpointReader
    from hpctrain.checkpoint.transfer import Snapshot, WriteItem
    from hpctrain.checkpoint.writers import write_shards
    from hpctrain.config import config_to_dict

    on_disk = disk_dtype(torch_dtype(dtype))
    snap = Snapshot(0, {})
    for name, t in tensors.items():
        array = t.to(torch_dtype(dtype)).double().numpy().astype(on_disk)  # bf16/fp16 widen exactly
        snap.datasets[model_dataset(name)] = (tuple(array.shape), on_disk.str)
        snap.items.append(WriteItem(model_dataset(name), Box((0,) * array.ndim, array.shape), array))
    snap.attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "hpctrain_version": hpctrain.__version__,
                  "step": 0, "optimizer_step": 0, "config": config_to_dict(cfg), "model_dtype": dtype,
                  "layout": {"dp": 1, "pp": 1, "tp": 1, "zero": 0, "world": 1},
                  "sampler": {"consumed": 0, "seed": cfg.train.seed, "seq_len": cfg.train.seq_len},
                  "loss_scaler": {"scale": cfg.train.loss_scale, "good_steps": 0},
                  "weights_only": True, "imported_from": source, ARCHITECTURE_ATTR: record(cfg.model, cfg.moe)}
    step_dir = os.path.join(directory, step_dirname(0))
    os.makedirs(os.path.join(step_dir, "shards"))
    write_shards(_OneRank(), step_dir, snap)
    with CheckpointReader(step_dir) as reader:
        problems = reader.verify()
    if problems:
        raise HpcTrainError(f"{step_dir}: the written checkpoint does not verify: {'; '.join(problems[:3])}")
    with open(os.path.join(step_dir, COMPLETE_MARKER), "w", encoding="utf-8") as f:
        json.dump({"step": 0, "writer": "shards"}, f)
    with open(os.path.join(directory, LATEST_POINTER), "w", encoding="utf-8") as f:
        f.write(step_dirname(0) + "\n")
    return step_dir
