"""The parallel layout of a run: one place for every rule about dp x pp x tp, micro-batches and stages.

``Layout.from_config(cfg, world_size)`` reads the sizes (``parallel.dp = 0`` is derived as
world / (tp * pp)) and validates them; the process grid, the model, the trainer and the planner all
take their sizes and derived quantities from it, so a rule is written once and tested without MPI
(tests/unit/test_layout.py). Pure arithmetic: no mpi4py, no torch.

Rules, in the order checked (each raises the message users see; ``GridError`` for the factorisation
of the world, ``HpcTrainError`` for the rest):
  sizes: tp, pp >= 1; dp >= 0; dp * pp * tp == world (dp = 0 derives it; world divisible by tp * pp)
  model: n_heads, n_kv_heads, d_ff, vocab_size divisible by tp; pp <= n_layers;
         stage_layers (if given) has pp entries >= 1 summing to n_layers
  batch: global_batch divisible by dp; the replica batch divisible by micro-batches;
         with sequence parallelism, seq_len divisible by tp
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.errors import GridError, HpcTrainError


class LayoutError(HpcTrainError):
    """The model, batch or stage split does not fit the layout (the same on every rank)."""

    everywhere = True


def resolve_sizes(world_size: int, dp: int = 0, pp: int = 1, tp: int = 1) -> dict[str, int]:
    """Validate the requested factorisation; ``dp=0`` means world_size / (pp*tp). Raises GridError."""
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise GridError(f"parallel.{name} must be a positive integer, got {value!r}")
    if not isinstance(dp, int) or dp < 0:
        raise GridError(f"parallel.dp must be a positive integer (or 0 for world/(tp*pp)), got {dp!r}")
    if dp == 0:
        if world_size % (tp * pp):
            raise GridError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                            f"launch a multiple of {tp * pp} ranks or change tp/pp")
        dp = world_size // (tp * pp)
    if dp * pp * tp != world_size:
        raise GridError(f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} but the job has {world_size} ranks; "
                        f"launch {dp * pp * tp} ranks or set parallel.dp=0 to derive dp")
    return {"dp": dp, "pp": pp, "tp": tp}


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending: the sizes an axis of ``n`` ranks can be split into."""
    return [k for k in range(1, n + 1) if n % k == 0]


def check_tp_divisibility(m, tp_size: int) -> None:
    """Raise a clear error when the model ``m`` (a resolved ModelConfig) cannot be split over tp."""
    for what, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                        ("model.d_ff", m.d_ff), ("model.vocab_size", m.vocab_size)):
        if value % tp_size:
            raise LayoutError(f"{what}={value} is not divisible by parallel.tp={tp_size}: attention heads, "
                                f"KV heads, the MLP and the vocabulary are split over tp; choose tp dividing it")


def check_stages(m, pp_size: int, stage_layers: list[int]) -> None:
    """Every pipeline stage needs at least one layer; explicit stage sizes must add up."""
    if stage_layers:
        if len(stage_layers) != pp_size or sum(stage_layers) != m.n_layers or min(stage_layers) < 1:
            raise LayoutError(f"parallel.stage_layers={stage_layers} must have pp={pp_size} entries >= 1 "
                                f"summing to model.n_layers={m.n_layers}")
    elif m.n_layers < pp_size:
        raise LayoutError(f"model.n_layers={m.n_layers} < parallel.pp={pp_size}: every stage needs a layer")


def check_batch(global_batch: int, microbatches: int, seq_len: int, dp_size: int, tp_size: int,
                sequence_parallel: bool) -> None:
    """The global batch splits over dp replicas, then into micro-batches; SP splits the sequence over tp."""
    if global_batch % dp_size:
        raise LayoutError(f"train.global_batch={global_batch} is not divisible by dp={dp_size}")
    if (global_batch // dp_size) % microbatches:
        raise LayoutError(f"the per-replica batch {global_batch // dp_size} (train.global_batch/dp) is not "
                            f"divisible by parallel.microbatches={microbatches}")
    if sequence_parallel and seq_len % tp_size:
        raise LayoutError(f"sequence parallelism needs train.seq_len={seq_len} divisible by tp={tp_size}")


@dataclass(frozen=True)
class Layout:
    """Sizes of the named axes and how a global batch is cut; ``validate`` checks every rule above."""

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

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "Layout":
        """The validated layout of ``cfg`` on ``world_size`` ranks (raises on the first broken rule)."""
        from hpctrain.config import resolve_model

        p, t = cfg.parallel, cfg.train
        sizes = resolve_sizes(world_size, dp=p.dp, pp=p.pp, tp=p.tp)
        layout = cls(world_size, sizes["dp"], sizes["pp"], sizes["tp"], p.microbatches, t.global_batch,
                     t.seq_len, p.sequence_parallel, p.zero, p.schedule, tuple(p.stage_layers))
        layout.validate(resolve_model(cfg.model))
        return layout

    def validate(self, model=None) -> None:
        """Raise on the first broken rule; ``model`` (a resolved ModelConfig) adds the model rules."""
        resolve_sizes(self.world_size, self.dp_size, self.pp_size, self.tp_size)
        if model is not None:
            check_tp_divisibility(model, self.tp_size)
            check_stages(model, self.pp_size, list(self.stage_layers))
        check_batch(self.global_batch, self.microbatches, self.seq_len, self.dp_size, self.tp_size,
                    self.sequence_parallel)

    @property
    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp_size, "pp": self.pp_size, "tp": self.tp_size}

    @property
    def local_batch(self) -> int:
        """Sequences per dp replica per step."""
        return self.global_batch // self.dp_size

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch."""
        return self.local_batch // self.microbatches

    @property
    def seq_shard(self) -> int:
        """Tokens per rank along the sequence between tensor-parallel layers (seq_len / tp with SP)."""
        return self.seq_len // self.tp_size if self.sequence_parallel else self.seq_len
