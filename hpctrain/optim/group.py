"""The optimizers of a ``FlatGroup``'s parts behind one interface (``OptimizerGroup``), built in one place
(``build_optimizer``): the dense parameters' ``FlatOptimizer``, and with expert parallelism the experts'.

The global gradient norm counts every element once over the world: each part counts its owned part of its
buckets (``FlatOptimizer.grad_norm_sq_tensor``), and the experts of different ep ranks are different elements.
"""
from __future__ import annotations

import torch

from hpctrain.optim.flat import FlatOptimizer


def build_optimizer(flat, cfg, tp_rank: int, one_pass: bool) -> OptimizerGroup:
    """A ``FlatOptimizer`` per part of ``flat`` (a ``FlatGroup``; ``cfg``: the whole config), over its owned
    slices. 1-bit Adam's binding is made here and only here, on the dense part (even where no reducer
    compresses, one replica): AdamW's variance frozen after ``compression.warmup_steps``, the momentum taken
    from the reducer that averages it."""
    comp, dense = cfg.compression, flat.parts[0]
    optimizers = [FlatOptimizer(dense, cfg.optim, tp_rank=tp_rank,
                                freeze_variance_after=comp.warmup_steps if comp.method == "onebit-adam" else None,
                                momentum_from_reducer=dense.reducer.shares_momentum, one_pass=one_pass)]
    dense.reducer.bind_optimizer(optimizers[0])
    optimizers += [FlatOptimizer(part, cfg.optim, tp_rank=tp_rank, one_pass=one_pass) for part in flat.parts[1:]]
    return OptimizerGroup(optimizers)


class OptimizerGroup:
    """``FlatOptimizer``-like view of one optimizer per ``FlatGroup`` part (same order)."""

    def __init__(self, parts: list[FlatOptimizer]):
        self.parts = parts
        dense = parts[0]
        self.cfg, self.master_dtype, self.state_kinds = dense.cfg, dense.master_dtype, dense.state_kinds
        self.update_kind = dense.update_kind
        self.outcome_before_update = any(o.outcome_before_update for o in parts)
        self.owned_slices = [s for o in parts for s in o.owned_slices]

    @property
    def step_count(self) -> int:
        return self.parts[0].step_count

    @step_count.setter
    def step_count(self, count: int) -> None:
        for o in self.parts:
            o.step_count = count

    def grad_norm_sq_tensor(self) -> torch.Tensor:
        return sum((o.grad_norm_sq_tensor() for o in self.parts[1:]), self.parts[0].grad_norm_sq_tensor())

    def step(self, lr: float, grad_coef=1.0, found_inf=None) -> None:
        for o in self.parts:
            o.step(lr, grad_coef, found_inf)

    def state_bytes(self) -> int:
        return sum(o.state_bytes() for o in self.parts)

    def owned_pieces(self):
        for o in self.parts:
            yield from o.owned_pieces()
