"""The performance and memory model of context parallelism (cp): ring attention's blocks, bytes and exposure.

hpctrain's ring (hpctrain/parallel/context_parallel.py, cp_comm.py): a sequence of ``S`` tokens is cut into
``2 cp`` stripes of ``c = S / 2cp`` tokens; cp rank ``r`` holds stripes ``r`` and ``2cp-1-r`` (zig-zag).
Attention runs ``cp`` steps; at step ``i`` rank ``r`` attends with its queries to the K/V of rank ``r - i``
while the next K/V block travels (one non-blocking exchange with its ring neighbours). Work is done in blocks of at most
``RING_TILE`` queries x ``RING_TILE`` keys: a block whose every query is before (or, with a sliding window
``W``, ``W`` or more tokens after) every key is skipped; a partly visible block is computed whole, with a
mask (plain matrix products, no causal-skipping kernel).

Model, per layer and micro-batch ``b`` on one rank (tp rank share: ``Hq / t`` query and ``Hkv / t`` KV heads of
``d_h``):
- compute: the query-key pairs of the computed blocks, ``4 b pairs d_h Hq / t`` FLOPs forward (scores and
  values), twice that backward; ``ring_pairs`` counts them per step, the max over the cp ranks (the slowest
  rank paces the ring). Full causal: every step is ~``S^2 / 2cp^2`` pairs, the zig-zag balance. hpctrain
  computes a block with plain matrix products in ``ring_math_dtype`` (float32 for 16-bit training: the
  device's float32 peak, TF32 on NVIDIA with ``train.allow_tf32``), and its scores go through memory:
  ``SCORE_PASSES`` = 10 reads and writes of each float32 score per query head forward (product, scale,
  mask, max, subtract, exp, sum, value product), twice that backward, at the HBM bandwidth. A fused
  per-block kernel would keep them on chip: this is the cost of the engine's ring as it is
  (``Options.fused_ring``, ``hpctrain plan --ring fused``: a fused kernel in the training dtype instead).
- exchange: forward ``cp - 1`` passes of K/V, ``2 (S/cp) b (Hkv/t) d_h`` elements in the training dtype;
  backward ``cp - 1`` K/V passes again plus ``cp`` passes of dK/dV (same count, float32 for 16-bit
  training: ring_attention accumulates in float32), each a point-to-point send to the next rank while
  receiving from the previous one (``Machine.collective_s("sendrecv", ...)`` on the cp group's placement).
- overlap: step ``i``'s exchange runs beside step ``i``'s block compute; the exposed part is
  ``max(0, exchange_i - compute_i)`` per step. Backward, the dK/dV posted after step ``i`` travels beside
  step ``i + 1``, and the last one (home to the owner) has nothing to hide behind: fully exposed.
- memory: no score matrix is kept (each block's scores live only inside the block): per layer the ring keeps
  its output and a float32 log-sum-exp per query and head (``4 b (Hq/t) S/cp`` bytes) for the backward, which
  recomputes every block. Its working set during one layer's backward (``ring_workspace_bytes``) is counted
  once at the peak.
"""
from __future__ import annotations

from dataclasses import dataclass

RING_TILE = 1024  # ring_attention's default block size (hpctrain/parallel/context_parallel.py)
SCORE_PASSES = 10  # reads + writes of a block's float32 scores in its forward (block_attention; module doc)


def ring_math_dtype(dtype: str) -> str:
    """The dtype of ring attention's block products and softmax: float32 for 16-bit training (fp32 softmax
    statistics), float64 for float64."""
    return "float64" if dtype == "float64" else "float32"


def _pairs_upto(x: int, n: int) -> int:
    """Pairs (i, j) in [0, n)^2 with i - j <= x."""
    if x >= n - 1:
        return n * n
    if x < -(n - 1):
        return 0
    if x >= 0:
        return n * n - (n - 1 - x) * (n - x) // 2
    return (n + x) * (n + x + 1) // 2


def visible_pairs(q_first: int, k_first: int, n: int, window: int) -> int:
    """(query, key) pairs of an ``n`` x ``n`` block (queries at global positions q_first.., keys at k_first..)
    that attention uses: key <= query, and query - key < ``window`` when ``window`` > 0."""
    offset = q_first - k_first
    lo, hi = -offset, (window - 1 - offset if window > 0 else n)
    return max(0, _pairs_upto(hi, n) - _pairs_upto(lo - 1, n))


def _block_kind(nearest: int, farthest: int, window: int) -> str:
    if farthest < 0 or (window > 0 and nearest >= window):
        return "skip"
    if nearest >= 0 and (window == 0 or farthest < window):
        return "full"
    return "masked"


