"""Tensor-parallel layers (Megatron style) and the vocab-parallel cross-entropy.

Shapes are sequence-first: inputs ``[S, B, D]``; with sequence parallelism (``sp=True``) the
activations between blocks are ``[S/tp, B, D]`` and each layer gathers / reduce-scatters them.
All communication is on the TP group's ``Communicator`` (``tp_comm``); ``tp_comm=None`` or size 1 = no-op.

    ColumnParallelLinear   W [out/tp, in]   in: replicated (or SP-split) -> out: split on last dim
    RowParallelLinear      W [out, in/tp]   in: split on last dim -> out: reduced (or SP reduce-scattered)
    VocabParallelEmbedding W [V/tp, D]      ids -> [S, B, D] reduced (or SP reduce-scattered)

The linears may carry LoRA adapters (``lora_A``, ``lora_B``: hpctrain/parallel/lora.py ``attach_lora``),
added to their output (row-parallel: before the reduction); ``lora`` is None without. A zero-bubble schedule
gives them its ``WeightGradStore`` (``weight_grads``; hpctrain/parallel/weight_grad.py): their weight
gradient then waits for the schedule's W.

The vocabulary layers (embedding, LM head) hold ``V = padded_vocab`` rows (config/rules.py): the
rows past the true vocabulary are zero padding (``SlabSpec.padded_dim``). Their ids never occur and the
model drops their logit columns before anything uses them (``GPTStage.forward``), so they get exactly
zero gradient and stay zero.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.parallel.fp8 import fp8_linear
from hpctrain.parallel.lora import lora_delta
from hpctrain.parallel.param_init import InitRule, new_param
from hpctrain.parallel.slab import make_spec
from hpctrain.parallel.tp_comm import copy_to_tp, gather_seq, max_over_tp, reduce_from_tp, reduce_scatter_seq
from hpctrain.parallel.weight_grad import deferrable_linear


def _param(spec, dtype, seed, std):
    return new_param(spec, dtype, InitRule.normal(std, seed))


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = x @ W_local.T; backward all-reduces dL/dx over TP (or reduce-scatters with SP).

    ``input_mode``: "copy" (x replicated: identity forward, all-reduce backward), "gather" (x is
    SP-split: all-gather forward, reduce-scatter backward) or "none" (the caller already did one of
    those for several layers sharing x, e.g. q/k/v or gate/up).
    """

    def __init__(self, name, in_features, out_features, tp_comm, *, sp=False, dtype=torch.float32, seed=0,
                 std=0.02, weight=None, input_mode=None, padded_out=None):
        super().__init__()
        self.tp_comm, self.lora = tp_comm, None
        self.fp8 = None  # float8 GEMMs (parallel/fp8.py ``Fp8Linear``; models/fp8.py sets it), or None
        self.weight_grads = None  # a zero-bubble schedule's WeightGradStore (parallel/weight_grad.py), or None
        self.input_mode = input_mode or ("gather" if sp else "copy")
        if weight is None:  # ``weight``: share an existing [out/tp, in] parameter (tied LM head)
            # ``padded_out``: out_features padded to that many rows (the LM head over a padded vocabulary)
            spec = make_spec(f"{name}.weight", (out_features, in_features), 0, tp_comm, padded_dim=padded_out)
            weight = _param(spec, dtype, seed, std)
            self.weight = weight
        else:
            self._shared = [weight]  # not registered: the owner module holds it

    @property
    def w(self):
        return self.weight if hasattr(self, "weight") else self._shared[0]

    def forward(self, x):
        if self.input_mode == "gather":
            x = gather_seq(x, self.tp_comm)
        elif self.input_mode == "copy":
            x = copy_to_tp(x, self.tp_comm)
        if self.fp8 is not None:
            y = fp8_linear(x, self.w, self.fp8)
        else:
            y = F.linear(x, self.w) if self.weight_grads is None else deferrable_linear(x, self.w, self.weight_grads)
        return y if self.lora is None else y + lora_delta(self, x)


