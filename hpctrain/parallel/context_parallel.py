"""Context parallelism: the zig-zag split of the sequence over the cp group, and ring attention on it.

Zig-zag: a sequence of S tokens is cut into 2 x cp stripes of S/(2cp) tokens; cp rank r holds stripes r
and 2cp-1-r (an early and a late one), so under a causal mask every rank has the same work. Local tensors
are ``[B, S/cp, ...]``: stripe r then stripe 2cp-1-r; ``zigzag_positions`` gives their GLOBAL positions
(RoPE, masks).

Ring attention (``ring_attention``, on the cp group): each rank attends with its local queries to the
K/V it holds while passing them on to the next rank (cp_comm.py), cp steps, so every query sees every
key. Work is done per "block": one tile of local queries x one tile of the held keys (the stripes cut
into runs of at most ``tile`` tokens, so a block's scores stay small). Blocks entirely in the future are
skipped, diagonal ones masked, and with a sliding window W (token t attends t-W+1..t) blocks entirely
outside every query's window are skipped too (``RingStats`` counts them). Partial results combine by
the log-sum-exp rule in float32 (float64 stays float64). Backward recomputes each block from
(q, k, v, out, lse) and sends dK/dV around the ring after their K/V, back to their owners.
GQA: query head h uses K/V head h // (Hq / Hkv) (as ``repeat_interleave``). Packed documents (``docs``
[B, S], the global document of every position, known to every cp rank): a block's mask also requires
query and key in one document, and a block where no query sees a key of its document is skipped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hpctrain.parallel.cp_comm import GRAD_TAG, KV_TAG, ring_step
from hpctrain.parallel.packed import same_document


# ---------------------------------------------------------------- the zig-zag split
def zigzag_stripes(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two global stripe indices (of 2 x cp) that cp rank ``cp_rank`` holds, in local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def check_divisible(seq_len: int, cp: int) -> None:
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"context parallelism needs the sequence length divisible by 2 x cp: "
                         f"seq_len {seq_len} % {2 * cp} != 0 (cp = {cp})")


def zigzag_positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions ``[seq_len / cp]`` (int64) of cp rank ``cp_rank``'s local tokens."""
    check_divisible(seq_len, cp)
    stripe = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * stripe, (i + 1) * stripe, device=device)
                      for i in zigzag_stripes(cp_rank, cp)])


