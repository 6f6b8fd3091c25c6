"""LoRA on the GPT (``[lora]``, docs/models-and-data.md): which linear each ``lora.targets`` name means,
adapters on them (hpctrain/parallel/lora.py) and a frozen base, and the start-up line's arithmetic.

With ``lora.rank`` > 0 every parameter but the adapters has requires_grad=False (embeddings and norms
too, as PEFT's default): the trainer gives FlatParams and the optimizer the adapters alone.
"""
from __future__ import annotations

from torch import nn

from hpctrain.config.arithmetic import adapter_parameters, count_parameters, lora_target_shapes
from hpctrain.parallel.lora import attach_lora, freeze_all_but_adapters

# lora.targets name -> (module path inside a Block, column-parallel?)
TARGET_MODULES = {"q": ("attn.wq", True), "k": ("attn.wk", True), "v": ("attn.wv", True), "o": ("attn.wo", False),
                  "gate": ("mlp.gate", True), "up": ("mlp.up", True), "down": ("mlp.down", False)}


def enabled(lora) -> bool:
    """Whether a ``[lora]`` section (or None) asks for adapters."""
    return lora is not None and lora.rank > 0


def adapter_shapes(m, lora) -> dict[str, tuple[int, int]]:
    """Every adapter factor of the model ``m`` (resolved) with ``lora`` (rank > 0), global name -> shape:
    ``layers.i.<linear>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r], in model order."""
    shapes, out = lora_target_shapes(m), {}
    for i in range(m.n_layers):
        for target in lora.targets:
            path, (in_features, out_features) = TARGET_MODULES[target][0], shapes[target]
            out[f"layers.{i}.{path}.lora_A.weight"] = (lora.rank, in_features)
            out[f"layers.{i}.{path}.lora_B.weight"] = (out_features, lora.rank)
    return out


def add_adapters(stage: nn.Module, m, lora, tp_comm, dtype, seed: int) -> None:
    """Adapters on the ``lora.targets`` linears of every block of ``stage`` (a GPTStage, its ``layers``
    built), then freeze everything else of it. ``m``: the resolved model config (validated targets)."""
    shapes = lora_target_shapes(m)
    layers = stage.layers
    assert isinstance(layers, nn.ModuleDict)
    for index, block in layers.items():
        for target in lora.targets:
            path, column = TARGET_MODULES[target]
            in_features, out_features = shapes[target]
            if block.routed and path.startswith("mlp."):  # an MoE block: the experts' (and shared) weights
                continue
            attach_lora(block.get_submodule(path), f"layers.{index}.{path}", in_features, out_features, tp_comm,
                        column=column, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, dtype=dtype, seed=seed)
        if block.routed:
            _add_moe_adapters(block.moe, f"layers.{index}.moe", lora, tp_comm, dtype, seed)
    freeze_all_but_adapters(stage)


def _add_moe_adapters(moe, name: str, lora, tp_comm, dtype, seed: int) -> None:
    """An MoE block's MLP targets (gate, up, down): on every routed expert (batched factors) and on the shared
    experts' SwiGLU; the router is never adapted."""
    parts = [t for t in lora.targets if t in ("gate", "up", "down")]
    if parts:
        moe.experts.add_adapters(parts, lora.rank, lora.alpha, lora.dropout, tp_comm, seed)
    if parts and hasattr(moe, "shared"):
        d, width = moe.experts.gate.spec.global_shape[2], moe.shared.up.w.spec.global_shape[0]
        for part in parts:
            in_features, out_features = (width, d) if part == "down" else (d, width)
            attach_lora(getattr(moe.shared, part), f"{name}.shared.{part}", in_features, out_features, tp_comm,
                        column=part != "down", rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, dtype=dtype,
                        seed=seed)


def _count(n: int) -> str:
    return next(f"{n / scale:.2f}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
                if n >= scale or scale == 1)


def _bytes(n: float) -> str:
    return next(f"{n / scale:.1f} {unit}" for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
                if n >= scale or scale == 1)


def describe(m, lora, dtype: str, optim) -> str:
    """The start-up line of a LoRA run (whole model, all ranks together): trainable vs frozen parameters
    (the share of all, as PEFT's ``print_trainable_parameters``), and the optimizer state (AdamW: two
    moments, SGD: its momentum if any; plus float32 masters for half precision) and gradient memory
    against full fine-tuning of the same model (``optim``: the ``[optim]`` section)."""
    total, trainable = count_parameters(m), adapter_parameters(m, lora.rank, lora.targets)
    half = dtype in ("bfloat16", "float16")
    state_bytes = 8 if dtype == "float64" else 4  # float32 masters, moments and grads for half precision
    moments = 2 if optim.name == "adamw" else (1 if optim.momentum else 0)
    per_element = moments * state_bytes + (4 if half else 0)
    return (f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {','.join(lora.targets)}: {_count(trainable)} "
            f"trainable / {_count(total)} frozen parameters ({trainable / (trainable + total):.2%} of all), optimizer state "
            f"{_bytes(per_element * trainable)} instead of {_bytes(per_element * total)}, gradients "
            f"{_bytes(state_bytes * trainable)} instead of {_bytes(state_bytes * total)}")