class RowParallelLinear(nn.Module):
    """y[..., out] = sum over TP of x_local @ W_local.T (all-reduce, or reduce-scatter on S with SP)."""

    def __init__(self, name, in_features, out_features, tp_comm, *, sp=False, dtype=torch.float32, seed=0,
                 std=0.02):
        super().__init__()
        self.tp_comm, self.sp, self.lora = tp_comm, sp, None
        self.fp8 = None  # float8 GEMMs (parallel/fp8.py ``Fp8Linear``; models/fp8.py sets it), or None
        self.weight_grads = None  # a zero-bubble schedule's WeightGradStore (parallel/weight_grad.py), or None
        self.weight = _param(make_spec(f"{name}.weight", (out_features, in_features), 1, tp_comm), dtype, seed, std)

    def forward(self, x):
        if self.fp8 is not None:
            y = fp8_linear(x, self.weight, self.fp8)
        else:
            y = F.linear(x, self.weight) if self.weight_grads is None else \
                deferrable_linear(x, self.weight, self.weight_grads)
        if self.lora is not None:  # a partial sum over tp, like y
            y = y + lora_delta(self, x)
        return reduce_scatter_seq(y, self.tp_comm) if self.sp else reduce_from_tp(y, self.tp_comm)


class VocabParallelEmbedding(nn.Module):
    """ids [S, B] -> [S, B, D] (or [S/tp, B, D] with SP); this rank holds rows [start, end) of the vocab
    padded to ``padded_vocab`` rows (ids are below ``vocab_size``, so padding rows are never looked up)."""

    def __init__(self, name, vocab_size, dim, tp_comm, *, sp=False, dtype=torch.float32, seed=0, std=0.02,
                 padded_vocab=None):
        super().__init__()
        self.tp_comm, self.sp = tp_comm, sp
        spec = make_spec(f"{name}.weight", (vocab_size, dim), 0, tp_comm, padded_dim=padded_vocab)
        self.weight = _param(spec, dtype, seed, std)
        self.start = spec.tp_rank * spec.local_shape[0]
        self.end = self.start + spec.local_shape[0]

    def forward(self, ids):
        if self.tp_comm is None or self.tp_comm.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.tp_comm) if self.sp else reduce_from_tp(out, self.tp_comm)


class _PickLast(torch.autograd.Function):
    """x [..., n], index [...] -> x[..., index] [...]: ``gather`` on the last dim that keeps only the index for
    backward (``gather``'s own backward keeps x, a tokens x vocabulary tensor here)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.n = x.shape[-1]
        return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(*grad.shape, ctx.n)
        return out.scatter_(-1, index.unsqueeze(-1), grad.unsqueeze(-1)), None


def vocab_parallel_cross_entropy(logits, targets, tp_comm, vocab_start: int):
    """logits [S, B, n] (this rank's vocabulary ids [vocab_start, vocab_start + n); n may be 0: the last tp ranks
    of a padded vocabulary take part with nothing), targets [S, B] -> loss [S, B], in float32 (or float64),
    without ever gathering the whole logits. Talks on tp: the max, then one all-reduce of each token's target
    logit and sum of exp.

    Plain differentiable ops between two tp collectives (``max_over_tp``, detached: the shift needs no
    gradient; ``reduce_from_tp``: identity backward, each rank's loss being the same), so under torch.compile
    the local parts, before, between and after them, are compiled and the collectives run eagerly
    (hpctrain/models/compile.py); autograd's gradient is this rank's softmax minus its one-hot targets, and
    the one tokens x vocabulary tensor kept for it is the exp (as Megatron's fused function keeps the softmax)."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    n_local = logits.shape[-1]
    if n_local:
        local_max = logits.detach().max(dim=-1).values
    else:
        local_max = torch.full(targets.shape, float("-inf"), dtype=logits.dtype, device=logits.device)
    shifted = logits - max_over_tp(local_max, tp_comm).unsqueeze(-1)
    outside = (targets < vocab_start) | (targets >= vocab_start + n_local)
    local_targets = (targets - vocab_start).masked_fill(outside, 0)
    if n_local:
        target_logit = _PickLast.apply(shifted, local_targets).masked_fill(outside, 0.0)
    else:
        target_logit = shifted.new_zeros(targets.shape)
    both = reduce_from_tp(torch.stack([target_logit, shifted.exp().sum(dim=-1)]), tp_comm)
    return both[1].log() - both[0]
