"""The model a checkpoint was written for: root attribute ``architecture`` (JSON, docs/checkpoint-format.md)

    {"keys": {"vocab_size": 256, "d_model": 64, "n_layers": 4, ...},   config.architecture() of the run's model
     "fingerprint": "5f0c7a1e93b2d4c8"}                                 sha256 of the sorted keys (16 hex digits)

A resume (any checkpoint, weights-only or not) compares every key with the run's model and refuses another
one by name. A checkpoint written before the attribute existed: the keys its stored ``config`` implies.
"""
from __future__ import annotations

import hashlib
import json

from hpctrain.config import ModelConfig, architecture, config_from_dict

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
