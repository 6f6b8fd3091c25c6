"""Hugging Face PEFT LoRA adapters <-> hpctrain ``[lora]`` adapters: the adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(base, DIR)``
loads, and the merged weight ``W + alpha/r B A``.

Names: hpctrain's ``layers.3.attn.wq.lora_A.weight`` is PEFT's saved key
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (the HF name of the linear, hf.py, under
PEFT's ``base_model.model.`` prefix; no adapter name in the file). Shapes are the same: A [r, in], B [out, r].
Only what hpctrain computes is accepted on import: plain LoRA (no DoRA, no rank-stabilised scaling, no
per-module rank/alpha patterns, no biases, no extra trained modules) on q/k/v/o/gate/up/down of every layer.
"""
from __future__ import annotations

import json
import os

import torch

from hpctrain.config import Config, ConfigError, LoraConfig, validate
from hpctrain.errors import HpcTrainError
from hpctrain.interop.hf import hf_name, read_dir_json
from hpctrain.interop.hf_config import import_seq_len
from hpctrain.models.lora import TARGET_MODULES, adapter_shapes
from hpctrain.runtime.dtypes import torch_dtype

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
HF_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}
# adapter_config.json keys whose value must be this (or absent) for hpctrain to compute the same function
_MUST_BE = {"bias": ("none",), "use_rslora": (False,), "use_dora": (False,), "fan_in_fan_out": (False,),
            "modules_to_save": (None, []), "layers_to_transform": (None, []), "rank_pattern": ({}, None),
            "alpha_pattern": ({}, None), "target_parameters": (None, []), "lora_bias": (False,),
            "exclude_modules": (None, []), "layer_replication": (None,), "trainable_token_indices": (None,)}


def peft_key(name: str) -> str:
    """PEFT's saved key of the hpctrain adapter ``name`` (``layers.0.attn.wq.lora_A.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    linear, factor = name.split(".lora_")
    return f"{PREFIX}{hf_name(linear + '.weight').removesuffix('.weight')}.lora_{factor}"


def adapter_config(lora, base: str | None) -> dict:
    """The adapter_config.json of ``lora`` (a ``[lora]`` section, rank > 0) on the model ``base`` (or None)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": sorted(HF_MODULES[t] for t in lora.targets),
            "base_model_name_or_path": base, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
            "revision": None}


def write_peft(directory: str, lora, adapters: dict[str, torch.Tensor], dtype: str, base: str | None) -> list[str]:
    """Write adapter_config.json and adapter_model.safetensors (``adapters``: hpctrain name -> global tensor)."""
    from safetensors.torch import save_file

    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(adapter_config(lora, base), f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({peft_key(n): t.to(torch_dtype(dtype)).contiguous() for n, t in adapters.items()},
              os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def merged(name: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor], lora) -> torch.Tensor:
    """``weight`` of the base parameter ``name`` plus its adapter's alpha/r B A (in float64, then the
    weight's dtype); unchanged when ``name`` has no adapter."""
    linear = name.removesuffix(".weight")
    a = adapters.get(f"{linear}.lora_A.weight")
    if a is None:
        return weight
    b = adapters[f"{linear}.lora_B.weight"]  # an adapter has both factors
    delta = (lora.alpha / lora.rank) * (b.double() @ a.double())
    return (weight.double() + delta).to(weight.dtype)


def read_adapter_config(directory: str) -> dict:
    path = os.path.join(directory, ADAPTER_CONFIG)
    raw = read_dir_json(directory, ADAPTER_CONFIG, "PEFT adapter", HpcTrainError)
    if not isinstance(raw, dict):
        raise HpcTrainError(f"{path}: not a JSON object")
    return raw


def lora_of(raw: dict, path: str) -> LoraConfig:
    """The ``[lora]`` section an adapter_config.json describes; HpcTrainError naming the field it cannot take."""
    if raw.get("peft_type") != "LORA":
        raise HpcTrainError(f"{path}: peft_type is {raw.get('peft_type')!r}: only LoRA adapters (\"LORA\") can "
                            f"be imported")
    for key, allowed in _MUST_BE.items():
        if key in raw and raw[key] not in allowed:
            raise HpcTrainError(f"{path}: {key} is {raw[key]!r}: hpctrain's LoRA needs {allowed[0]!r}")
    modules = raw.get("target_modules")
    names = {v: k for k, v in HF_MODULES.items()}
    if not isinstance(modules, list) or not modules or any(m not in names for m in modules):
        raise HpcTrainError(f"{path}: target_modules is {modules!r}: give a list of {', '.join(names)}")
    r, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise HpcTrainError(f"{path}: r is {r!r}: must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise HpcTrainError(f"{path}: lora_alpha is {alpha!r}: must be a positive number")
    dropout = raw.get("lora_dropout", 0.0) or 0.0
    order = list(TARGET_MODULES)
    return LoraConfig(rank=r, alpha=float(alpha), dropout=float(dropout),
                      targets=sorted((names[m] for m in set(modules)), key=order.index))


def read_peft(directory: str, m) -> tuple[LoraConfig, dict[str, torch.Tensor], dict]:
    """(its ``[lora]``, adapters by hpctrain name as global tensors, the raw adapter_config) of the PEFT
    adapter ``directory`` for the base model ``m`` (resolved): r and targets must fit ``m``, every key must be
    there with its shape, and nothing else."""
    from safetensors.torch import load_file

    raw = read_adapter_config(directory)
    path = os.path.join(directory, ADAPTER_CONFIG)
    lora = lora_of(raw, path)
    cfg = Config(model=m, lora=lora)
    cfg.train.seq_len = import_seq_len(m)
    try:
        validate(cfg)
    except ConfigError as exc:
        raise HpcTrainError(f"{path} does not fit the base model: {exc}") from None
    weights = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise HpcTrainError(f"{directory}: no {ADAPTER_WEIGHTS} (only safetensors adapters are read)")
    try:
        stored = load_file(weights)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise HpcTrainError(f"{weights}: not a readable safetensors file: {exc}") from None
    shapes = adapter_shapes(m, lora)
    wanted = {peft_key(n): n for n in shapes}
    missing = sorted(k for k in wanted if k not in stored)
    unexpected = sorted(k for k in stored if k not in wanted)
    if missing or unexpected:
        raise HpcTrainError(f"{weights}: the adapters do not match r={lora.rank} on {','.join(lora.targets)} of "
                            f"this base model: " + "; ".join(filter(None, [
                                f"missing {missing[:4]}" if missing else "",
                                f"unexpected {unexpected[:4]}" if unexpected else ""])))
    for key, name in wanted.items():
        if tuple(stored[key].shape) != shapes[name]:
            raise HpcTrainError(f"{weights}: {key} has shape {tuple(stored[key].shape)}, r={lora.rank} on this "
                                f"base model implies {shapes[name]}")
    return lora, {name: stored[key] for key, name in wanted.items()}, raw
