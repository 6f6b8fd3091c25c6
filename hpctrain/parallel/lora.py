"""LoRA adapters on the tensor-parallel linears (as Hugging Face PEFT, split like Megatron's): the base
linear W x gains ``scaling * B (A dropout(x))`` with A [r, in], B [out, r], scaling = alpha / r.

Each adapter is split the way its base linear is, so that the sum over tp equals one process:

    ColumnParallelLinear  W [out/tp, in]   A [r, in] replicated     B [out/tp, r] split on out
    RowParallelLinear     W [out, in/tp]   A [r, in/tp] split on in B [out, r] replicated; the adapter's
                                           output joins the PARTIAL y before the all-reduce / reduce-scatter

Gradients partial per tp rank (``SlabSpec.partial_grad_over_tp``, summed over tp by FlatParams before the
dp reduction): column A (each rank back-propagates only its out/tp outputs: dA = (dy_r B_r)^T x) and row B
(each rank's h_r = A_r x_r is a partial sum of A x: dB = dy^T h_r). Column B and row A get exact grads.
The input's grad needs nothing new: column's is summed over tp by the input op's backward (copy /
gather), row's is this rank's slice.

Parameter names are PEFT's: ``<linear>.lora_A.weight`` [r, in], ``<linear>.lora_B.weight`` [out, r]
(global shapes), drawn from (seed, name) like every parameter: A Kaiming-uniform (PEFT's
``init_lora_weights=True``: U(-1/sqrt(in), 1/sqrt(in))), B zero. Dropout on the adapter's input draws its
mask from this rank's torch generator (seeded per world rank, saved in checkpoints on CPU runs): with
``lora.dropout`` > 0 runs in different layouts draw different masks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.parallel.param_init import InitRule, new_param
from hpctrain.parallel.slab import make_spec

ADAPTER_MARKS = (".lora_A.", ".lora_B.")


def is_adapter(name: str) -> bool:
    """Whether the global parameter ``name`` is a LoRA factor (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return any(mark in name for mark in ADAPTER_MARKS)


@dataclass(frozen=True)
class LoraSettings:
    """What the forward needs: ``scaling`` = alpha / rank and the input dropout probability."""

    scaling: float
    dropout: float


class LoraFactor(nn.Module):
    """One adapter matrix (PEFT's ``lora_A`` / ``lora_B`` module): ``weight``, this rank's slab."""

    def __init__(self, spec, dtype, rule: InitRule = InitRule("zeros")):
        super().__init__()
        self.weight = new_param(spec, dtype, rule)


def attach_lora(linear: nn.Module, name: str, in_features: int, out_features: int, tp_comm, *, column: bool,
                rank: int, alpha: float, dropout: float, dtype, seed: int) -> None:
    """Give ``linear`` (named ``name``, global W [out_features, in_features]; ``column``: a
    ColumnParallelLinear, else a RowParallelLinear) the adapters ``lora_A``, ``lora_B`` and its
    ``lora`` settings; its forward adds ``lora_delta``."""
    partial = tp_comm is not None and tp_comm.size > 1
    a_spec = make_spec(f"{name}.lora_A.weight", (rank, in_features), None if column else 1, tp_comm,
                       partial_grad_over_tp=partial and column)
    b_spec = make_spec(f"{name}.lora_B.weight", (out_features, rank), 0 if column else None, tp_comm,
                       partial_grad_over_tp=partial and not column)
    linear.lora_A = LoraFactor(a_spec, dtype, kaiming_uniform_rule(in_features, seed))
    linear.lora_B = LoraFactor(b_spec, dtype)  # zero
    linear.lora = LoraSettings(alpha / rank, dropout)  # type: ignore[assignment]  # Module.__setattr__'s stub takes only Tensor/Module


def kaiming_uniform_rule(fan_in: int, seed: int) -> InitRule:
    """PEFT's A: ``nn.init.kaiming_uniform_(A, a=sqrt(5))`` over ``fan_in`` inputs, as an ``InitRule``."""
    bound = nn.init.calculate_gain("leaky_relu", math.sqrt(5)) * math.sqrt(3.0 / fan_in)
    return InitRule("uniform", bound, seed)


def lora_delta(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's contribution to ``linear``'s output for input x [..., in(/tp)]: [..., out(/tp)]
    (row-parallel: a partial sum over tp, reduced with the base output). No communication."""
    settings, lora_a, lora_b = linear.lora, linear.lora_A, linear.lora_B  # set by attach_lora
    assert isinstance(settings, LoraSettings) and isinstance(lora_a, LoraFactor) and isinstance(lora_b, LoraFactor)
    if settings.dropout and linear.training:
        x = F.dropout(x, settings.dropout)
    return F.linear(F.linear(x, lora_a.weight), lora_b.weight) * settings.scaling


def freeze_all_but_adapters(module: nn.Module) -> None:
    """requires_grad=False on every parameter of ``module`` that is not a LoRA factor (the frozen base)."""
    for p in module.parameters():
        p.requires_grad_(is_adapter(p.spec.name))  # type: ignore[attr-defined]  # the SlabSpec hpctrain attaches (parallel/slab.py)
