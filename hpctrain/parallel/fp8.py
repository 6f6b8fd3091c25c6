"""Float8 matmuls of the tensor-parallel linears through torchao (``train.fp8``, issue #54).

A linear ``y = x W^T`` (x [T, in], W [out, in]; this tp rank's slab of each) runs as torchao's
``Float8Linear`` does (``torchao.float8.float8_linear.matmul_with_hp_or_float8_args``): three GEMMs, each
operand cast to float8 with a dynamic scale (``amax_to_scale``, ``hp_tensor_and_scale_to_float8``) and
multiplied as a ``Float8TrainingTensor`` (``torch._scaled_mm`` on an sm89+ GPU; with ``emulate``:
dequantised and multiplied in float32, torchao's emulation):

    GEMM          operands (recipe tensorwise: one scale each; rowwise: amax along the axis shown)
    output        x [T, in] (along in)          W^T [in, out] (along in)
    grad_input    dy [T, out] (along out)       W^T [in, out] (along out)
    grad_weight   dy [T, out] (along T)         x [T, in] (along T)

The one thing added to torchao: a scale is computed over the WHOLE logical tensor. Where this rank holds
a slab of it along the axis its amax runs over (any axis, tensorwise), the local amax is max-reduced
over the tp group (``amax_comm``, an hpctrain ``Communicator``; torchao would use torch.distributed):

    linear           split over tp                     amax reduced over tp for
    column-parallel  W^T and dy on out                 W^T, dy (tensorwise); W^T for grad_input, dy for
                                                       grad_input (rowwise)
    row-parallel     x and W^T on in                   x, W^T (tensorwise); x and W^T for the output (rowwise)

so a tp layout computes what one process computes. With context parallelism an activation's tokens are
split over cp: its amax over tokens (tensorwise; rowwise: the grad_weight casts) is max-reduced over cp too
(``token_comm``). Activations (x, dy) are scaled per micro-batch on their own replica, never over dp (as
torchao and torchtitan). Nothing here is state: no scale is kept between steps (dynamic scaling), so a
checkpoint holds no float8 tensor.

torchao is imported only by ``load_recipe`` (the ``fp8`` extra): ``import hpctrain`` works without it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any

import torch

RECIPES = ("tensorwise", "rowwise")
TORCHAO_VERSION = "0.18.0"  # what setup.py's ``fp8`` extra pins and the tests ran
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: torch._scaled_mm
ALIGNMENT = 16  # torch._scaled_mm wants every GEMM dimension but the tokens a multiple of 16


def torchao_problem() -> str | None:
    """Why torchao cannot serve ``train.fp8`` here (missing, or not the pinned version), or None."""
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return f"needs torchao=={TORCHAO_VERSION}, which is not installed: pip install 'hpctrain[fp8]'"
    if version.split("+")[0] != TORCHAO_VERSION:
        return (f"needs torchao=={TORCHAO_VERSION} (the fp8 extra), found torchao {version}: "
                f"pip install 'hpctrain[fp8]'")
    return None


def _import_float8():
    """torchao.float8, imported with torchao's start-up chatter (its optional CUDA kernels, a pytree
    deprecation) kept out of the run's output."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8  # noqa: F401
        import torchao.float8.float8_training_tensor as tensor
        import torchao.float8.float8_utils as utils
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return float8, tensor, utils


@dataclass(frozen=True)
class Fp8Recipe:
    """``train.fp8``'s recipe as torchao configures it: ``config`` (a ``Float8LinearConfig``), ``mm`` (its
    ``LinearMMConfig``, as ``Float8Linear`` builds it) and the torchao modules the casts use."""

    name: str
    emulate: bool
    config: Any
    mm: Any
    tensor: Any  # torchao.float8.float8_training_tensor
    utils: Any  # torchao.float8.float8_utils


def load_recipe(name: str, emulate: bool) -> Fp8Recipe:
    """torchao's ``Float8LinearConfig.from_recipe_name(name)`` (``name`` in RECIPES) with ``emulate``."""
    float8, tensor, utils = _import_float8()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(name), emulate=emulate)
    mm = tensor.LinearMMConfig(*(tensor.ScaledMMConfig(emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                                 for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                              config.gemm_config_grad_weight)))
    return Fp8Recipe(name, emulate, config, mm, tensor, utils)


