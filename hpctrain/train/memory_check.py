"""Refusing, before anything is allocated, a model that cannot fit: a lower bound of each rank's bytes
against the memory it may still take (``runtime/peak_memory.available_memory``), agreed by every rank.

Per rank (``config/arithmetic.rank_parameters``: its virtual stages, the PADDED vocabulary / tp):
parameters x dtype bytes; unless LoRA freezes them, float32 main gradients (float64 in float64) and
AdamW's two moments (+ float32 master weights in 16-bit training; ZeRO-1 divides them by dp x cp, ZeRO-2
the gradients too, ZeRO-3 the parameters too, plus its gathered units: the running one and
``parallel.zero_prefetch`` more, or every one without resharding), as plan/memory.py counts them; and one micro-batch of the input of every block on the rank (the least any
schedule keeps: full recomputation). SGD's state, more micro-batches, logits, torch and the corpus come on
top, so a refusal is certain and passing is no promise. On the host the ranks of a node share its memory
(their sum against the node's available memory); on CUDA each rank has its device's free memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.checkpoint.directory import human_size
from hpctrain.config import ConfigError, resolve_model
from hpctrain.config.arithmetic import held_stages, partition_layers, rank_parameters
from hpctrain.config.moe_keys import resolve_moe
from hpctrain.config.rules import padded_vocab

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass
class Need:
    """A lower bound of one rank's bytes, by part, and what dominates it (keys named, for the message)."""

    parameters: int
    parts: dict[str, int]  # "parameters", "gradients", "optimizer", "activations"
    largest: str  # the configuration keys behind the largest share, with their values

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def rank_need(cfg, layout, pp_rank: int) -> Need:
    """The lower bound for one rank of pipeline rank ``pp_rank`` of ``layout`` (a validated Layout)."""
    m, t = resolve_model(cfg.model), cfg.train
    moe = resolve_moe(cfg.moe, m)
    tp, nb = layout.tp_size, DTYPE_BYTES[t.dtype]
    v_shape = layout.schedule == "zb-v"
    counts = rank_parameters(m, tp, layout.pp_size, pp_rank, layout.stage_layers, layout.virtual_stages,
                             moe=moe, ep=layout.ep_size, v_shape=v_shape)
    n = sum(counts.values())
    experts = counts.get("experts", 0)  # this rank's experts (num_experts / ep of each MoE block)
    trainable = 0 if cfg.lora.rank else n - experts  # LoRA: the adapters alone (left out: a lower bound)
    trainable_experts = 0 if cfg.lora.rank else experts
    state = 2 * max(4, nb) + (4 if nb == 2 else 0) if cfg.optim.name == "adamw" else 0
    ranges = partition_layers(m, layout.pp_size * layout.virtual_stages, list(layout.stage_layers) or None, moe=moe)
    layers = sum(ranges[v][1] - ranges[v][0] for v in held_stages(layout.pp_size, pp_rank, layout.virtual_stages,
                                                                   v_shape))
    tokens = layout.micro_batch * (layout.seq_len // layout.cp_size)
    activations = layers * tokens * m.d_model * nb // (tp if layout.sequence_parallel else 1)
    replicas, zero = layout.replica_size, layout.zero
    holders = replicas // layout.ep_size  # the replicas holding the same experts (ZeRO shards experts over them)
    # the largest unit ZeRO-3 gathers: a block, or the embedding (the LM head) with the learned positions
    unit = max(counts["blocks"] // max(layers, 1), counts["vocabulary"] + counts["positions"])
    gathered = 0
    if zero == 3:  # the gathered units: the running one and the prefetched ones, or all (no resharding)
        p = cfg.parallel
        gathered = n * nb if not p.zero_reshard_after_forward else min(n, (1 + p.zero_prefetch) * unit) * nb
    parts = {"parameters": (n - experts) * nb // (replicas if zero == 3 else 1) + experts * nb,
             "gradients": trainable * max(4, nb) // (replicas if zero >= 2 else 1)
             + trainable_experts * max(4, nb) // (holders if zero >= 2 else 1),
             "optimizer": trainable * state // (replicas if zero else 1)
             + trainable_experts * state // (holders if zero else 1),
             "gathered units": gathered, "activations": activations}
    per_param = (parts["parameters"] + parts["gradients"] + parts["optimizer"]) / max(n, 1)
    shares = {part: count * per_param for part, count in counts.items()}
    shares["activations"] = activations
    if gathered:  # its keys are named when it is the largest share
        shares["gathered"] = gathered
    return Need(n, parts, _keys(max(shares, key=shares.__getitem__), m, layout, layers, moe))


def _keys(part: str, m, layout, layers: int, moe=None) -> str:
    if part == "experts" and moe is not None:
        return (f"the experts: moe.num_experts={moe.num_experts} / parallel.ep={layout.ep_size} per rank in each of "
                f"its MoE blocks (moe.layers) x 3 x model.d_model={m.d_model} x moe.d_ff_expert={moe.d_ff_expert}")
    if part == "vocabulary":
        return (f"the embedding and LM head: model.vocab_size={m.vocab_size} padded to {padded_vocab(m, layout.tp_size)} "
                f"rows (a multiple of model.vocab_multiple={m.vocab_multiple} x parallel.tp={layout.tp_size}) x "
                f"model.d_model={m.d_model}")
    if part == "positions":
        return f"the learned positions: model.max_seq_len={m.max_seq_len} x model.d_model={m.d_model}"
    if part == "gathered":
        return ("ZeRO-3's gathered units: parallel.zero_prefetch and parallel.zero_reshard_after_forward "
                "(each prefetched unit is one block's parameters more)")
    if part == "activations":
        return (f"one micro-batch's activations: {layout.micro_batch} sequences (train.global_batch / "
                f"train.micro_batch_size) x train.seq_len={layout.seq_len} x model.d_model={m.d_model} x {layers} "
                f"blocks")
    return (f"the blocks: {layers} of model.n_layers={m.n_layers} x (model.d_model={m.d_model}, "
            f"model.d_ff={m.d_ff})")


def available_memory(device):
    """``runtime/peak_memory.available_memory``, imported when called: it needs torch, and ``hpctrain check``
    uses ``rank_need`` alone."""
    from hpctrain.runtime.peak_memory import available_memory as available

    return available(device)


def check_memory(cfg, grid, device) -> None:
    """Collective over ``grid.world``: raise ConfigError on every rank when some rank's (on the host: some
    node's) lower bound exceeds what it may still allocate. One allgather, before the model exists."""
    need = rank_need(cfg, grid.layout, grid.coords["pp"])
    rows = grid.world.allgather_object((grid.info.node, grid.info.hostname, grid.coords["pp"], need.total,
                                        available_memory(device)))
    problem = first_shortfall(rows, device.type == "cuda")
    if problem is None:
        return
    rank, ranks, together, (free, where) = problem
    worst = rank_need(cfg, grid.layout, rows[rank][2])
    parts = ", ".join(f"{name} {human_size(size)}" for name, size in worst.parts.items() if size)
    sharing = f"; the {ranks} ranks of host {rows[rank][1]} need {human_size(together)} together" if ranks > 1 else ""
    raise ConfigError(f"config: the model does not fit in memory: rank {rank} needs at least "
                      f"{human_size(worst.total)} ({parts}; {worst.parameters:,} parameters, the most for "
                      f"{worst.largest}){sharing}, but {human_size(free)} are {where}; make the model or the "
                      f"micro-batch smaller, or spread it over more ranks (parallel.tp, parallel.pp, parallel.zero=1..3)")


def first_shortfall(rows, per_rank: bool) -> tuple[int, int, int, tuple[int, str]] | None:
    """(the rank that needs the most where memory runs short, the ranks sharing that memory, their bytes
    together, (bytes available, where)), or None when everything fits. ``rows``: (node, hostname, pp rank,
    bytes needed, (bytes available, where) or None when unknown) per world rank; ``per_rank``: each rank
    has its own memory (CUDA), else the ranks of a node share its host memory, as its lowest rank read it."""
    for rank, (node, _host, _pp, needed, room) in enumerate(rows):
        if room is None:
            continue
        if per_rank:
            if needed > room[0]:
                return rank, 1, needed, room
            continue
        local = [r for r, row in enumerate(rows) if row[0] == node]
        together = sum(rows[r][3] for r in local)
        if rank == local[0] and together > room[0]:
            return max(local, key=lambda r: rows[r][3]), len(local), together, room
    return None
