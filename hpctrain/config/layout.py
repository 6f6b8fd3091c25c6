"""The parallel layout of a run: the sizes of dp x pp x cp x tp and how a global batch is cut.

``Layout.from_config(cfg, world_size)`` reads the sizes (``parallel.dp = 0`` is derived as
world / (tp * pp * cp)) and validates them with the rules of ``rules.py``; the process grid, the model,
the trainer and the planner all take their sizes and derived quantities from it, so a rule is
written once and tested without MPI (tests/unit/test_layout.py). Pure arithmetic: no mpi4py, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.config.rules import LayoutError  # noqa: F401 (re-exported)
from hpctrain.config.rules import (check_batch, check_context, check_cp_stripes, check_schedule, check_stages,
                                   check_tp_divisibility, resolve_microbatches, resolve_sizes)
from hpctrain.config.validation import resolve_model
from hpctrain.errors import HpcTrainError


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending: the sizes an axis of ``n`` ranks can be split into."""
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class Layout:
    """Sizes of the named axes and how a global batch is cut; ``validate`` checks every rule of ``rules.py``."""

    world_size: int
    dp_size: int
    pp_size: int
    tp_size: int
    microbatches: int = 1
    global_batch: int = 1
    seq_len: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    stage_layers: tuple[int, ...] = field(default_factory=tuple)
    virtual_stages: int = 1  # virtual stages per pp rank (interleaved schedule)
    cp_size: int = 1  # context parallelism: ranks sharing each sequence (zig-zag stripes, ring attention)
    ep_size: int = 1  # expert parallelism: ranks of the replica group sharing each MoE layer's experts

    @classmethod
    def problems_of(cls, cfg, world_size: int) -> list[HpcTrainError]:
        """Every broken layout rule of ``cfg`` on ``world_size`` ranks (``from_config`` raises the first)."""
        try:
            return cls.from_config(cfg, world_size, validated=False).problems(resolve_model(cfg.model))
        except HpcTrainError as exc:  # the sizes or the micro-batches: nothing else can be checked
            return [exc]

    @classmethod
    def from_config(cls, cfg, world_size: int, validated: bool = True) -> "Layout":
        """The validated layout of ``cfg`` on ``world_size`` ranks (raises on the first broken rule). The
        micro-batches come from ``train.micro_batch_size`` when it is > 0, else ``parallel.microbatches``
        (``rules.resolve_microbatches``)."""
        p, t = cfg.parallel, cfg.train
        sizes = resolve_sizes(world_size, dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp)
        microbatches = resolve_microbatches(t.global_batch, sizes["dp"], p.microbatches, t.micro_batch_size)
        layout = cls(world_size, sizes["dp"], sizes["pp"], sizes["tp"], microbatches, t.global_batch,
                     t.seq_len, p.sequence_parallel, p.zero, p.schedule, tuple(p.stage_layers), p.virtual_stages,
                     sizes["cp"], p.ep)
        if not validated:  # the sizes and micro-batches alone: ``problems_of`` lists the rest
            return layout
        try:
            layout.validate(resolve_model(cfg.model))
        except LayoutError as exc:
            if t.micro_batch_size and str(exc).startswith("parallel.microbatches="):
                raise LayoutError(f"{exc} (the micro-batches are global_batch / (dp x train.micro_batch_size) = "
                                  f"{t.global_batch} / ({sizes['dp']} x {t.micro_batch_size}))") from None
            raise
        return layout

    def validate(self, model=None) -> None:
        """Raise on the first broken rule; ``model`` (a resolved ModelConfig) adds the model rules."""
        found = self.problems(model)
        if found:
            raise found[0]

    def problems(self, model=None) -> list[HpcTrainError]:
        """Every broken rule, in ``validate``'s order (the sizes first: nothing else is checked when they do not
        factor the world); ``model`` (a resolved ModelConfig) adds the model rules."""
        try:
            resolve_sizes(self.world_size, self.dp_size, self.pp_size, self.tp_size, self.cp_size)
        except HpcTrainError as exc:
            return [exc]
        checks = [lambda: check_cp_stripes(self.seq_len, self.cp_size)]
        if model is not None:
            checks = [lambda: check_tp_divisibility(model, self.tp_size),
                      lambda: check_schedule(model, self.schedule, self.pp_size, self.virtual_stages, self.microbatches),
                      lambda: check_stages(model, self.pp_size, list(self.stage_layers), self.virtual_stages),
                      lambda: check_context(model, self.seq_len, self.cp_size, self.tp_size)]
        checks += [lambda: check_batch(self.global_batch, self.microbatches, self.seq_len, self.dp_size, self.tp_size,
                                       self.sequence_parallel, self.cp_size),
                   self._check_experts]
        found = []
        for check in checks:
            try:
                check()
            except HpcTrainError as exc:
                found.append(exc)
        return found

    def _check_experts(self) -> None:
        if self.replica_size % self.ep_size:
            raise LayoutError(f"parallel.ep={self.ep_size} does not divide the replica group dp x cp = "
                              f"{self.dp_size} x {self.cp_size} = {self.replica_size}: expert-parallel ranks are "
                              f"carved out of it")

    @property
    def sizes(self) -> dict[str, int]:
        """{"dp", "pp", "cp", "tp"}: the grid's axes, outermost to innermost."""
        return {"dp": self.dp_size, "pp": self.pp_size, "cp": self.cp_size, "tp": self.tp_size}

    @property
    def local_batch(self) -> int:
        """Sequences per dp replica per step."""
        return self.global_batch // self.dp_size

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch (per forward on each replica: ``train.micro_batch_size`` when given)."""
        return self.local_batch // self.microbatches

    @property
    def replica_size(self) -> int:
        """Ranks holding the same parameters: dp x cp (gradients are summed and ZeRO-1 shards over them)."""
        return self.dp_size * self.cp_size

    @property
    def seq_chunk(self) -> int:
        """The local sequence: tokens per rank along the sequence between tensor-parallel layers, seq_len / cp
        (/ tp with SP). (Named ``seq_chunk`` as the ``hpctrain plan --json`` field it fills.)"""
        local = self.seq_len // self.cp_size
        return local // self.tp_size if self.sequence_parallel else local
