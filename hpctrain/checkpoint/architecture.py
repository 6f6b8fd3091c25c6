"""The model a checkpoint was written for: root attribute ``architecture`` (JSON, docs/checkpoint-format.md)

    {"keys": {"vocab_size": 256, "d_model": 64, "n_layers": 4, ...},   config.architecture() of the run's model
     "fingerprint": "5f0c7a1e93b2d4c8"}                                 sha256 of the sorted keys (16 hex digits)

A resume (any checkpoint, weights-only or not) compares every key with the run's model and refuses another
one by name. A checkpoint written before the attribute existed: the keys its stored ``config`` implies.
"""
from __future__ import annotations

import hashlib
import json

from hpctrain.config import ModelConfig, architecture, architecture_differences, config_from_dict

ARCHITECTURE_ATTR = "architecture"


def fingerprint(keys: dict) -> str:
    """16 hex digits of the sha256 of ``keys`` (sorted JSON): one value to compare and print."""
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def record(m: ModelConfig, moe=None) -> dict:
    """The ``architecture`` attribute of a checkpoint of the model ``m`` (with its ``[moe]`` section)."""
    keys = architecture(m, moe)
    return {"keys": keys, "fingerprint": fingerprint(keys)}


def of_checkpoint(attrs: dict) -> dict:
    """The architecture keys of a checkpoint (its root attributes): the recorded ones, over those its config
    implies (all of them for a checkpoint without the attribute; a key added since: its default)."""
    raw = attrs["config"]
    cfg = config_from_dict(raw if isinstance(raw, dict) else json.loads(raw))
    derived = architecture(cfg.model, cfg.moe)
    recorded = attrs.get(ARCHITECTURE_ATTR) or {}
    return {**derived, **(recorded.get("keys") or {})}


def is_weights_only(attrs: dict) -> bool:
    """A weights-only checkpoint (root attribute ``weights_only``, e.g. from ``hpctrain import-hf``) holds
    ``/model`` alone: it loads as a fresh start from those weights (zero optimizer moments, the run's own
    sampler, loss scaler and RNG), in any layout, and its model config must match the run's exactly. A
    LoRA run takes its base weights from it; adapters it does not hold keep their initial values; one that
    holds adapters (``hpctrain import-peft``) needs the same lora.rank, targets and alpha."""
    return bool(attrs.get("weights_only", False))


def lora_differences(theirs, ours) -> list[str]:
    """``lora.KEY is X there, Y here`` for the adapter keys (rank; targets, unordered) on which a checkpoint and
    this run differ: a checkpoint resumes with its own adapters (``model.init_from`` takes its base weights)."""
    pairs = {"lora.rank": (theirs.rank, ours.rank)}
    if theirs.rank and ours.rank:
        pairs["lora.targets"] = (sorted(theirs.targets), sorted(ours.targets))
        pairs["lora.alpha"] = (theirs.alpha, ours.alpha)  # the same adapters compute another function
    return [f"{key} is {a!r} there, {b!r} here" for key, (a, b) in pairs.items() if a != b]


def model_differences(attrs: dict, cfg) -> list[str]:
    """Why a checkpoint (its root attributes) cannot resume into the run ``cfg``: each architecture key that
    differs, and the adapter keys (any checkpoint but a weights-only one without adapters). Empty: it fits."""
    raw = attrs["config"]
    theirs = config_from_dict(raw if isinstance(raw, dict) else json.loads(raw))
    differences = architecture_differences(of_checkpoint(attrs), architecture(cfg.model, cfg.moe))
    if not is_weights_only(attrs) or theirs.lora.rank:  # adapters (``import-peft``) need their [lora]
        differences += lora_differences(theirs.lora, cfg.lora)
    return differences
