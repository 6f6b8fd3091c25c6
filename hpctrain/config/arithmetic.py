"""The GPT's size arithmetic: parameters, training FLOPs per token, the layer split over pipeline stages.

Pure arithmetic on a resolved ``ModelConfig`` (no torch, no MPI), so the model (``models/gpt.py``, which
re-exports these), the trainer's MFU and the performance model (``hpctrain/plan``) count the same way.
The block is ``hpctrain.models.gpt.Block``: RMSNorm, grouped-query attention (q, k, v, o), RMSNorm, and
the MLP: ``model.mlp`` "swiglu" (gate, up, down: three ``d_model x d_ff`` matrices) or "gelu" (up, down:
two). ``model.positions`` "learned" adds a ``max_seq_len x d_model`` table on the first stage: parameters,
no matmul FLOPs (rope has neither).

Mixture of experts (``moe``: a resolved ``[moe]`` section, ``config.moe_keys.resolve_moe``; None = dense): in
each block of ``moe.layers`` the MLP is a router (``num_experts x d_model``, no bias), ``num_experts`` SwiGLU
experts of width ``d_ff_expert`` (three ``d_model x d_ff_expert`` matrices each) and, with ``shared_experts``
= S > 0, one dense SwiGLU of width ``S x d_ff_expert`` that every token goes through. A token's matmuls are the
router's, its ``top_k`` experts' and the shared ones' (``active_parameters``, ``flops_per_token``).
"""
from __future__ import annotations

import bisect
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


def moe_layer_parameters(m, moe, experts: int) -> int:
    """One MoE block's routed layer with ``experts`` of its routed experts counted (``moe.num_experts``: all of
    them; ``moe.top_k``: what one token uses): the router ``E x d``, ``experts`` SwiGLU experts (``3 d f_e``
    each), the shared experts' SwiGLU (``3 d S f_e``)."""
    d, f = m.d_model, moe.d_ff_expert
    return moe.num_experts * d + (experts + moe.shared_experts) * 3 * d * f


