"""``train.fp8`` on the GPT (issue #54): which linears compute in float8 (hpctrain/parallel/fp8.py), what the
device allows, and the start-up line.

Covered: every transformer block's attention q/k/v/o and MLP (gate/up/down; an MoE block's shared experts'
too) and each routed expert's gate/up/down (one linear per expert, its own scales). Not covered, in the
training dtype: the embedding, the LM head and the MoE router (torchtitan's and Megatron's choice: the
first and last layers and the routing are the most sensitive to the cast).

    setup = setup_fp8(cfg.train, stages, grid.comm("tp"), device, m, moe)  # None with train.fp8 = none
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hpctrain.config import ConfigError
from hpctrain.models.moe import Experts
from hpctrain.parallel.fp8 import (FP8_MIN_CAPABILITY, TORCHAO_VERSION, Fp8Linear, Fp8Recipe, Fp8Stats,
                                   load_recipe, torchao_problem, unaligned)
from hpctrain.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def check_fp8(t, device: torch.device) -> None:
    """Raise ConfigError (the same on every rank) when ``train.fp8`` cannot run here: torchao missing or not
    the pinned version; a CPU without ``train.fp8_emulate``. Before anything is built or written."""
    if t.fp8 == "none":
        return
    problem = torchao_problem()
    if problem:
        raise ConfigError(f"config: train.fp8: {t.fp8!r} {problem}")
    if device.type != "cuda" and not t.fp8_emulate:
        raise ConfigError(f"config: train.fp8_emulate: train.fp8={t.fp8!r} on a {device.type.upper()} needs "
                          f"train.fp8_emulate=true (float8 matmuls need an sm89+ GPU; the emulation applies the "
                          f"same casts and scales and multiplies in float32)")


def native_fp8(device: torch.device) -> bool:
    """Whether ``device`` multiplies float8 natively (torch._scaled_mm: an sm89+ CUDA GPU)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def block_linears(stages) -> list[tuple[str, nn.Module, int, tuple[int, int]]]:
    """(name, module, split, local W shape [out, in]) of every block linear of ``stages`` (GPTStages), in model
    order: ColumnParallelLinear (split 0), RowParallelLinear (1); a routed ``Experts`` as its parts gate, up
    (split 0) and down (1), named ``<experts>.<part>``. The router and everything outside blocks are left out."""
    found: list[tuple[str, nn.Module, int, tuple[int, int]]] = []
    for stage in stages:
        for index, block in stage.layers.items():
            for name, module in block.named_modules(prefix=f"layers.{index}"):
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    found.append((name, module, 0 if isinstance(module, ColumnParallelLinear) else 1,
                                  tuple(module.weight.shape)))
                elif isinstance(module, Experts):
                    for part, split in (("gate", 0), ("up", 0), ("down", 1)):
                        found.append((f"{name}.{part}", module, split, tuple(getattr(module, part).shape[1:])))
    return found


def use_fp8(stages, recipe: Fp8Recipe, amax_comm, stats: Fp8Stats | None, aligned_only: bool = False,
            cp_comm=None) -> tuple[int, list[str]]:
    """Give every block linear of ``stages`` its ``Fp8Linear`` (amaxes max-reduced over ``amax_comm``: the tp
    group; a test passes another to show what a wrong group breaks; the activations' over tokens also over
    ``cp_comm``, the cp group; with ep > 1 the experts' rows come from the ep group's ranks, so their scales stay
    per source rank's rows, and with cp too they differ from one process's). ``aligned_only``: leave a linear whose
    slab is not a multiple of 16 in the training dtype. Returns (linears in float8 on this rank, counting each
    expert, names of those left out)."""
    covered, left = 0, []
    for name, module, split, shape in block_linears(stages):
        if aligned_only and unaligned(*shape):
            left.append(f"{name} [{shape[0]}, {shape[1]}]")
            continue
        if isinstance(module, Experts):
            # its rows come from this cp rank's tokens (ep = 1: its own, never another rank's experts')
            tokens = cp_comm if module.held is None else None
            module.fp8[name.rsplit(".", 1)[1]] = Fp8Linear(recipe, amax_comm, split, stats, tokens)
            covered += module.count
        else:
            module.fp8 = Fp8Linear(recipe, amax_comm, split, stats, cp_comm)  # type: ignore[assignment]  # Module.__setattr__'s stub takes only Tensor/Module
            covered += 1
    return covered, left


