"""The fused LM head + cross-entropy under ``train.compile``: fixed-shape chunks whose local work is compiled.

    kernels = ChunkKernels(options)        # one per last stage (hpctrain/models/compile.py compile_stage)
    loss = compiled_head_cross_entropy(h, weight, targets, tp_comm, vocab_start, n_valid, chunk, kernels, mask)

The same contract as hpctrain/parallel/head_loss.py ``fused_head_cross_entropy`` (read it first): ``h`` [N, D] on
every tp rank, ``weight`` [V_local, D] whose first ``n_valid`` rows are the vocabulary ids [vocab_start,
vocab_start + n_valid), ``targets`` [N] global ids, ``mask`` [N] bool or None; returns the SUM of the counted
tokens' losses, dh and dW formed in forward, backward only scaling them (here one compiled pass each,
``ChunkKernels.times``, which also casts a float32 dW to W's dtype). What differs is how a chunk is run:

- every chunk has exactly ``chunk`` tokens (``even_chunk``: as even as the chunk count allows); the last one is
  padded with zero rows that count for nothing (keep 0, no target), so each compiled function sees one shape
  per run and never recompiles (eval and float16 keep head_loss.py's eager loss pass);
- at tp = 1 a chunk is ONE compiled call (``ChunkKernels.whole``): the head matmul h_c @ W^T in h's dtype, the
  max, sum of exp and target logit read from those logits in float32 registers (no float32 [chunk, vocab]
  tensor is written: inductor fuses the casts into its reductions), the chunk's losses, the gradient
  (softmax - onehot) * keep written once in h's dtype, and dh_c = grad @ W;
- under tp the chunk is two compiled calls (``stats``, ``grad``) around head_loss.py's one all-gather of each
  token's [4] statistics over tp (the same numbers as its eager path);
- dW += grad^T @ h_c is ONE GEMM that accumulates in place (``add_weight_grad``; the first chunk's with beta = 0
  into an empty dW, so no pass zeroes it): same dtypes through ``addmm(out=dW)``; bfloat16/float16 chunks into a float32 dW through ``addmm(out_dtype=float32,
  out=dW)`` on CUDA, where a trial on first use shows it works (``one_pass_float32_addmm``); elsewhere (the
  CPU: ``aten::addmm.dtype`` has no CPU kernel) a matmul then an add, as head_loss.py does.

A tp rank whose slab holds no real row (``n_valid`` = 0: a small vocabulary padded for tp) computes nothing but
joins each chunk's all-gather with empty statistics, as head_loss.py's eager path does.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from hpctrain.parallel.head_loss import even_chunk, fused_head_cross_entropy, gather_chunk_stats, local_targets

_HALF = (torch.float16, torch.bfloat16)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def _shifted(logits: torch.Tensor, n_valid: int) -> torch.Tensor:
    """logits [c, V_local] as float32 (float64 stays), the padding columns [n_valid, V_local) at -inf."""
    x = logits.to(_stat_dtype(logits.dtype))
    if n_valid < x.shape[-1]:
        columns = torch.arange(x.shape[-1], device=x.device)
        x = torch.where(columns < n_valid, x, float("-inf"))
    return x


def _stats(logits: torch.Tensor, local: torch.Tensor, inside: torch.Tensor, n_valid: int):
    """Per token of a chunk: (max [c], sum of exp(logit - max) [c], target logit [c], 0 where not inside)."""
    x = _shifted(logits, n_valid)
    top = x.amax(dim=-1)
    sum_exp = (x - top[:, None]).exp().sum(dim=-1)
    target = torch.where(inside, x.gather(-1, local[:, None]).squeeze(-1), 0.0)
    return top, sum_exp, target


def _grad(logits: torch.Tensor, top: torch.Tensor, factor: torch.Tensor, local: torch.Tensor,
          inside: torch.Tensor, keep: torch.Tensor, n_valid: int) -> torch.Tensor:
    """dL/dlogits of a chunk [c, V_local] in the logits' dtype: exp(logit - top) * factor - onehot * keep, where
    ``factor`` [c] = keep / (the global sum of exp at ``top``); 0 in the padding columns."""
    x = _shifted(logits, n_valid)
    columns = torch.arange(x.shape[-1], device=x.device)
    onehot = (columns[None, :] == local[:, None]) & inside[:, None]
    return ((x - top[:, None]).exp() * factor[:, None] - onehot * keep[:, None]).to(logits.dtype)


def _whole_chunk(h: torch.Tensor, w: torch.Tensor, local: torch.Tensor, inside: torch.Tensor, keep: torch.Tensor,
                 n_valid: int, want_h: bool):
    """tp = 1: a chunk h [c, D] against w [V, D] -> (losses [c], grad [c, V] in h's dtype, dh [c, D] or None)."""
    logits = F.linear(h, w)
    top, sum_exp, target = _stats(logits, local, inside, n_valid)
    losses = sum_exp.log() + torch.where(inside, top - target, 0.0)  # an id in no slab: log sum exp(x - max)
    grad = _grad(logits, top, keep / sum_exp, local, inside, keep, n_valid)
    return losses, grad, (grad @ w if want_h else None)


def _chunk_stats(h: torch.Tensor, w: torch.Tensor, local: torch.Tensor, inside: torch.Tensor, n_valid: int):
    """tp > 1, before the all-gather: (logits [c, V_local], max, sum of exp, target logit [c] each)."""
    logits = F.linear(h, w)
    return (logits,) + _stats(logits, local, inside, n_valid)


def _chunk_grad(logits: torch.Tensor, w: torch.Tensor, top: torch.Tensor, factor: torch.Tensor, local: torch.Tensor,
                inside: torch.Tensor, keep: torch.Tensor, n_valid: int, want_h: bool):
    """tp > 1, after the all-gather: (grad [c, V_local], dh [c, D] or None, this rank's share, summed over tp by
    the caller's copy_to_tp / gather_seq)."""
    grad = _grad(logits, top, factor, local, inside, keep, n_valid)
    return grad, (grad @ w if want_h else None)


def _times(t: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` times the scalar ``g`` in float32 (float64 stays), as ``dtype``: backward's one pass over dh and dW
    (``g`` is not rounded to half first)."""
    return (t.to(_stat_dtype(t.dtype)) * g).to(dtype)


class ChunkKernels:
    """The compiled chunk functions of one last stage, made lazily by torch.compile on first call (``compile``:
    torch.compile, or the identity in tests, which then runs the same code eagerly)."""

    def __init__(self, options: Optional[dict] = None, compile: Optional[Callable[[Callable], Callable]] = None):
        # fixed shapes: a second shape (``times`` on dh, then on dW) compiles a static graph of its own, not a
        # dynamic one (slower to compile, slower to run)
        make = compile or functools.partial(torch.compile, options=options or {}, dynamic=False)
        self.whole, self.stats, self.grad = make(_whole_chunk), make(_chunk_stats), make(_chunk_grad)
        self.times = make(_times)


@functools.cache
def one_pass_float32_addmm(device: torch.device) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` with bfloat16 a, b accumulates into the
    float32 c in place on ``device`` (CUDA: a 64 x 64 trial against float32 arithmetic, once per device)."""
    if device.type != "cuda":
        return False  # aten::addmm.dtype has no CPU kernel (torch 2.13)
    try:
        a = torch.linspace(-1, 1, 64 * 64, device=device).reshape(64, 64).to(torch.bfloat16)
        c = torch.ones(64, 64, device=device)
        want = c + a.float() @ a.float()
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return bool(torch.allclose(c, want, rtol=1e-3, atol=1e-3))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def add_weight_grad(grad_w: torch.Tensor, grad: torch.Tensor, h: torch.Tensor, first: bool = False) -> None:
    """grad_w [V_local, D] += grad^T @ h for a chunk's grad [c, V_local] and h [c, D] (``first``: = instead,
    grad_w's contents never read, so it may come from torch.empty): one GEMM accumulating in place where the
    hardware allows (module docstring), else a matmul and an add."""
    beta = 0 if first else 1
    if grad_w.dtype == grad.dtype:
        torch.addmm(grad_w, grad.t(), h, beta=beta, out=grad_w)
    elif one_pass_float32_addmm(grad_w.device):
        torch.addmm(grad_w, grad.t(), h, out_dtype=grad_w.dtype, beta=beta, out=grad_w)
    elif first:
        grad_w.copy_(grad.t() @ h)
    else:
        grad_w += grad.t() @ h


def _padded(t: torch.Tensor, rows: int, fill: Any = 0) -> torch.Tensor:
    """``t`` [r, ...] extended to ``rows`` rows of ``fill`` (t itself when it has them)."""
    if t.shape[0] == rows:
        return t
    out = torch.full((rows,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out


def _no_columns(rows: int, stat: torch.dtype, device: torch.device):
    """A slab without real rows' chunk statistics: (no logits, max -inf, sum of exp 0, target 0), [rows] each."""
    zeros = torch.zeros(rows, dtype=stat, device=device)
    return None, torch.full((rows,), float("-inf"), dtype=stat, device=device), zeros, zeros.clone()


class _CompiledChunksCrossEntropy(torch.autograd.Function):
    """head_loss.py's fused function with every chunk of ``chunk`` tokens run by ``kernels``."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                mask: Optional[torch.Tensor], tp_comm: Any, vocab_start: int, n_valid: int, chunk: int,
                kernels: ChunkKernels) -> torch.Tensor:
        n, stat = h.shape[0], _stat_dtype(h.dtype)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        split = tp_comm is not None and tp_comm.size > 1
        grad_h = torch.empty_like(h) if want_h else None
        acc = torch.float32 if weight.dtype in _HALF and chunk < n else weight.dtype  # one chunk: as unfused
        grad_w = torch.empty(weight.shape, dtype=acc, device=weight.device) if want_w else None
        written = False  # grad_w holds a chunk's share (a rank without real rows: zeros at the end)
        local, inside = local_targets(targets, vocab_start, n_valid)
        keep = torch.ones(n, dtype=stat, device=h.device) if mask is None else mask.to(stat)
        losses = torch.empty(n, dtype=stat, device=h.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h_c = _padded(h[s:e], chunk)  # padding rows: zero, no target, keep 0
            local_c, inside_c, keep_c = _padded(local[s:e], chunk), _padded(inside[s:e], chunk, False), \
                _padded(keep[s:e], chunk)
            grad: Optional[torch.Tensor] = None
            if not split:
                loss_c, grad, dh = kernels.whole(h_c, weight, local_c, inside_c, keep_c, n_valid, want_h)
            else:
                logits, top, sum_exp, target = (kernels.stats(h_c, weight, local_c, inside_c, n_valid) if n_valid
                                                else _no_columns(chunk, stat, h.device))
                best, total, target, found, rescale = gather_chunk_stats(tp_comm, top, sum_exp, target,
                                                                         inside_c.to(stat))
                loss_c = total.log() - (target - best * found)
                if logits is not None:
                    grad, dh = kernels.grad(logits, weight, top, rescale * keep_c / total, local_c, inside_c,
                                            keep_c, n_valid, want_h)
                else:  # no real row here: no share of dh, dW stays 0
                    dh = torch.zeros_like(h_c) if want_h else None
                del logits
            losses[s:e] = loss_c[:e - s]
            if grad_h is not None:
                grad_h[s:e] = dh[:e - s]
            if grad_w is not None and grad is not None:
                add_weight_grad(grad_w, grad, h_c, first=not written)
                written = True
            del grad, dh  # before the next chunk's
        if grad_w is not None and not written:
            grad_w.zero_()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype, ctx.kernels = weight.dtype, kernels
        return losses.sum() if mask is None else torch.where(mask, losses, 0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        grad_h, grad_w = ctx.saved_tensors  # times grad_loss in one compiled pass each
        times = ctx.kernels.times
        return (None if grad_h is None else times(grad_h, grad_loss, grad_h.dtype),
                None if grad_w is None else times(grad_w, grad_loss, ctx.weight_dtype)) + (None,) * 7


def compiled_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_comm: Any,
                                vocab_start: int, n_valid: int, chunk: int, kernels: ChunkKernels,
                                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """head_loss.py ``fused_head_cross_entropy`` with ``kernels`` running each chunk of ``even_chunk(N, chunk)``
    tokens when training in float32/bfloat16/float64 with a real row on this rank; otherwise that function
    itself. One all-gather per chunk on tp in forward; never talks in backward."""
    training = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if not training or h.dtype == torch.float16:
        return fused_head_cross_entropy(h, weight, targets, tp_comm, vocab_start, n_valid, chunk, mask)
    return _CompiledChunksCrossEntropy.apply(h, weight, targets, mask, tp_comm, vocab_start, n_valid,
                                             even_chunk(h.shape[0], chunk), kernels)
