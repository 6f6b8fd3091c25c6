"""What one rank of a layout holds: its pipeline stage's layers, parameters and activation sizes.

Shared by the time model (cost.py) and the memory model (memory.py). Counts are per tensor-parallel
rank; bytes are for the training dtype (``dtype_bytes``: 2 for bfloat16/float16).
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.arithmetic import partition_layers
from hpctrain.plan.devices import PlanError
from hpctrain.plan.shapes import block_matmul_params, position_params

RECOMPUTE = ("off", "selective", "full")


def recompute_kind(value) -> str:
    """"off", "selective" or "full" (booleans: True is "full", hpctrain's ``train.recompute``)."""
    if isinstance(value, bool) or value is None:
        return "full" if value else "off"
    if value not in RECOMPUTE:
        raise PlanError(f"recompute {value!r}: expected one of {', '.join(RECOMPUTE)}")
    return value


@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``index`` holds ``layers`` blocks; the first embeds, the last has the LM head."""

    index: int
    layers: int
    first: bool
    last: bool


def stages(model, layout) -> list[Stage]:
    """The stages of ``layout`` with hpctrain's own split (``partition_layers``, balanced by parameters)."""
    ranges = partition_layers(model, layout.pp_size, list(layout.stage_layers) or None)
    last = len(ranges) - 1
    return [Stage(i, hi - lo, i == 0, i == last) for i, (lo, hi) in enumerate(ranges)]


def stage_parameters(model, stage: Stage, tp: int) -> int:
    """Parameters on one tp rank of ``stage``: its blocks' matrices / tp plus the replicated norm weights;
    the embedding rows / tp on the first stage; the final norm and LM head rows / tp on the last (a tied
    head is the embedding itself with one stage, a copy that is trained like a parameter with pp > 1);
    a learned position table on the first stage. ``model``'s vocabulary as given (padded by the caller)."""
    h, vh = model.d_model, model.vocab_size * model.d_model // tp
    n = stage.layers * (block_matmul_params(model) // tp + 2 * h)
    if stage.first:
        n += vh + position_params(model)
    if stage.last:
        n += h + (0 if (model.tie_embeddings and stage.first) else vh)
    return n


def layer_activation_bytes(model, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                           flash_attention: bool, dtype_bytes: int) -> float:
    """Bytes one block keeps for its backward, per tp rank and micro-batch, without recomputation.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2
    and 4), for 16-bit activations: ``s b h (34 + 5 a s / h) / t`` with sequence parallelism, and
    ``s b h (10 + 24 / t + 5 a s / (h t))`` without (the 10 s b h of norms, dropouts and residuals is
    then replicated over tp). ``5 a s / h`` is the attention score matrix (softmax, dropout mask and
    output): dropped with a fused (flash) attention kernel, which keeps no scores. Scaled by
    ``dtype_bytes / 2`` for other dtypes.
    """
    s, b, h, a, t = seq_len, micro_batch, model.d_model, model.n_heads, tp
    scores = 0.0 if flash_attention else 5.0 * a * s / h
    per = (34.0 + scores) / t if (sequence_parallel or t == 1) else 10.0 + (24.0 + scores) / t
    return s * b * h * per * dtype_bytes / 2


def score_bytes(model, micro_batch: int, seq_len: int, tp: int, dtype_bytes: int) -> float:
    """The attention scores one unfused block keeps (softmax output, dropout mask and output: ``5 a s^2 b
    / t`` at 16 bits): what selective recomputation drops and recomputes (Korthikanti et al. 2022, 4.2)."""
    return 5.0 * model.n_heads * seq_len * seq_len * micro_batch / tp * dtype_bytes / 2


def recompute_layer_bytes(model, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                          dtype_bytes: int) -> float:
    """Bytes one block keeps with full recomputation: only its input ``s b h`` (``/ t`` with SP)."""
    n = seq_len * micro_batch * model.d_model * dtype_bytes
    return n / tp if sequence_parallel else float(n)


def in_flight(layout, stage: Stage, virtual_stages: int = 1) -> float:
    """Micro-batches' worth of the stage's layers whose activations ``stage`` holds at once: 1F1B
    ``min(pp - s, M)``, GPipe ``M``; interleaved 1F1B with ``V`` virtual stages of ``layers / V`` each holds
    Megatron's warm-up ``2 (pp - s - 1) + (V - 1) pp`` (micro-batch, virtual stage) units plus one, so
    ``(2 (pp - s - 1) + (V - 1) pp + 1) / V`` of the stage's layers (at most ``M``)."""
    p, s, m, v = layout.pp_size, stage.index, layout.microbatches, virtual_stages
    if layout.schedule == "gpipe":
        return m
    if v > 1 and p > 1:
        return min((2 * (p - s - 1) + (v - 1) * p + 1) / v, m)
    return min(p - s, m)
