"""SwiGLU's gating, ``silu(gate) * up``, keeping only its two inputs for the backward.

Autograd's own ``F.silu(gate) * up`` keeps ``gate`` (for silu), ``silu(gate)`` and ``up`` (for the product):
three ``[..., f]`` tensors per MLP, with the down projection's input (the product) a fourth. ``silu_mul``
keeps ``gate`` and ``up`` and recomputes ``silu(gate)`` in the backward (one element-wise pass), as Liger's
and Megatron's fused SwiGLU do: a quarter of an MLP's activation memory (``f`` of ``4 f`` per token), the
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
        gate, up = ctx.saved_tensors
        dtype = gate.dtype
        if dtype in (torch.float16, torch.bfloat16):  # in float32, as autograd's silu_backward computes
            gate, up, grad = gate.float(), up.float(), grad.float()
        sig = torch.sigmoid(gate)
        grad_gate = (grad * up * (sig * (1 + gate * (1 - sig)))).to(dtype) if ctx.needs_input_grad[0] else None
        grad_up = (grad * (gate * sig)).to(dtype) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (same shapes [..., f]) saving only ``gate`` and ``up`` for the backward."""
    if not (gate.requires_grad or up.requires_grad) or not torch.is_grad_enabled():
        return F.silu(gate) * up
    return _SiluMul.apply(gate, up)
