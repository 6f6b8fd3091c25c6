"""Two gradient groups behind one interface: with expert parallelism (``parallel.ep`` > 1) the experts of the
MoE layers are summed over the ranks that hold the same experts (``grid.comm("ep_replica")``, dp x cp / ep
ranks) and everything else over the whole replica group (dp x cp). Each group is its own ``FlatParams`` and
``FlatOptimizer``; ``FlatGroup`` and ``OptimizerGroup`` present them to the trainer, the pipeline and the
checkpoint as one (the calls they use), dense first.

The global gradient norm counts every element once over the world: each group counts its owned part of its
buckets (``FlatOptimizer.grad_norm_sq_tensor``), and the experts of different ep ranks are different elements.
"""
from __future__ import annotations

import torch

from hpctrain.parallel.buckets import all_gathered


class FlatGroup:
    """``FlatParams``-like view of several ``FlatParams`` (``parts``, dense first): the step's calls go to each."""

    def __init__(self, parts: list):
        self.parts = parts
        dense = parts[0]
        self.reducer, self.param_buffer, self.zero, self.zero_stage = dense.reducer, dense.param_buffer, dense.zero, \
            dense.zero_stage
        self.params = [p for f in parts for p in f.params]
        self.bucket_of = {k: v for f in parts for k, v in f.bucket_of.items()}
        self.param_dtype, self.device, self.timer = dense.param_dtype, dense.device, dense.timer

    @property
    def last_microbatch(self) -> bool:
        return self.parts[0].last_microbatch

    @last_microbatch.setter
    def last_microbatch(self, value: bool) -> None:
        for f in self.parts:
            f.last_microbatch = value

    def start_step(self) -> None:
        for f in self.parts:
            f.start_step()

    def progress(self) -> None:
        for f in self.parts:
            f.progress()

    def finish_reduction(self) -> None:
        for f in self.parts:
            f.finish_reduction()

    def gather_params(self) -> None:
        for f in self.parts:
            f.gather_params()

    def gathered(self):
        return all_gathered(self.parts)

    def memory_bytes(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for f in self.parts:
            for k, v in f.memory_bytes().items():
                totals[k] = totals.get(k, 0) + v
        return totals

    def writes(self, p, first_replica: bool) -> bool:
        """Whether this rank writes ``p``'s pieces it owns: every owner with ZeRO, else the first replica of
        ``p``'s group (``first_replica``: of the whole replica group; an expert's: its ep_replica rank 0)."""
        flat = next(f for f in self.parts if id(p) in f.bucket_of)
        if flat.zero:
            return True
        return first_replica if flat is self.parts[0] else flat.dp_rank == 0


class OptimizerGroup:
    """``FlatOptimizer``-like view of one optimizer per ``FlatGroup`` part (same order)."""

    def __init__(self, parts: list):
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
