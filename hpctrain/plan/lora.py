"""LoRA in the performance and memory model (``Options.lora_rank`` > 0, ``Options.lora_targets``).

As hpctrain trains it (hpctrain/parallel/lora.py, hpctrain/models/lora.py): every block's target linears
gain ``A [r, in]`` and ``B [out, r]``, split like their base linear over tp: a column-parallel target (q, k,
v, gate, up) keeps ``A`` whole and splits ``B``'s rows, a row-parallel one (o, down) splits ``A``'s
columns and keeps ``B`` whole. The base is frozen: no gradients, no optimizer state, no weight
gradients in the backward (its input's gradient still costs one forward's matmuls); the adapters train
like any parameter (gradients, AdamW, ZeRO). memory.py and cost.py use these numbers; dense models only
(``hpctrain plan`` refuses LoRA on a mixture of experts).
"""
from __future__ import annotations

from hpctrain.config.arithmetic import adapter_parameters, lora_target_shapes
from hpctrain.plan.devices import PlanError

ROW_PARALLEL = frozenset(("o", "down"))  # RowParallelLinear targets (models/lora.py TARGET_MODULES); the rest are column


def check_targets(targets) -> None:
    """``targets`` are distinct LoRA target names (ValueError naming the others)."""
    known = ("q", "k", "v", "o", "gate", "up", "down")
    unknown = [t for t in targets if t not in known]
    if unknown or not targets or len(set(targets)) != len(targets):
        raise ValueError(f"LoRA targets {list(targets)}: expected a non-empty list of distinct names among "
                         f"{', '.join(known)}")


def _factors(m, tp: int, targets) -> list[tuple[int, int]]:
    """Per target of one block on one tp rank: (the input width ``A`` reads, the output width ``B`` writes)."""
    shapes = lora_target_shapes(m)
    missing = [t for t in targets if t not in shapes]
    if missing:  # gate on a model without a gated MLP
        raise PlanError(f"LoRA targets {missing}: this model has no such linear (it has {', '.join(shapes)})")
    out = []
    for target in targets:
        width_in, width_out = shapes[target]
        if target in ROW_PARALLEL:
            out.append((width_in // tp, width_out))
        else:
            out.append((width_in, width_out // tp))
    return out


def block_adapter_parameters(m, tp: int, rank: int, targets) -> int:
    """Adapter parameters of one block on one tp rank: ``r x (in' + out')`` per target, ``in'`` / ``out'``
    the widths this rank holds (column: in, out / tp; row: in / tp, out)."""
    if rank <= 0:
        return 0
    return sum(rank * (width_in + width_out) for width_in, width_out in _factors(m, tp, targets))


def partial_adapter_parameters(m, tp: int, rank: int, targets) -> int:
    """Of ``block_adapter_parameters``, the factors kept whole on every tp rank whose gradients are partial
    sums over tp (a column target's ``A``, a row target's ``B``; none at tp 1): the engine's deferred bucket,
    never sharded at zero >= 2 (hpctrain/parallel/data_parallel.py, zero/gather.py)."""
    if rank <= 0 or tp <= 1:
        return 0
    shapes = lora_target_shapes(m)
    return sum(rank * (shapes[t][1] if t in ROW_PARALLEL else shapes[t][0]) for t in targets)


def unit_adapter_parameters(m, tp: int, rank: int, targets) -> int:
    """Of ``block_adapter_parameters``, those a block's ZeRO-3 unit shards and gathers (the rest, partial over
    tp, stay whole)."""
    return block_adapter_parameters(m, tp, rank, targets) - partial_adapter_parameters(m, tp, rank, targets)


def adapter_gemms(m, tokens: int, tp: int, rank: int, targets) -> list[tuple[float, tuple[float, ...]]]:
    """One block's adapter matrix multiplications in the forward on one tp rank, as ``shapes.block_gemms``
    lists them (FLOPs, (rows, columns, inner)): ``x A^T`` then ``(x A^T) B^T`` per target. Thin (``rank``
    columns or inner), so the GEMM curve prices them well below the peak."""
    out: list[tuple[float, tuple[float, ...]]] = []
    for width_in, width_out in _factors(m, tp, targets):
        out.append((2.0 * tokens * width_in * rank, (tokens, rank, width_in)))
        out.append((2.0 * tokens * rank * width_out, (tokens, width_out, rank)))
    return out


def adapter_traffic_bytes(m, tokens: int, tp: int, rank: int, targets, nbytes: int) -> float:
    """Bytes one block's adapters move through memory in the forward on one tp rank, beside their matmuls:
    per target the tensors it makes, ``x A^T`` (``r`` wide), ``(x A^T) B^T``, its scaling and its sum with the
    base output (``out'`` wide each), every one written once and read once (cost.py's rule for a block's
    element-wise work)."""
    return sum(2.0 * tokens * (rank + 3 * width_out) * nbytes for _, width_out in _factors(m, tp, targets))


def lora_flops_per_token(m, rank: int, targets, recomputed: bool) -> float:
    """What LoRA changes in the FLOPs a token executes (``cost.executed_flops_per_token``): minus the frozen
    matmuls' weight gradients (2 per parameter of the blocks and the LM head), plus the adapters' forward and
    backward (6 per adapter parameter; 8 when full recomputation runs their forward again)."""
    from hpctrain.plan.shapes import block_matmul_params

    frozen = m.n_layers * block_matmul_params(m) + m.d_model * m.vocab_size
    return -2.0 * frozen + (8.0 if recomputed else 6.0) * adapter_parameters(m, rank, targets)
