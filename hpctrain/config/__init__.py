"""The spec of a run, no torch, no MPI: its configuration and what follows from it by arithmetic alone.

    cfg = load_config("configs/tiny.toml", ["parallel.tp=2", "train.steps=10"])
    model = resolve_model(cfg.model)  # size fields left at 0 take the preset's value

The configuration is a tree of dataclasses loaded from TOML with ``section.key=value`` overrides:
``tree.py`` (``Config``), its sections in ``model_keys.py``, ``parallel_keys.py``, ``train_keys.py`` (each
key with its default, rule and help text: ``keys.py``), ``load.py`` (TOML, overrides, dicts),
``validation.py`` (presets filled in, every rule checked). Beside it: ``presets.py`` (named model shapes),
``arithmetic.py`` (parameters, FLOPs, the split over stages), ``rules.py`` and ``layout.py`` (the
parallel layout's rules and sizes), ``metric_names.py`` (every metric hpctrain exports). The names below are
the package's public interface.
"""
from hpctrain.config.keys import ConfigError
from hpctrain.config.load import apply_overrides, config_from_dict, config_to_dict, load_config
from hpctrain.config.model_keys import LORA_TARGETS, LoraConfig, ModelConfig
from hpctrain.config.parallel_keys import CommConfig, CompressionConfig, ParallelConfig
from hpctrain.config.presets import MODEL_DEFAULTS, PRESET_KEYS, PRESETS
from hpctrain.config.train_keys import CheckpointConfig, DataConfig, MonitorConfig, OptimConfig, TrainConfig
from hpctrain.config.tree import Config
from hpctrain.config.validation import (ARCHITECTURE_KEYS, architecture, architecture_differences, resolve_model,
                                        validate)

__all__ = ["ARCHITECTURE_KEYS", "LORA_TARGETS", "MODEL_DEFAULTS", "PRESETS", "PRESET_KEYS", "CheckpointConfig",
           "CommConfig", "CompressionConfig", "Config", "ConfigError", "DataConfig", "LoraConfig", "ModelConfig",
           "MonitorConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "apply_overrides", "architecture",
           "architecture_differences", "config_from_dict", "config_to_dict", "load_config", "resolve_model",
           "validate"]
