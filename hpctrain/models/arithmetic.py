"""The GPT's size arithmetic: parameters, training FLOPs per token, the layer split over pipeline stages.

Pure arithmetic on a resolved ``ModelConfig`` (no torch, no MPI), so the model (``gpt.py``, which
re-exports these), the trainer's MFU and the performance model (``hpctrain/plan``) count the same way.
The block is ``hpctrain.models.gpt.Block``: RMSNorm, grouped-query attention (q, k, v, o), RMSNorm,
SwiGLU MLP (gate, up, down: three ``d_model x d_ff`` matrices).
"""
from __future__ import annotations

from hpctrain.parallel.rules import check_stages


def block_matmul_parameters(m) -> int:
    """Weights of one block's matrix multiplications: q and o (d x d), k and v (d x kv), gate/up/down."""
    kv = m.n_kv_heads * (m.d_model // m.n_heads)
    return 2 * m.d_model * m.d_model + 2 * m.d_model * kv + 3 * m.d_model * m.d_ff


def partition_layers(m, pp: int, explicit: list[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges per pipeline stage: ``explicit`` counts, or balanced by parameter count.

    Blocks are equal, so balancing counts the embedding (stage 0) and LM head (last stage) as
    fractions of a block and gives those stages fewer blocks when they are heavy.
    """
    check_stages(m, pp, explicit or [])
    if explicit:
        counts = list(explicit)
    else:
        block = 4 * m.d_model * m.d_model + 3 * m.d_model * m.d_ff
        extra = [0.0] * pp
        extra[0] += m.vocab_size * m.d_model / block
        extra[-1] += (0 if m.tie_embeddings and pp == 1 else m.vocab_size * m.d_model) / block
        counts = [1] * pp
        for _ in range(m.n_layers - pp):  # give the next block to the lightest stage
            loads = [c + e for c, e in zip(counts, extra)]
            counts[loads.index(min(loads))] += 1
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 * matmul params + causal attention scores."""
    params = m.n_layers * block_matmul_parameters(m) + m.vocab_size * m.d_model  # LM head matmul
    return 6.0 * params + 6.0 * m.n_layers * m.d_model * seq_len  # 12*L*d*S/2: causal half


def count_parameters(m) -> int:
    """Every parameter of the model once (a tied LM head is the embedding)."""
    per_layer = block_matmul_parameters(m) + 2 * m.d_model  # + two RMSNorm weights
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    return m.vocab_size * m.d_model + m.n_layers * per_layer + m.d_model + head