@dataclass
class Fp8Setup:
    """A run's float8: the recipe, the casts' ``stats`` (metrics.jsonl), and what rank 0 says at start-up
    (``lines``; ``warnings`` to stderr)."""

    recipe: Fp8Recipe | None  # None: float8 asked for but the GPU has none (the training dtype everywhere)
    stats: Fp8Stats
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def model_linears(m, moe=None) -> int:
    """The block linears of the whole model ``m`` (resolved; ``moe``: its resolved ``[moe]`` section or None),
    each routed expert's three counted: attention 4, MLP 3 (SwiGLU) or 2 (GELU), an MoE block 3 per routed
    expert (+ 3 for shared experts)."""
    routed = set(moe.layers) if moe is not None else set()
    dense = 3 if m.mlp == "swiglu" else 2
    per_moe = 3 * moe.num_experts + (3 if moe.shared_experts else 0) if moe is not None else 0
    return sum(4 + (per_moe if i in routed else dense) for i in range(m.n_layers))


def setup_fp8(t, stages, amax_comm, device: torch.device, dtype_name: str, m, moe=None,
              cp_comm=None) -> Fp8Setup | None:
    """``train.fp8`` on this rank's ``stages``: float8 on the block linears (``use_fp8``: amaxes over
    ``amax_comm``, the tp group, and over tokens ``cp_comm``), or the training dtype where the device or a
    linear's shape cannot (said in one line each). None: fp8 off."""
    if t.fp8 == "none":
        return None
    check_fp8(t, device)  # (``hpctrain train`` checked before building; a Trainer built directly is checked here)
    stats = Fp8Stats(device)
    native = native_fp8(device)
    if device.type == "cuda" and not native and not t.fp8_emulate:
        major, minor = torch.cuda.get_device_capability(device)
        return Fp8Setup(None, stats, warnings=[
            f"train.fp8={t.fp8}: this GPU (sm{major}{minor}) has no float8 matmul (sm89+: Ada, Hopper); every linear "
            f"runs in {dtype_name} instead (train.fp8_emulate=true runs the emulation)"])
    recipe = load_recipe(t.fp8, emulate=t.fp8_emulate)
    setup = Fp8Setup(recipe, stats)
    if native and t.fp8_emulate:
        setup.warnings.append(f"train.fp8_emulate=true on a GPU with float8 matmuls (sm89+): the emulation is slower "
                              f"than the native path; set train.fp8_emulate=false")
    _, left = use_fp8(stages, recipe, amax_comm, stats, aligned_only=not t.fp8_emulate, cp_comm=cp_comm)
    tp = 1 if amax_comm is None else amax_comm.size
    how = "emulated: float8 casts, float32 matmuls" if t.fp8_emulate else "torch._scaled_mm"
    over = f"amax max-reduced over tp={tp} where a tensor is split" if tp > 1 else "amax of the whole tensor"
    routed = moe is not None
    setup.lines.append(f"float8 {t.fp8} (torchao {TORCHAO_VERSION}, {how}) on {model_linears(m, moe)} linears of "
                       f"{m.n_layers} blocks (attention q/k/v/o, MLP{', each expert' if routed else ''})"
                       f"{' but those below' if left else ''}; embedding, LM head{', router' if routed else ''} in "
                       f"{dtype_name}; {over}")
    for name in left:
        setup.warnings.append(f"train.fp8: linear {name} is not a multiple of 16 (torch._scaled_mm): it runs in "
                              f"{dtype_name}")
    return setup