def _stripe_pair(q_first: int, k_first: int, stripe: int, tile: int, window: int) -> tuple[int, int]:
    """(pairs computed, pairs visible) of one query stripe x one key stripe, cut into ``tile`` blocks (``tile``
    divides ``stripe``): a block's kind depends only on the tile offset ``d``, which ``n - |d|`` blocks share."""
    whole = _block_kind(q_first - (k_first + stripe - 1), q_first + stripe - 1 - k_first, window)
    if whole != "masked":
        return (0, 0) if whole == "skip" else (stripe * stripe, stripe * stripe)
    n, computed, visible = stripe // tile, 0, 0
    for d in range(-(n - 1), n):
        qf, kf = q_first + max(d, 0) * tile, k_first + max(-d, 0) * tile
        if _block_kind(qf - (kf + tile - 1), qf + tile - 1 - kf, window) == "skip":
            continue
        computed += (n - abs(d)) * tile * tile
        visible += (n - abs(d)) * visible_pairs(qf, kf, tile, window)
    return computed, visible


@dataclass(frozen=True)
class RingWork:
    """Query-key pairs per ring step (the max over the cp ranks): ``computed`` (whole blocks, what the FLOPs
    are) and ``visible`` (what attention needs); ``skipped_fraction``: blocks' pairs never computed."""

    computed: tuple[int, ...]
    visible: tuple[int, ...]
    skipped_fraction: float


def ring_pairs(seq_len: int, cp: int, window: int = 0, tile: int = RING_TILE) -> RingWork:
    """The blocks of one ring attention on ``cp`` ranks for one sequence (module docstring)."""
    stripe = seq_len // (2 * cp)
    tile = min(tile, stripe) if tile > 0 else stripe
    if stripe % tile:
        tile = stripe  # hpctrain cuts a last, shorter tile; whole stripes are the close, simple bound
    if window <= 0 or window >= seq_len:  # full causal: every rank alike (the zig-zag balance)
        diagonal = (stripe // tile) * (stripe // tile + 1) // 2 * tile * tile  # a stripe against itself
        computed = (2 * diagonal + stripe * stripe,) + (2 * stripe * stripe,) * (cp - 1)
        visible = (stripe * (stripe + 1) + stripe * stripe,) + (2 * stripe * stripe,) * (cp - 1)
        return RingWork(computed, visible, 1.0 - sum(computed) / (cp * 4 * stripe * stripe))
    computed_at: list[int] = []  # per ring step
    visible_at: list[int] = []
    done = 0
    for step in range(cp):
        worst = (0, 0)
        for rank in range(cp):
            owner = (rank - step) % cp
            pair = [_stripe_pair(qc * stripe, kc * stripe, stripe, tile, window)
                    for qc in (rank, 2 * cp - 1 - rank) for kc in (owner, 2 * cp - 1 - owner)]
            total = (sum(p[0] for p in pair), sum(p[1] for p in pair))
            done += total[0]
            worst = max(worst, total)
        computed_at.append(worst[0])
        visible_at.append(worst[1])
    return RingWork(tuple(computed_at), tuple(visible_at), 1.0 - done / (cp * cp * 4 * stripe * stripe))


def kv_elements(model, micro_batch: int, seq_len: int, cp: int, tp: int) -> float:
    """Elements of one K/V block a cp rank passes on: ``2 (S/cp) b (Hkv/t) d_h`` (K and V packed)."""
    head_dim = model.d_model // model.n_heads
    return 2.0 * (seq_len // cp) * micro_batch * (model.n_kv_heads // tp) * head_dim


def exposed_s(exchange: list[float], compute: list[float]) -> float:
    """Seconds of ring exchange not hidden behind the block compute of the same step."""
    return sum(max(0.0, x - c) for x, c in zip(exchange, compute))


def ring_workspace_bytes(model, micro_batch: int, seq_len: int, cp: int, tp: int, dtype_bytes: int,
                         tile: int = RING_TILE) -> float:
    """The working set of one layer's ring backward (context_parallel.py): queries, output gradient and dQ in
    float32 (``3 b Hq/t S/cp d_h x 4``); the K/V block held, the one arriving (training dtype), its float32
    copy, its dK/dV and the dK/dV arriving (float32); one block's scores, probabilities and their gradient in
    float32 (``3 b Hq/t tile^2 x 4``)."""
    if cp <= 1:
        return 0.0
    head_dim, local = model.d_model // model.n_heads, seq_len // cp
    tile = min(tile, local // 2) if tile > 0 else local // 2
    heads, f32 = model.n_heads // tp, max(4, dtype_bytes)
    queries = 3.0 * micro_batch * heads * local * head_dim * f32
    kv = kv_elements(model, micro_batch, seq_len, cp, tp) * (2 * dtype_bytes + 3 * f32)
    return queries + kv + 3.0 * micro_batch * heads * tile * tile * f32


def lse_bytes(model, micro_batch: int, seq_len: int, cp: int, tp: int, dtype_bytes: int) -> float:
    """What one layer's ring keeps beyond Korthikanti's activations: the log-sum-exp per query and head,
    float32 (float64 in float64 training)."""
    return 0.0 if cp <= 1 else micro_batch * (model.n_heads // tp) * (seq_len // cp) * max(4, dtype_bytes)
