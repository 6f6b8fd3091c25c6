"""The LM head and the vocab-parallel cross-entropy fused over loss chunks (``model.fused_head_loss``): runs of
``model.loss_chunk_tokens`` tokens (what "chunk" means in hpctrain: docs/architecture.md, "Words").

    loss = fused_head_cross_entropy(h, weight, targets, tp_comm, vocab_start, n_valid, chunk, mask)

``h`` [N, D]: the head's input on every tp rank (replicated; gathered along the sequence first with SP),
``weight`` [V_local, D]: this tp rank's head rows, of which the first ``n_valid`` are the vocabulary ids
[vocab_start, vocab_start + n_valid) (the rest padding: the matmuls span them, for aligned shapes, but
their logits are set to -inf, so they enter no loss and their gradient is exactly zero; padding rows must
be finite, as the model's zero-initialised ones are),
``targets`` [N] global ids (an id outside [0, vocab_size), e.g. an ignore index, gets the unfused path's
log(sum exp(logit - max)) and no onehot), ``mask`` [N] bool: the tokens that count (None: all). Returns
the SUM of the counted tokens' losses, a scalar (float32 for half inputs, as the unfused path).

Training (grad mode, h or W requiring grad; float32, bfloat16, float64): the gradient is formed in forward
(Liger's fused linear cross-entropy). Per chunk of ``chunk`` tokens (the last may be smaller): logits =
h_c @ W^T in h's dtype; in float32 (float64 stays float64) this rank's max, target logit and exp(logit -
max) with its sum; under tp ONE all-gather of these per-token numbers ([4, c] per rank; every rank combines
them alike: Megatron's vocab-parallel cross-entropy, chunk by chunk); the chunk's losses and at once its
(softmax - onehot) * mask -> dh rows = grad @ W, dW += grad^T @ h_c. Three head matmuls per step, never
[N, V] logits. Kept for backward: dh [N, D] (h's dtype: the size of h) and dW [V_local, D] (float32 for
half weights over several chunks, else W's dtype); backward only multiplies them by the scalar grad_output
(in float32 for half ones), in place, and autograd frees them (a second backward over the same forward is
refused). No communication in backward: the caller's ``copy_to_tp`` / ``gather_seq`` sums dh over tp as
for the plain head. A frozen W (LoRA) gets no dW, an h without grad no dh.

Without gradients (eval, no_grad) the loss pass alone runs: per-chunk statistics, then two all-reduces over
tp for all chunks (max; then the target logits, whether a slab held the target and the sums rescaled to the
global max). float16 trains through that pass too and a backward that recomputes each chunk's logits (4
head matmuls) and applies grad_output (the loss scale) before its half casts: unscaled dW sums of a chunk
could pass float16's range.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

AUTO_CHUNK_BYTES = 256 * 2**20  # model.loss_chunk_tokens = 0: a chunk's float32 logits at most this
_HALF = (torch.float16, torch.bfloat16)
_SCALE_BYTES = 64 * 2**20  # backward scales half gradients in float32, at most this many bytes at a time


def chunk_tokens(setting: int, tokens: int, vocab_local: int) -> int:
    """Tokens per chunk for ``tokens`` tokens over ``vocab_local`` vocabulary columns: ``setting`` (> 0) at
    most ``tokens``; 0 = automatic: all tokens when their float32 logits fit ``AUTO_CHUNK_BYTES``, else as
    many as fit (a multiple of 128 from 128 up)."""
    if setting > 0:
        return max(1, min(setting, tokens))
    rows = max(1, AUTO_CHUNK_BYTES // (4 * max(vocab_local, 1)))
    if rows >= tokens:
        return max(tokens, 1)
    return rows - rows % 128 if rows >= 128 else rows


def describe_head(fused: bool, setting: int, tokens: int, vocab_local: int, compiled: bool = False) -> str:
    """The start-up line's words for the last stage's head and loss over ``tokens`` tokens per micro-batch
    (``compiled``: its chunks run by hpctrain/parallel/head_chunks.py, of ``even_chunk`` tokens)."""
    if not fused:
        return "head: logits + vocab-parallel CE (model.fused_head_loss=false)"
    chunk, how = chunk_tokens(setting, tokens, vocab_local), ", automatic" if setting == 0 else ""
    if compiled:
        chunk = even_chunk(tokens, chunk)
        how += f", compiled, the last padded by {-tokens % chunk}" if tokens % chunk else ", compiled"
    size = f"one chunk of {tokens} tokens" if chunk >= tokens else f"chunks of {chunk} of {tokens} tokens"
    return f"head: fused chunked CE ({size}{how})"


def even_chunk(tokens: int, chunk: int) -> int:
    """The fixed chunk size for ``tokens`` tokens at most ``chunk`` (head_loss.py ``chunk_tokens``) at a time:
    the same number of chunks, as even as they can be, from 256 tokens up a multiple of 16 (aligned GEMMs) where
    that stays within ``chunk`` and adds no chunk, so the padding of the last chunk is small (gpt2-small on a
    GPU: 13 chunks of 1264 of 16384 tokens, 48 padded, where chunks of 1280 would pad 256)."""
    chunk = max(1, min(chunk, tokens))
    count = math.ceil(tokens / chunk)
    even = math.ceil(tokens / count)
    aligned = even + (-even) % 16
    return aligned if even >= 256 and aligned <= chunk and (count - 1) * aligned < tokens else even


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in _HALF else x


def _logits(h: torch.Tensor, w: torch.Tensor, n_valid: int) -> torch.Tensor:
    """A chunk h [c, D] against this rank's whole slab w [V_local, D] -> float logits [c, V_local] (float64
    stays float64), the padding columns [n_valid, V_local) at -inf. The matmul runs over the padded slab, not
    its first n_valid rows: an odd row count (GPT-2's 50257) leaves cuBLAS only its slow unaligned kernels
    (measured on an H100: 64 ms a step of sm75 cutlass kernels at gpt2-small, docs/benchmarks.md)."""
    logits = _float(F.linear(h, w))  # the only per-vocabulary tensor, one chunk's at a time
    if n_valid < w.shape[0]:
        logits[:, n_valid:] = float("-inf")  # exp -> 0: padding never enters a sum, a max or a gradient
    return logits


def _slab_stats(h: torch.Tensor, w: torch.Tensor, n_valid: int, local: torch.Tensor, inside: torch.Tensor,
                stat: torch.dtype) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk h [c, D] against this rank's slab w [V_local, D] (rows [0, n_valid) real): (exp(logit - max)
    [c, V_local] in ``stat``, 0 in the padding columns, None when n_valid = 0; this rank's max [c] (-inf when
    n_valid = 0); sum of those exps [c]; target logit [c], 0 where the target is not in the slab)."""
    c = h.shape[0]
    if not n_valid:
        zeros = torch.zeros(c, dtype=stat, device=h.device)
        return None, torch.full((c,), float("-inf"), dtype=stat, device=h.device), zeros, zeros.clone()
    logits = _logits(h, w, n_valid)
    top = logits.max(dim=-1).values
    target = logits.gather(-1, local[:, None]).squeeze(-1).masked_fill(~inside, 0.0)
    exp = logits.sub_(top[:, None]).exp_()
    return exp, top, exp.sum(dim=-1), target


def gather_chunk_stats(tp_comm: Any, top: torch.Tensor, sum_exp: torch.Tensor, target: torch.Tensor,
                  found: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One all-gather of every tp rank's [4, c] (max, sum of exp, target logit, target found) ->
    (global max, sum of exp at it, target logit, found, this rank's factor exp(max - global max)), [c]
    each, combined in rank order: the same numbers on every rank."""
    mine = torch.stack([top, sum_exp, target, found])
    every = mine.new_empty((tp_comm.size,) + tuple(mine.shape))
    tp_comm.allgather(every, mine)
    best = every[:, 0].amax(dim=0)
    total = (every[:, 1] * (every[:, 0] - best).exp()).sum(dim=0)  # a rank without columns: 0 * 0
    return best, total, every[:, 2].sum(dim=0), every[:, 3].sum(dim=0), (top - best).exp()


def _scale(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``t`` *= the scalar ``g``, in place; a half ``t`` in float32, rows at a time (``g`` is not rounded to half)."""
    if t.dtype not in _HALF:
        return t.mul_(g.to(t.dtype))
    rows = max(1, _SCALE_BYTES // (4 * max(t[0].numel(), 1))) if t.shape[0] else 1
    for s in range(0, t.shape[0], rows):
        t[s:s + rows] = t[s:s + rows].float().mul_(g)
    return t


class FusedHeadCrossEntropy(torch.autograd.Function):
    """h [N, D], weight [V_local, D], targets [N], mask [N] or None -> the counted tokens' loss sum [];
    dh and dW formed in forward (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                mask: Optional[torch.Tensor], tp_comm: Any, vocab_start: int, n_valid: int,
                chunk: int) -> torch.Tensor:
        n, w = h.shape[0], weight
        stat = torch.float32 if h.dtype in _HALF else h.dtype
        grad_h = (torch.empty_like(h) if n_valid else torch.zeros_like(h)) if ctx.needs_input_grad[0] else None
        acc = torch.float32 if weight.dtype in _HALF and chunk < n else weight.dtype  # one chunk: as unfused
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        local, inside = local_targets(targets, vocab_start, n_valid)
        onehot = (inside if mask is None else inside & mask).to(stat).neg()  # - onehot of the counted tokens
        losses = torch.empty(n, dtype=stat, device=h.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            exp, top, sum_exp, target = _slab_stats(h[s:e], w, n_valid, local[s:e], inside[s:e], stat)
            found = inside[s:e].to(stat)
            rescale: Optional[torch.Tensor] = None
            if tp_comm is not None and tp_comm.size > 1:  # every rank, columns or not
                top, sum_exp, target, found, rescale = gather_chunk_stats(tp_comm, top, sum_exp, target, found)
            losses[s:e] = sum_exp.log() - target.sub_(top * found)
            if exp is None or (grad_h is None and grad_w is None):
                continue
            row = sum_exp.reciprocal() if rescale is None else rescale.div_(sum_exp)  # exp -> softmax
            if mask is not None:
                row.mul_(mask[s:e])
            exp.mul_(row[:, None]).scatter_add_(-1, local[s:e, None], onehot[s:e, None])
            grad = exp.to(h.dtype)  # (softmax - onehot) * mask of the chunk [c, V_local], 0 in the padding
            _add_chunk_grads(grad, h[s:e], w, grad_h, grad_w, s)
            del exp, grad  # before the next chunk's
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return losses.sum() if mask is None else torch.where(mask, losses, 0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        grad_h, grad_w = ctx.saved_tensors  # a second backward: autograd's "modified by an inplace operation"
        if grad_h is not None:
            grad_h = _scale(grad_h, grad_loss)
        if grad_w is not None:
            grad_w = _scale(grad_w, grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None


class _RecomputedHeadCrossEntropy(torch.autograd.Function):
    """h [N, D], weight [V_local, D], targets [N] -> per-token loss [N]: the loss pass (no gradients, and
    float16's path), backward recomputing each chunk's logits (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_comm: Any,
                vocab_start: int, n_valid: int, chunk: int) -> torch.Tensor:
        n, w = h.shape[0], weight
        stat = torch.float32 if h.dtype in _HALF else h.dtype
        local_max = torch.full((n,), float("-inf"), dtype=stat, device=h.device)
        sum_exp = torch.zeros(n, dtype=stat, device=h.device)
        target_logit = torch.zeros(n, dtype=stat, device=h.device)
        local, inside = local_targets(targets, vocab_start, n_valid)
        for s in range(0, n if n_valid else 0, chunk):
            e = min(s + chunk, n)
            _, local_max[s:e], sum_exp[s:e], target_logit[s:e] = _slab_stats(h[s:e], w, n_valid, local[s:e],
                                                                              inside[s:e], stat)
        if tp_comm is not None and tp_comm.size > 1:
            global_max = local_max.clone()
            tp_comm.allreduce(global_max, op="max")
            if n_valid:  # rescale to the global max (a rank without columns holds sums of 0)
                sum_exp.mul_((local_max - global_max).exp_())
            rows = torch.stack([target_logit, sum_exp, inside.to(stat)])
            tp_comm.allreduce(rows)
            target_logit, sum_exp, found, local_max = rows[0], rows[1], rows[2], global_max
        else:
            found = inside.to(stat)
        log_sum = sum_exp.log_()  # of exp(logit - max): a target in no slab counts 0 = the max, as unfused
        loss = log_sum - target_logit.sub_(local_max * found)
        ctx.save_for_backward(h, weight, targets, log_sum.add_(local_max))  # logsumexp [N]
        ctx.vocab_start, ctx.n_valid, ctx.chunk = vocab_start, n_valid, chunk
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        h, weight, targets, logsumexp = ctx.saved_tensors
        n, n_valid, chunk = h.shape[0], ctx.n_valid, ctx.chunk
        w = weight
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if want_h else None
        acc = torch.float32 if weight.dtype in _HALF and chunk < n else weight.dtype  # one chunk: as unfused
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        local, inside = local_targets(targets, ctx.vocab_start, n_valid)
        grad_loss = grad_loss.to(logsumexp.dtype)
        for s in range(0, n if n_valid and (want_h or want_w) else 0, chunk):
            e = min(s + chunk, n)
            probs = _logits(h[s:e], w, n_valid).sub_(logsumexp[s:e, None]).exp_()  # softmax [c, V_local]
            probs.scatter_add_(-1, local[s:e, None], inside[s:e, None].to(probs.dtype).neg())  # - onehot
            grad = probs.mul_(grad_loss[s:e, None]).to(h.dtype)  # dL/dlogits of the chunk
            _add_chunk_grads(grad, h[s:e], w, grad_h, grad_w, s)
            del probs, grad  # before the next chunk's
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def local_targets(targets: torch.Tensor, vocab_start: int, n_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each target in this rank's slab (0 where outside), whether it is inside) for [N] ids."""
    inside = (targets >= vocab_start) & (targets < vocab_start + n_valid)
    return (targets - vocab_start).masked_fill(~inside, 0), inside


def fused_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_comm: Any,
                             vocab_start: int, n_valid: int, chunk: int,
                             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum over the tokens where ``mask`` [N] is True (None: all) of the cross-entropy of the head ``weight``
    [V_local, D] (rows [0, n_valid) real) on ``h`` [N, D] against ``targets`` [N], ``chunk`` tokens at a
    time (> 0). Training: dh and dW formed in forward, one all-gather per chunk on tp; else (and float16)
    two all-reduces on tp in forward. Never talks in backward."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad) and h.dtype != torch.float16:
        return FusedHeadCrossEntropy.apply(h, weight, targets, mask, tp_comm, vocab_start, n_valid, chunk)
    losses = _RecomputedHeadCrossEntropy.apply(h, weight, targets, tp_comm, vocab_start, n_valid, chunk)
    return losses.sum() if mask is None else torch.where(mask, losses, 0).sum()


def _add_chunk_grads(grad, h_chunk, w, grad_h, grad_w, start: int) -> None:
    """One chunk's share of the head's gradients from ``grad`` = dL/dlogits [c, V_local] (0 in the padding
    columns): its rows of ``grad_h`` ([N, D], from row ``start``) = grad @ w, and grad^T @ h_chunk added to
    ``grad_w`` [V_local, D] (in its dtype: float32 when bf16 chunks accumulate). Either may be None (not
    wanted). Every operand spans the padded slab, so the matmuls keep aligned shapes."""
    if grad_h is not None:
        torch.mm(grad, w, out=grad_h[start:start + grad.shape[0]])
    if grad_w is not None:
        if grad_w.dtype == grad.dtype:
            grad_w.addmm_(grad.t(), h_chunk)
        else:
            grad_w += grad.t() @ h_chunk
