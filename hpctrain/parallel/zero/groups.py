"""The trainable parameters' gradient groups behind one interface: the dense parameters are summed over the
whole replica group (dp x cp); with expert parallelism (``parallel.ep`` > 1) the experts of the MoE layers
are a second group, summed over the ranks that hold the same experts (``grid.comm("ep_replica")``, dp x cp /
ep ranks). Each group is its own ``FlatParams``; ``FlatGroup`` presents one or both to the trainer, the
pipeline and the checkpoint as one (the calls they use), dense first. The optimizer's side is
``hpctrain.optim.group.OptimizerGroup``.
"""
from __future__ import annotations

from hpctrain.parallel.buckets import all_gathered


class FlatGroup:
    """``FlatParams``-like view of one or several ``FlatParams`` (``parts``, dense first): the step's calls go
    to each; ``buckets``: every part's, in order (their indices are consecutive)."""

    def __init__(self, parts: list):
        self.parts = parts
        dense = parts[0]
        self.buckets = [b for f in parts for b in f.buckets]
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

    def state_tensors(self) -> list:
        return [t for f in self.parts for t in f.state_tensors()]

    def writes(self, p, first_replica: bool) -> bool:
        """Whether this rank writes ``p``'s pieces it owns: every owner with ZeRO, else the first replica of
        ``p``'s group (``first_replica``: of the whole replica group; an expert's: its ep_replica rank 0)."""
        flat = next(f for f in self.parts if id(p) in f.bucket_of)
        if flat.zero:
            return True
        return first_replica if flat is self.parts[0] else flat.dp_rank == 0
