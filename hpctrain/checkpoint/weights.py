"""A checkpoint's model on ONE process, whatever layout wrote it (the global view): for generation,
export and inspection. No MPI.

    reader = open_checkpoint("runs/tiny")            # a run dir, checkpoints dir or step dir
    cfg, model = load_model(reader, dtype=torch.float64)
"""
from __future__ import annotations

import json
import os

import torch

from hpctrain.errors import HpcTrainError


def open_checkpoint(path: str):
    """The CheckpointReader of ``path``: a step directory or its checkpoint.h5, a checkpoints directory
    (its ``latest``), or a run directory (its ``checkpoints/latest``). Raises HpcTrainError."""
    from hpctrain.checkpoint.directory import read_latest
    from hpctrain.checkpoint.reader import CheckpointReader

    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "checkpoint.h5")):
        checkpoints = os.path.join(path, "checkpoints")
        directory = checkpoints if os.path.isdir(checkpoints) else path
        latest = read_latest(directory)
        if latest is None:
            raise HpcTrainError(f"{path}: neither a checkpoint nor a directory with a 'latest' checkpoint")
        path = os.path.join(directory, latest)
    try:
        return CheckpointReader(path)
    except (OSError, ValueError) as exc:
        raise HpcTrainError(str(exc)) from None


def config_of(reader):
    """The run's Config as the checkpoint recorded it."""
    from hpctrain.config import config_from_dict

    raw = reader.attrs["config"]
    return config_from_dict(raw if isinstance(raw, dict) else json.loads(raw))


def load_model(reader, dtype: torch.dtype | None = None, read=None):
    """(cfg, GPTStage holding every layer, no tp) with the checkpoint's weights, in eval mode. ``dtype``:
    default the run's (float32 for bf16/fp16 runs: their weights are stored in float32). ``read(name)``: the
    global tensor of parameter ``name`` (default: this file's ``/model/<name>``); a LoRA checkpoint that refers
    to its base needs ``interop.sources.CheckpointSource.read`` (``load_run_model`` there)."""
    from hpctrain.config import resolve_model
    from hpctrain.config.moe_keys import resolve_moe
    from hpctrain.models.gpt import GPTStage

    cfg = config_of(reader)
    m = resolve_model(cfg.model)
    if dtype is None:
        dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
    model = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, tp_comm=None, dtype=dtype, seed=cfg.train.seed,
                     lora=cfg.lora, moe=resolve_moe(cfg.moe, m))  # a LoRA run: base and adapters
    with torch.no_grad():
        for param in model.parameters():
            # the global (true-vocabulary) shape; padding rows stay zero
            spec = param.spec  # type: ignore[attr-defined]  # the SlabSpec hpctrain attaches (parallel/slab.py)
            param[spec.valid_local()] = read(spec.name) if read else _read_dataset(reader, spec)
    return cfg, model.eval()


def _read_dataset(reader, spec) -> torch.Tensor:
    dataset = f"model/{spec.name}"
    if tuple(reader.shape(dataset) or ()) != spec.global_shape:
        hint = " (it refers to its LoRA base: read it with interop.sources.load_run_model)" \
            if reader.attrs.get("lora_base") else ""
        raise HpcTrainError(f"{reader.path}: {dataset} has shape {reader.shape(dataset)}, the model "
                            f"{spec.global_shape}: the checkpoint does not match its own config{hint}")
    return torch.from_numpy(reader.file[dataset][()])