def zigzag_split(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's local part of a global tensor: ``[B, S, ...]`` -> ``[B, S/cp, ...]`` (dim 1 by default)."""
    check_divisible(x.shape[dim], cp)
    stripes = x.chunk(2 * cp, dim=dim)
    return torch.cat([stripes[i] for i in zigzag_stripes(cp_rank, cp)], dim=dim)


def zigzag_merge(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of ``zigzag_split``: every cp rank's local part (in cp rank order) -> the global tensor."""
    halves = [part.chunk(2, dim=dim) for part in parts]  # rank r holds stripes r and 2 cp - 1 - r
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim=dim)


# ---------------------------------------------------------------- blocks
class Block(NamedTuple):
    """One query tile x key tile of a ring step: ``q``, ``k`` slices of the local tokens, the GLOBAL
    position of their first tokens, and its kind: "skip", "full" (no mask needed) or "masked"."""
    q: slice
    k: slice
    q_first: int
    k_first: int
    kind: str


@dataclass
class RingStats:
    """Blocks (query tile x key tile pairs) computed and skipped, forward and backward together."""
    computed: int = 0
    skipped: int = 0


def causal_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """``[Sq, Sk]`` bool, True where query position t may attend key position s: s <= t, and t - s < window
    when ``window`` > 0."""
    ago = q_pos[:, None] - k_pos[None, :]
    allowed = ago >= 0
    return allowed & (ago < window) if window > 0 else allowed


def block_kind(q_first: int, q_len: int, k_first: int, k_len: int, window: int) -> str:
    """"skip" (no query sees any key), "full" (every query sees every key) or "masked", for the queries at
    global positions q_first.. (q_len of them) and the keys at k_first.. (k_len)."""
    nearest = q_first - (k_first + k_len - 1)  # smallest query - key distance
    farthest = q_first + q_len - 1 - k_first
    if farthest < 0 or (window > 0 and nearest >= window):
        return "skip"
    if nearest >= 0 and (window == 0 or farthest < window):
        return "full"
    return "masked"


def _tiles(rank: int, cp: int, stripe: int, tile: int) -> list[tuple[slice, int]]:
    """(local slice, global first position) of each tile of cp rank ``rank``'s tokens."""
    return [(slice(i * stripe + off, i * stripe + min(off + tile, stripe)), c * stripe + off)
            for i, c in enumerate(zigzag_stripes(rank, cp)) for off in range(0, stripe, tile)]


def block_plan(q_rank: int, kv_rank: int, cp: int, stripe: int, window: int, tile: int = 0) -> list[Block]:
    """Every block of cp rank ``q_rank``'s queries against cp rank ``kv_rank``'s keys, stripes of ``stripe``
    tokens cut into tiles of ``tile`` (0 or more than ``stripe``: whole stripes, 4 blocks); skipped ones
    included (kind "skip")."""
    tile = stripe if tile <= 0 else min(tile, stripe)
    return [Block(qs, ks, qf, kf, block_kind(qf, qs.stop - qs.start, kf, ks.stop - ks.start, window))
            for qs, qf in _tiles(q_rank, cp, stripe, tile) for ks, kf in _tiles(kv_rank, cp, stripe, tile)]


def _blocks(q_rank, kv_rank, cp, stripe, window, tile, device, stats, docs=None):
    """The blocks to compute: (query slice, key slice, mask [Sq, Sk] / [B, 1, 1, Sq, Sk] (with ``docs``) or
    None); counts into ``stats``."""
    plan = block_plan(q_rank, kv_rank, cp, stripe, window, tile)
    todo = []
    for block in plan:
        if block.kind == "skip":
            continue
        mask = None
        q_len, k_len = block.q.stop - block.q.start, block.k.stop - block.k.start
        if block.kind == "masked":
            mask = causal_window_mask(torch.arange(q_len, device=device) + block.q_first,
                                      torch.arange(k_len, device=device) + block.k_first, window)
        if docs is not None:
            same = same_document(docs[:, block.q_first:block.q_first + q_len],
                                 docs[:, block.k_first:block.k_first + k_len])
            allowed = same if mask is None else same & mask
            if not allowed.any():
                continue
            if not bool(allowed.all()) or mask is not None:
                mask = allowed[:, None, None]
        todo.append((block.q, block.k, mask))
    if stats is not None:
        stats.computed += len(todo)
        stats.skipped += len(plan) - len(todo)
    return todo


def block_attention(q, k, v, mask, scale):
    """Softmax attention of one block: q ``[..., Sq, Dh]``, k, v ``[..., Sk, Dh]`` (broadcasting),
    ``mask`` ``[Sq, Sk]`` bool or None -> (out ``[..., Sq, Dh]``, lse ``[..., Sq]``); a query with no
    visible key gets out 0 and lse -inf."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = top.masked_fill(top == float("-inf"), 0.0)
    probs = torch.exp(scores - top)
    total = probs.sum(-1, keepdim=True)
    out = (probs @ v) / total.masked_fill(total == 0, 1.0)
    return out, (top + total.log()).squeeze(-1)


def merge_partials(out, lse, out_b, lse_b):
    """The log-sum-exp rule: attention over keys A and B from attention over A (out, lse) and over B."""
    merged = torch.logaddexp(lse, lse_b)
    safe = merged.masked_fill(merged == float("-inf"), 0.0)  # rows that see no key yet stay 0
    return (out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]), merged


def block_grads(q, k, v, dout, lse, delta, mask, scale):
    """Gradients of one block, recomputed: q, dout ``[B, Hkv, g, Sq, Dh]``, k, v ``[B, Hkv, 1, Sk, Dh]``,
    lse, delta (rowsum of dout * out) ``[B, Hkv, g, Sq]`` -> (dq, dk, dv) shaped like q, k, v."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse[..., None])
    dv = (probs.transpose(-1, -2) @ dout).sum(2, keepdim=True)
    dscores = probs * (dout @ v.transpose(-1, -2) - delta[..., None])
    dq = (dscores @ k) * scale
    dk = (dscores.transpose(-1, -2) @ q).sum(2, keepdim=True) * scale
    return dq, dk, dv


# ---------------------------------------------------------------- the ring
def _group(comm) -> tuple[int, int]:
    return (0, 1) if comm is None else (comm.rank, comm.size)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, window, scale, tile, stats, docs):
        rank, cp = _group(comm)
        batch, heads, local, dim = q.shape
        kv_heads, stripe, dtype = k.shape[1], local // 2, _compute_dtype(q.dtype)
        queries = q.to(dtype).reshape(batch, kv_heads, heads // kv_heads, local, dim)
        out = torch.zeros_like(queries)
        lse = torch.full(queries.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        kv = torch.stack([k, v])  # [2, B, Hkv, Sl, Dh]: one message per pass
        for i in range(cp):
            step = ring_step(comm, kv, KV_TAG) if i < cp - 1 else None
            held = kv.to(dtype).unsqueeze(3)  # [2, B, Hkv, 1, Sl, Dh]
            for qs, ks, mask in _blocks(rank, (rank - i) % cp, cp, stripe, window, tile, q.device, stats, docs):
                out_b, lse_b = block_attention(queries[..., qs, :], held[0, ..., ks, :], held[1, ..., ks, :],
                                               mask, scale)
                out[..., qs, :], lse[..., qs] = merge_partials(out[..., qs, :], lse[..., qs], out_b, lse_b)
                if step is not None:
                    step.test()
            if step is not None:
                kv = step.wait()
        out = out.reshape(batch, heads, local, dim).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.window, ctx.scale, ctx.tile, ctx.stats, ctx.docs = comm, window, scale, tile, stats, docs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, window, scale, tile = ctx.comm, ctx.window, ctx.scale, ctx.tile
        rank, cp = _group(comm)
        batch, heads, local, dim = q.shape
        kv_heads, stripe, dtype = k.shape[1], local // 2, _compute_dtype(q.dtype)
        shape = (batch, kv_heads, heads // kv_heads, local, dim)
        grouped, dout = q.to(dtype).reshape(shape), grad_out.to(dtype).reshape(shape)
        delta = (dout * out.to(dtype).reshape(shape)).sum(-1)
        dq = torch.zeros_like(grouped)
        kv, grad_pass = torch.stack([k, v]), None
        for i in range(cp):
            step = ring_step(comm, kv, KV_TAG) if i < cp - 1 else None
            held = kv.to(dtype).unsqueeze(3)
            dkv = torch.zeros(held.shape, dtype=dtype, device=q.device)  # this block's dK/dV from my queries
            for qs, ks, mask in _blocks(rank, (rank - i) % cp, cp, stripe, window, tile, q.device, ctx.stats,
                                        ctx.docs):
                dq_a, dk_b, dv_b = block_grads(grouped[..., qs, :], held[0, ..., ks, :], held[1, ..., ks, :],
                                               dout[..., qs, :], lse[..., qs], delta[..., qs], mask, scale)
                dq[..., qs, :] += dq_a
                dkv[0, ..., ks, :] += dk_b
                dkv[1, ..., ks, :] += dv_b
                for pending in (step, grad_pass):
                    if pending is not None:
                        pending.test()
            if grad_pass is not None:  # the dK/dV of this block from the ranks it visited before
                dkv += grad_pass.wait()
            if step is not None:
                kv = step.wait()
            grad_pass = ring_step(comm, dkv, GRAD_TAG)  # after cp passes each block's is home
        dkv = (grad_pass.wait() if grad_pass is not None else dkv).squeeze(3)
        return (dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), *[None] * 6)


def default_tile(device: torch.device) -> int:
    """The block edge ``ring_attention`` uses when none is given: 256 tokens on CPUs (a block's float32
    scores of a few heads stay in the L2 cache: 2.4-3.6x faster than 1024 on this machine, measured in
    docs/parallelism.md), 1024 on GPUs (fewer, larger matmuls)."""
    return 1024 if torch.device(device).type == "cuda" else 256


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, window: int = 0,
                   scale: float | None = None, stats: RingStats | None = None,
                   tile: int | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention over a sequence split zig-zag over the cp group.

    On the cp group ``comm`` (a Communicator; None = one rank): q ``[B, Hq, Sl, Dh]``, k, v
    ``[B, Hkv, Sl, Dh]`` for this rank's Sl = S/cp local tokens (``zigzag_split`` order), Hq a multiple
    of Hkv; ``window`` W > 0: token t attends t-W+1..t only; ``scale`` default 1/sqrt(Dh); ``stats``: a
    ``RingStats`` to count computed / skipped blocks; ``tile``: the longest query or key run of one block
    (the scores of a block are ``[B, Hq, tile, tile]``; 0 = whole stripes; None = ``default_tile``); ``docs``
    ``[B, S]`` int64: the document of every GLOBAL position (packed sequences: attention stays inside
    documents), or None. Returns ``[B, Hq, Sl, Dh]`` in q's dtype.
    Every rank of the group must call it with the same shapes (a collective).
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"ring_attention: q [B, Hq, Sl, Dh] and k, v [B, Hkv, Sl, Dh]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] % 2:
        raise ValueError(f"ring_attention: Hq {q.shape[1]} must be a multiple of Hkv {k.shape[1]} and the local "
                         f"length {q.shape[2]} even (two zig-zag stripes)")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError(f"ring_attention: q, k, v must share dtype and device; got {q.dtype}/{k.dtype}/{v.dtype} "
                         f"on {q.device}/{k.device}/{v.device}")
    if window < 0:
        raise ValueError(f"ring_attention: window {window} must be >= 0 (0 = full causal)")
    if docs is not None and tuple(docs.shape) != (q.shape[0], q.shape[2] * _group(comm)[1]):
        raise ValueError(f"ring_attention: docs must be [B, S] = {(q.shape[0], q.shape[2] * _group(comm)[1])}, "
                         f"got {tuple(docs.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    tile = default_tile(q.device) if tile is None else tile
    return _RingAttention.apply(q, k, v, comm, int(window), float(scale), int(tile), stats, docs)