def attention_matmul_parameters(m) -> int:
    """Weights of one block's attention: q and o (d x d), k and v (d x kv)."""
    kv = m.n_kv_heads * (m.d_model // m.n_heads)
    return 2 * m.d_model * m.d_model + 2 * m.d_model * kv


def moe_layer_count(m, moe) -> int:
    """Blocks whose MLP is a mixture of experts (0 for a dense model)."""
    return len(moe.layers) if moe is not None else 0


def _block_weights(m, moe) -> list[int]:
    """Each block's weight for the stage split: ``4 d^2`` + its MLP's matrices (an MoE block: router, every
    expert, the shared ones)."""
    attention = 4 * m.d_model * m.d_model
    dense = attention + mlp_matrices(m) * m.d_model * m.d_ff
    routed = set(moe.layers) if moe is not None else set()
    heavy = attention + moe_layer_parameters(m, moe, moe.num_experts) if routed else dense
    return [heavy if i in routed else dense for i in range(m.n_layers)]


def _heaviest_stage_split(weights: list[float], extra: list[float]) -> list[int]:
    """Blocks per stage (contiguous, at least one each) minimising the heaviest stage (its blocks' weights +
    ``extra``): the least feasible bound by bisection (to 1e-9 of it), each stage then filled as far as the
    bound allows (greedy filling is optimal for a given bound)."""
    pp, n = len(extra), len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def fill(bound: float) -> list[int] | None:
        counts, i = [], 0
        for s in range(pp):
            last = n - (pp - s - 1)  # leave a block for each later stage
            b = min(max(bisect.bisect_right(prefix, prefix[i] + bound - extra[s]) - 1, i + 1), last)
            while b > i + 1 and extra[s] + (prefix[b] - prefix[i]) > bound:
                b -= 1
            if extra[s] + (prefix[b] - prefix[i]) > bound:
                return None
            counts.append(b - i)
            i = b
        return counts if i == n else None
    lo, hi = 0.0, 2.0 * (prefix[-1] + sum(extra))  # feasible: twice every load, whatever the rounding
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fill(mid) is not None else (mid, hi)
    counts = fill(hi)
    assert counts is not None
    return counts


def partition_layers(m, pp: int, explicit: list[int] | None = None, moe=None) -> list[tuple[int, int]]:
    """Layer ranges per pipeline stage: ``explicit`` counts, or balanced by parameter count.

    Equal blocks (a dense model, or one whose every block is MoE: ``moe``, resolved): balancing counts the
    embedding (stage 0) and LM head (last stage) as fractions of a block and gives those stages fewer blocks
    when they are heavy. Unequal blocks (``moe.layers`` some of them: an MoE block weighs its router and every
    expert) are split contiguously so that the heaviest stage is as light as it can be (``_heaviest_stage_split``).
    """
    check_stages(m, pp, explicit or [])
    if explicit:
        counts = list(explicit)
    else:
        weights = _block_weights(m, moe)
        block = weights[0]
        extra = [0.0] * pp
        extra[0] += (m.vocab_size * m.d_model + position_parameters(m)) / block
        extra[-1] += (0 if m.tie_embeddings and pp == 1 else m.vocab_size * m.d_model) / block
        if len(set(weights)) > 1:
            counts = _heaviest_stage_split([w / block for w in weights], extra)
        else:
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


def moe_rank_parameters(m, moe, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of one MoE block's matrices on one tp rank of an ep group: dense = the
    attention / tp + the router (whole on every rank) + the shared experts / tp; expert = ``num_experts / ep``
    routed experts / tp (each rank of the ep group holds its share of the experts; their width is split over
    tp like the MLP's). Norms not included."""
    d, f = m.d_model, moe.d_ff_expert
    dense = attention_matmul_parameters(m) // tp + moe.num_experts * d + moe.shared_experts * 3 * d * f // tp
    return dense, moe.num_experts // ep * 3 * d * f // tp


def rank_parameters(m, tp: int, pp: int, pp_rank: int, stage_layers=(), virtual_stages: int = 1, moe=None,
                    ep: int = 1, v_shape: bool = False) -> dict[str, int]:
    """Parameters on one tp rank of pipeline rank ``pp_rank``, as the trainer builds its virtual stages (the
    c-th is v = c x pp + pp_rank of pp x ``virtual_stages``; ``v_shape``, zb-v's: pp_rank and 2 pp - 1 - pp_rank),
    by part: "vocabulary" (embedding rows on v = 0,
    LM head rows on the last, of the PADDED vocabulary / tp; a tied head is the embedding with one stage),
    "blocks" (matrices / tp, norms; the final norm), "positions" (a learned table on v = 0). With ``moe``
    (resolved) an MoE block's "blocks" are its ``moe_rank_parameters`` dense part and norms, and a fifth part,
    "experts", holds its ``num_experts / ep`` routed experts / tp (ZeRO shards it over dp x cp / ep)."""
    stages = pp * virtual_stages
    ranges = partition_layers(m, stages, list(stage_layers) or None, moe)
    rows = padded_vocab(m, tp) // tp
    parts = {"vocabulary": 0, "blocks": 0, "positions": 0, **({"experts": 0} if moe is not None else {})}
    routed = set(moe.layers) if moe is not None else set()
    dense, expert = moe_rank_parameters(m, moe, tp, ep) if moe is not None else (0, 0)
    for v in held_stages(pp, pp_rank, virtual_stages, v_shape):
        lo, hi = ranges[v]
        k = sum(1 for i in range(lo, hi) if i in routed)
        parts["blocks"] += (hi - lo - k) * (block_matmul_parameters(m) // tp + 2 * m.d_model)
        if k:
            parts["blocks"] += k * (dense + 2 * m.d_model)
            parts["experts"] += k * expert
        if v == 0:
            parts["vocabulary"] += rows * m.d_model
            parts["positions"] += position_parameters(m)
        if v == stages - 1:
            parts["blocks"] += m.d_model
            parts["vocabulary"] += 0 if (m.tie_embeddings and stages == 1) else rows * m.d_model
    return parts


def held_stages(pp: int, pp_rank: int, virtual_stages: int = 1, v_shape: bool = False) -> list[int]:
    """The virtual stages pp rank ``pp_rank`` holds, its c = 0, 1, ...: c x pp + pp_rank (Megatron's round robin), or
    with ``v_shape`` (zb-v, V = 2) pp_rank and 2 pp - 1 - pp_rank (``parallel/zero_bubble.virtual_stage``)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [c * pp + pp_rank for c in range(virtual_stages)]


def active_matmul_parameters(m, moe=None) -> int:
    """The matmul weights one token goes through: every block's (an MoE block: attention, router, ``top_k``
    experts, the shared ones) and the LM head's."""
    k = moe_layer_count(m, moe)
    routed = k * (attention_matmul_parameters(m) + moe_layer_parameters(m, moe, moe.top_k)) if k else 0
    return (m.n_layers - k) * block_matmul_parameters(m) + routed + m.vocab_size * m.d_model


def flops_per_token(m, seq_len: int, lora_rank: int = 0, lora_targets=(), moe=None) -> float:
    """Training FLOPs per token (forward + backward): 6 * matmul params + causal attention scores. With LoRA
    (``lora_rank`` > 0) a frozen weight costs 4 per parameter (forward, and the input's gradient; no weight
    gradient) and each adapter parameter 6. With ``moe`` (resolved) the matmul params are the ACTIVE ones
    (``active_matmul_parameters``: the router, ``top_k`` experts and the shared ones in an MoE block)."""
    params = active_matmul_parameters(m, moe)  # the blocks' and the LM head's
    per_param = 6.0 if not lora_rank else 4.0
    adapters = 6.0 * adapter_parameters(m, lora_rank, lora_targets) if lora_rank else 0.0
    return per_param * params + adapters + 6.0 * m.n_layers * m.d_model * seq_len  # 12*L*d*S/2: causal half


def count_parameters(m, moe=None) -> int:
    """Every parameter of the model once (a tied LM head is the embedding); with ``moe`` (resolved) each MoE
    block holds its router, every expert and the shared ones instead of the dense MLP."""
    return _parameters(m, moe, moe.num_experts if moe is not None else 0)


def active_parameters(m, moe) -> int:
    """The parameters one token uses: ``count_parameters`` with ``top_k`` of each MoE block's experts (the
    router, the shared experts, attention, norms, embedding and LM head all count); ``count_parameters`` for
    a dense model (``moe`` None)."""
    return _parameters(m, moe, moe.top_k if moe is not None else 0)


def _parameters(m, moe, experts: int) -> int:
    """The model's parameters with ``experts`` routed experts per MoE block."""
    k = moe_layer_count(m, moe)
    per_layer = block_matmul_parameters(m) + 2 * m.d_model  # + two RMSNorm weights
    routed = k * (attention_matmul_parameters(m) + moe_layer_parameters(m, moe, experts) + 2 * m.d_model) if k else 0
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    return (m.vocab_size * m.d_model + position_parameters(m) + (m.n_layers - k) * per_layer + routed + m.d_model
            + head)


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