class Fp8Stats:
    """What this rank's casts saw since the last ``collect``, kept on the device (no host read per cast):
    the largest amax, the smallest and largest scale (of nonzero amaxes) and the casts whose tensor held an
    inf or NaN (``overflows``: float8 saturates or carries the NaN)."""

    def __init__(self, device=None):
        self.device = device
        self._values = torch.zeros(4, dtype=torch.float64, device=device)  # amax, -min scale, max scale, overflows
        self.clear()

    def clear(self) -> None:
        self._values.copy_(torch.tensor([0.0, -float("inf"), 0.0, 0.0], dtype=torch.float64))

    def record(self, amax: torch.Tensor, scale: torch.Tensor) -> None:
        """One cast's amax and scale (same shape: a scalar, or one per row; none for a tensor without rows)."""
        if amax.numel() == 0:
            return
        amax, scale = amax.detach().double(), scale.detach().double()
        if amax.device != self._values.device:
            self._values = self._values.to(amax.device)
        finite = torch.isfinite(amax)
        used = finite & (amax > 0)
        top = torch.where(finite, amax, 0).amax()
        low = torch.where(used, scale, float("inf")).amin()
        high = torch.where(used, scale, 0).amax()
        seen = torch.stack([top, -low, high, (~finite).any().double()])
        self._values[:3] = torch.maximum(self._values[:3], seen[:3])
        self._values[3] += seen[3]

    def collect(self, world) -> dict:
        """Collective over ``world`` (two all-reduces of a few numbers): the interval's ``fp8_amax_max``,
        ``fp8_scale_min``, ``fp8_scale_max`` and ``fp8_overflows`` over every rank; clears the counts."""
        values = self._values.detach().cpu().clone()
        peaks, overflows = values[:3].contiguous(), values[3:].contiguous()
        world.allreduce(peaks, op="max")
        world.allreduce(overflows)
        self.clear()
        low = -float(peaks[1])
        return {"fp8_amax_max": float(peaks[0]), "fp8_scale_min": low if low != float("inf") else None,
                "fp8_scale_max": float(peaks[2]) or None, "fp8_overflows": int(overflows[0])}


@dataclass(frozen=True)
class Fp8Linear:
    """One linear's float8 settings: the recipe, the group its amaxes are max-reduced on (``amax_comm``: the
    tp group; None or size 1: none) and which dimension of W [out, in] is split over it (0: column-parallel,
    1: row-parallel, None: whole). ``stats``: where its casts are counted. ``token_comm``: the group the
    tokens of an activation (x, dy) are split over (context parallelism), whose amaxes over tokens are
    max-reduced there too."""

    recipe: Fp8Recipe
    amax_comm: Any
    split: int | None
    stats: Fp8Stats | None = None
    token_comm: Any = None  # the cp group: activations hold this cp rank's tokens (None or size 1: all of them)


@dataclass(frozen=True)
class _Cast:
    """One operand to cast: t [rows, cols] (high precision), its torchao ``CastConfig`` and GEMM role, the axis
    a rowwise amax runs along, the dimension of t split over ``amax_comm`` (None: whole), and a ``scale``
    already known (the same tensorwise cast in another GEMM of the step: torchao recomputes the same value)."""

    t: torch.Tensor
    config: Any
    role: Any
    axis: int
    split: int | None
    scale: torch.Tensor | None = None
    tokens: bool = False  # an activation: dim 0 is this rank's tokens, split over ``token_comm``


def _casts(f: Fp8Linear, wanted: list[_Cast], count: bool = True) -> list[tuple[Any, torch.Tensor]]:
    """Each operand -> (a torchao ``Float8TrainingTensor``, its scale), scaled by its amax (along ``axis``
    with rowwise, else of the whole tensor). The amaxes of operands held as a slab along the axis they run
    over (any axis, tensorwise) are max-reduced over ``f.amax_comm``: one all-reduce for them all; an
    activation's over its tokens over ``f.token_comm`` likewise. ``count``: add them to ``f.stats``."""
    recipe = f.recipe
    amaxes: list[torch.Tensor | None] = []
    over_tp, over_tokens = [], []
    for i, c in enumerate(wanted):
        if c.scale is not None:
            amaxes.append(None)
            continue
        rowwise = c.config.scaling_granularity.value == "axiswise"
        if c.t.numel() == 0:  # no tokens here (an expert's rows on this cp rank): amax 0, max-reduced with the others'
            shape = [] if not rowwise else [1 if d == c.axis % c.t.dim() else n for d, n in enumerate(c.t.shape)]
            amaxes.append(torch.zeros(shape, dtype=c.t.dtype, device=c.t.device))
        else:
            amaxes.append(recipe.utils.tensor_to_amax(c.t, scaling_granularity=c.config.scaling_granularity,
                                                      axiswise_dim=c.axis if rowwise else None))
        if c.split is not None and (not rowwise or c.axis % c.t.dim() == c.split):
            over_tp.append(i)
        if c.tokens and (not rowwise or c.axis % c.t.dim() == 0):
            over_tokens.append(i)
    _max_over(amaxes, over_tp, f.amax_comm)
    _max_over(amaxes, over_tokens, f.token_comm)
    out = []
    for c, amax in zip(wanted, amaxes):
        scale = c.scale
        if scale is None:
            assert amax is not None
            scale = recipe.utils.amax_to_scale(amax, c.config.target_dtype,
                                               round_scales_to_power_of_2=recipe.config.round_scales_to_power_of_2)
            if f.stats is not None and count:
                f.stats.record(amax, scale)
        rowwise = c.config.scaling_granularity.value == "axiswise"
        out.append((recipe.tensor.hp_tensor_and_scale_to_float8(c.t, scale, c.config.target_dtype, recipe.mm, c.role,
                                                                c.axis if rowwise else None), scale))
    return out


