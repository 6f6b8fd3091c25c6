"""The LM head and the vocab-parallel cross-entropy fused over chunks of tokens (``model.fused_head_loss``).

    losses = fused_head_cross_entropy(h, weight, targets, tp_comm, vocab_start, n_valid, chunk)

``h`` [N, D]: the head's input on every tp rank (replicated; gathered along the sequence first with SP),
``weight`` [V_local, D]: this tp rank's head rows, of which the first ``n_valid`` are the vocabulary ids
[vocab_start, vocab_start + n_valid) (the rest padding, never read: their gradient is exactly zero),
``targets`` [N] global ids (an id outside [0, vocab_size), e.g. an ignore index, gets the unfused path's
log(sum exp(logit - max)) and no onehot; the caller masks it). Returns the per-token loss [N] (float32 for
half inputs, as the unfused path).

Forward, for each chunk of ``chunk`` tokens (the last may be smaller): logits = h_c @ W^T in h's dtype,
then in float32 (float64 stays float64) this rank's max, sum of exp(logit - max) and target logit, kept
per token; after the loop two all-reduces over tp (max; then the target logits, whether a slab held the
target and the sums rescaled to the global max: Megatron's vocab-parallel cross-entropy, once for all chunks). Saved for backward:
h, W, the targets and the per-token logsumexp; never [N, V] logits. Backward recomputes each chunk's
logits, forms (softmax - onehot) * grad in float32, and writes dh's rows of the chunk and adds the chunk's
share of dW (summed in float32 for half weights over several chunks): no communication (the caller's ``copy_to_tp`` /
``gather_seq`` sums dh over tp as for the plain head).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

AUTO_CHUNK_BYTES = 256 * 2**20  # model.loss_chunk_tokens = 0: a chunk's float32 logits at most this
_HALF = (torch.float16, torch.bfloat16)


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


def describe_head(fused: bool, setting: int, tokens: int, vocab_local: int) -> str:
    """The start-up line's words for the last stage's head and loss over ``tokens`` tokens per micro-batch."""
    if not fused:
        return "head: logits + vocab-parallel CE (model.fused_head_loss=false)"
    chunk, how = chunk_tokens(setting, tokens, vocab_local), ", automatic" if setting == 0 else ""
    size = f"one chunk of {tokens} tokens" if chunk >= tokens else f"chunks of {chunk} of {tokens} tokens"
    return f"head: fused chunked CE ({size}{how})"


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in _HALF else x


class _FusedHeadCrossEntropy(torch.autograd.Function):
    """h [N, D], weight [V_local, D], targets [N] -> per-token loss [N]; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_comm: Any,
                vocab_start: int, n_valid: int, chunk: int) -> torch.Tensor:
        n, w = h.shape[0], weight[:n_valid]
        stat = torch.float32 if h.dtype in _HALF else h.dtype
        local_max = torch.full((n,), float("-inf"), dtype=stat, device=h.device)
        sum_exp = torch.zeros(n, dtype=stat, device=h.device)
        target_logit = torch.zeros(n, dtype=stat, device=h.device)
        local, inside = _local_targets(targets, vocab_start, n_valid)
        for s in range(0, n if n_valid else 0, chunk):
            e = min(s + chunk, n)
            logits = _float(F.linear(h[s:e], w))  # [c, n_valid]
            top = logits.max(dim=-1).values
            target_logit[s:e] = logits.gather(-1, local[s:e, None]).squeeze(-1).masked_fill(~inside[s:e], 0.0)
            sum_exp[s:e] = logits.sub_(top[:, None]).exp_().sum(dim=-1)
            local_max[s:e] = top
            del logits  # before the next chunk's: one chunk of logits alive at a time
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
        w = weight[:n_valid]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if want_h else None
        acc = torch.float32 if weight.dtype in _HALF and chunk < n else weight.dtype  # one chunk: as unfused
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        local, inside = _local_targets(targets, ctx.vocab_start, n_valid)
        grad_loss = grad_loss.to(logsumexp.dtype)
        for s in range(0, n if n_valid and (want_h or want_w) else 0, chunk):
            e = min(s + chunk, n)
            probs = _float(F.linear(h[s:e], w)).sub_(logsumexp[s:e, None]).exp_()  # softmax [c, n_valid]
            probs.scatter_add_(-1, local[s:e, None], inside[s:e, None].to(probs.dtype).neg())  # - onehot
            grad = probs.mul_(grad_loss[s:e, None]).to(h.dtype)  # dL/dlogits of the chunk
            if grad_h is not None:
                grad_h[s:e] = grad @ w
            if grad_w is not None:
                if acc == grad.dtype:
                    grad_w[:n_valid].addmm_(grad.t(), h[s:e])
                else:
                    grad_w[:n_valid] += grad.t() @ h[s:e]
            del probs, grad  # before the next chunk's
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _local_targets(targets: torch.Tensor, vocab_start: int, n_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each target in this rank's slab (0 where outside), whether it is inside) for [N] ids."""
    inside = (targets >= vocab_start) & (targets < vocab_start + n_valid)
    return (targets - vocab_start).masked_fill(~inside, 0), inside


def fused_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_comm: Any,
                             vocab_start: int, n_valid: int, chunk: int) -> torch.Tensor:
    """Per-token loss [N] of the head ``weight`` [V_local, D] (rows [0, n_valid) real) on ``h`` [N, D] and
    targets [N], ``chunk`` tokens at a time (> 0). Talks on tp in forward (two all-reduces), never in backward."""
    return _FusedHeadCrossEntropy.apply(h, weight, targets, tp_comm, vocab_start, n_valid, chunk)
