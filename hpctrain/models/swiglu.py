"""SwiGLU's gating, ``silu(gate) * up``, keeping only its two inputs for the backward.

Autograd's own ``F.silu(gate) * up`` keeps ``gate`` (for silu), ``silu(gate)`` and ``up`` (for the product):
three ``[..., f]`` tensors per MLP, with the down projection's input (the product) a fourth. ``silu_mul``
keeps ``gate`` and ``up`` and recomputes ``silu(gate)`` in the backward (one element-wise pass), as Liger's
and Megatron's fused SwiGLU do, with autograd's kernels in autograd's order (the same gradients, bit for bit): a quarter of an MLP's activation memory (``f`` of ``4 f`` per token), the
largest single term of a Llama block's (plan/stages.py ``block_activation_bytes``). Local: no communication.
Traceable by torch.compile (an ``autograd.Function`` of plain tensor ops).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]  # autograd.Function: (ctx, *inputs)
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]  # autograd.Function: (ctx, *inputs)
        gate, up = ctx.saved_tensors  # autograd's own ops in its order: bitwise its gradients, in every dtype
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (same shapes [..., f]) saving only ``gate`` and ``up`` for the backward."""
    if not (gate.requires_grad or up.requires_grad) or not torch.is_grad_enabled():
        return F.silu(gate) * up
    return _SiluMul.apply(gate, up)