def _max_over(amaxes: list, which: list[int], comm) -> None:
    """Max-reduce ``amaxes[i]`` for i in ``which`` over ``comm`` in place of them (talks on it: one all-reduce
    of them all, in float32, or float64 for a float64 amax: exact for every amax); nothing without a group."""
    if not which or comm is None or comm.size == 1:
        return
    parts = [amaxes[i] for i in which]
    wide = torch.float64 if any(a.dtype == torch.float64 for a in parts) else torch.float32
    flat = torch.cat([a.to(wide).reshape(-1) for a in parts])
    comm.allreduce(flat, op="max")
    for i, piece in zip(which, flat.split([a.numel() for a in parts])):
        amaxes[i] = piece.view(amaxes[i].shape)


def _same_tensorwise(a, b) -> bool:
    """Two casts of one tensor give the same scale: the same tensorwise CastConfig."""
    return a == b and a.scaling_granularity.value == "tensorwise"


class _Float8Matmul(torch.autograd.Function):
    """x [T, in] @ W^T -> [T, out] with float8 operands (module docstring), gradients likewise."""

    @staticmethod
    def forward(ctx, x, weight, f: Fp8Linear, training: bool):
        c, role = f.recipe.config, f.recipe.tensor.GemmInputRole
        ctx.save_for_backward(x, weight)
        ctx.f = f
        w_split = None if f.split is None else 1 - f.split  # of W^T [in, out]
        x_split = 1 if f.split == 1 else None  # row-parallel: x holds in/tp columns
        recomputed = torch._C._current_graph_task_id() != -1  # activation recomputation, inside backward
        (xq, ctx.x_scale), (wq, ctx.w_scale) = _casts(f, [_Cast(x, c.cast_config_input, role.INPUT, -1, x_split,
                                                                tokens=True),
                                                          _Cast(weight.t(), c.cast_config_weight, role.WEIGHT, 0,
                                                                w_split)], count=training and not recomputed)
        return torch.mm(xq, wq)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        f: Fp8Linear = ctx.f
        c, role = f.recipe.config, f.recipe.tensor.GemmInputRole
        w_split = None if f.split is None else 1 - f.split
        g_split = 1 if f.split == 0 else None  # column-parallel: dy holds out/tp columns
        x_split = 1 if f.split == 1 else None
        grad_out = grad_out.contiguous()
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        one_dy = want_x and want_w and _same_tensorwise(c.cast_config_grad_output,
                                                        c.cast_config_grad_output_for_grad_weight)
        wanted = []
        if want_x:
            reuse = ctx.w_scale if _same_tensorwise(c.cast_config_weight, c.cast_config_weight_for_grad_input) else None
            wanted += [_Cast(grad_out, c.cast_config_grad_output, role.GRAD_OUTPUT, -1, g_split, tokens=True),
                       _Cast(weight.t(), c.cast_config_weight_for_grad_input, role.WEIGHT, -1, w_split, reuse)]
        if want_w:
            reuse = ctx.x_scale if _same_tensorwise(c.cast_config_input, c.cast_config_input_for_grad_weight) else None
            if not one_dy:
                wanted.append(_Cast(grad_out, c.cast_config_grad_output_for_grad_weight, role.GRAD_OUTPUT, 0, g_split,
                                    tokens=True))
            wanted.append(_Cast(x, c.cast_config_input_for_grad_weight, role.INPUT, 0, x_split, reuse, tokens=True))
        cast = [q for q, _ in _casts(f, wanted)]
        grad_x = grad_w = None
        if want_x:
            gq, wq = cast[0], cast[1]
            grad_x = torch.mm(gq, wq.t())
        if want_w:
            gq = cast[0] if one_dy else cast[-2]
            grad_w = torch.mm(gq.t(), cast[-1])
        return grad_x, grad_w, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, f: Fp8Linear) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out] in x's dtype, every GEMM in float8 (module docstring).
    Talks on ``f.amax_comm`` (the tp group) where an operand is split over it, and on ``f.token_comm`` (cp)
    for the activations' amaxes over tokens: at most one all-reduce of amaxes on each, forward and backward.
    No tokens (an expert none were routed to, on every tp rank alike) and no cp peers: F.linear."""
    if x.numel() == 0 and (f.token_comm is None or f.token_comm.size == 1):
        return torch.nn.functional.linear(x, weight)
    if torch.compiler.is_compiling():  # mpi4py all-reduces cannot be traced: a graph break by design
        return torch.compiler.disable(_apply, reason="float8 linear (amax over tp, mpi4py)")(x, weight, f)
    return _apply(x, weight, f)


def _apply(x: torch.Tensor, weight: torch.Tensor, f: Fp8Linear) -> torch.Tensor:
    # counted in the stats: a training forward (not an evaluation's, under no_grad)
    y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, f, torch.is_grad_enabled())
    return y.reshape(*x.shape[:-1], y.shape[-1])


def unaligned(out_features: int, in_features: int) -> bool:
    """Whether torch._scaled_mm cannot take a W [out, in] (a dimension not a multiple of ALIGNMENT)."""
    return out_features % ALIGNMENT != 0 or in_features % ALIGNMENT != 0
