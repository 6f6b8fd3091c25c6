"""The GPT's size arithmetic: parameters, training FLOPs per token, the layer split over pipeline stages.

Pure arithmetic on a resolved ``ModelConfig`` (no torch, no MPI), so the model (``models/gpt.py``, which
re-exports these), the trainer's MFU and the performance model (``hpctrain/plan``) count the same way.
The block is ``hpctrain.models.gpt.Block``: RMSNorm, grouped-query attention (q, k, v, o), RMSNorm, and
the MLP: ``model.mlp`` "swiglu" (gate, up, down: three ``d_model x d_ff`` matrices) or "gelu" (up, down:
two). ``model.positions`` "learned" adds a ``max_seq_len x d_model`` table on the first stage: parameters,
no matmul FLOPs (rope has neither).
"""
from __future__ import annotations

import heapq

from hpctrain.config.rules import check_stages, padded_vocab


def mlp_matrices(m) -> int:
    """The MLP's ``d_model x d_ff`` matrices: 3 for SwiGLU (gate, up, down), 2 for GELU (up, down) and
    for the squared-ReLU MLP of published runs the planner models (``relu2``, Nemotron-4; not trainable)."""
    if m.mlp not in ("swiglu", "gelu", "relu2"):
        raise ValueError(f"model.mlp={m.mlp!r}: resolve the model config first (config.resolve_model)")
    return 3 if m.mlp == "swiglu" else 2


def position_parameters(m) -> int:
    """The learned position table's parameters (``max_seq_len x d_model``; first stage); 0 with rope."""
    return m.max_seq_len * m.d_model if m.positions == "learned" else 0


def block_matmul_parameters(m) -> int:
    """Weights of one block's matrix multiplications: q and o (d x d), k and v (d x kv), the MLP's matrices."""
    kv = m.n_kv_heads * (m.d_model // m.n_heads)
    return 2 * m.d_model * m.d_model + 2 * m.d_model * kv + mlp_matrices(m) * m.d_model * m.d_ff


def partition_layers(m, pp: int, explicit: list[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges per pipeline stage: ``explicit`` counts, or balanced by parameter count.

    Blocks are equal, so balancing counts the embedding (stage 0) and LM head (last stage) as
    fractions of a block and gives those stages fewer blocks when they are heavy.
    """
    check_stages(m, pp, explicit or [])
    if explicit:
        counts = list(explicit)
    else:
        block = 4 * m.d_model * m.d_model + mlp_matrices(m) * m.d_model * m.d_ff
        extra = [0.0] * pp
        extra[0] += (m.vocab_size * m.d_model + position_parameters(m)) / block
        extra[-1] += (0 if m.tie_embeddings and pp == 1 else m.vocab_size * m.d_model) / block
        counts = [1] * pp
        lightest = [(1 + e, i) for i, e in enumerate(extra)]  # (load, stage): ties go to the first stage
        heapq.heapify(lightest)
        for _ in range(m.n_layers - pp):  # give the next block to the lightest stage
            i = heapq.heappop(lightest)[1]
            counts[i] += 1
            heapq.heappush(lightest, (counts[i] + extra[i], i))
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def rank_parameters(m, tp: int, pp: int, pp_rank: int, stage_layers=(), virtual_stages: int = 1) -> dict[str, int]:
    """Parameters on one tp rank of pipeline rank ``pp_rank``, as the trainer builds its virtual stages (the
    c-th is v = c x pp + pp_rank of pp x ``virtual_stages``), by part: "vocabulary" (embedding rows on v = 0,
    LM head rows on the last, of the PADDED vocabulary / tp; a tied head is the embedding with one stage),
    "blocks" (matrices / tp, norms; the final norm), "positions" (a learned table on v = 0)."""
    stages = pp * virtual_stages
    ranges = partition_layers(m, stages, list(stage_layers) or None)
    rows = padded_vocab(m, tp) // tp
    parts = {"vocabulary": 0, "blocks": 0, "positions": 0}
    for c in range(virtual_stages):
        v = c * pp + pp_rank
        lo, hi = ranges[v]
        parts["blocks"] += (hi - lo) * (block_matmul_parameters(m) // tp + 2 * m.d_model)
        if v == 0:
            parts["vocabulary"] += rows * m.d_model
            parts["positions"] += position_parameters(m)
        if v == stages - 1:
            parts["blocks"] += m.d_model
            parts["vocabulary"] += 0 if (m.tie_embeddings and stages == 1) else rows * m.d_model
    return parts


def flops_per_token(m, seq_len: int, lora_rank: int = 0, lora_targets=()) -> float:
    """Training FLOPs per token (forward + backward): 6 * matmul params + causal attention scores. With LoRA
    (``lora_rank`` > 0) a frozen weight costs 4 per parameter (forward, and the input's gradient; no weight
    gradient) and each adapter parameter 6."""
    params = m.n_layers * block_matmul_parameters(m) + m.vocab_size * m.d_model  # LM head matmul
    per_param = 6.0 if not lora_rank else 4.0
    adapters = 6.0 * adapter_parameters(m, lora_rank, lora_targets) if lora_rank else 0.0
    return per_param * params + adapters + 6.0 * m.n_layers * m.d_model * seq_len  # 12*L*d*S/2: causal half


def count_parameters(m) -> int:
    """Every parameter of the model once (a tied LM head is the embedding)."""
    per_layer = block_matmul_parameters(m) + 2 * m.d_model  # + two RMSNorm weights
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    return m.vocab_size * m.d_model + position_parameters(m) + m.n_layers * per_layer + m.d_model + head


def lora_target_shapes(m) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear of a block that LoRA can adapt, by ``lora.targets`` name:
    q, k, v, o of the attention, gate (SwiGLU only), up, down of the MLP."""
    kv = m.n_kv_heads * (m.d_model // m.n_heads)
    shapes = {"q": (m.d_model, m.d_model), "k": (m.d_model, kv), "v": (m.d_model, kv), "o": (m.d_model, m.d_model)}
    if m.mlp == "swiglu":
        shapes["gate"] = (m.d_model, m.d_ff)
    return {**shapes, "up": (m.d_model, m.d_ff), "down": (m.d_ff, m.d_model)}


def adapter_parameters(m, rank: int, targets) -> int:
    """LoRA's trainable parameters over the model: r x (in + out) per target linear of every block."""
    shapes = lora_target_shapes(m)
    return m.n_layers * sum(rank * sum(shapes[t]) for t in targets)
