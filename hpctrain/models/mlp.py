"""The transformer block's MLP (dense; also the shared experts of an MoE layer, hpctrain/models/moe.py)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from hpctrain.models.swiglu import silu_mul
from hpctrain.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from hpctrain.parallel.tp_comm import copy_to_tp, gather_seq


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (the gating keeps only gate(x) and up(x): swiglu.py), or GELU: down(gelu_tanh(up(x))); gate/up split on d_ff, down
    reduces over TP (the element-wise activation needs no communication)."""

    def __init__(self, name, m, tp_comm, sp, dtype, seed):
        super().__init__()
        kw = dict(dtype=dtype, seed=seed, std=m.init_std)
        self.sp, self.tp_comm, self.swiglu = sp, tp_comm, m.mlp == "swiglu"
        if self.swiglu:
            self.gate = ColumnParallelLinear(f"{name}.gate", m.d_model, m.d_ff, tp_comm, input_mode="none", **kw)
        self.up = ColumnParallelLinear(f"{name}.up", m.d_model, m.d_ff, tp_comm, input_mode="none", **kw)
        self.down = RowParallelLinear(f"{name}.down", m.d_ff, m.d_model, tp_comm, sp=sp, **kw)

    def forward(self, x):
        x = gather_seq(x, self.tp_comm) if self.sp else copy_to_tp(x, self.tp_comm)
        if self.swiglu:
            return self.down(silu_mul(self.gate(x), self.up(x)))
        return self.down(F.gelu(self.up(x), approximate="tanh"))
