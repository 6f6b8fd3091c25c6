"""AdamW / SGD over the flat ranges a rank owns (whole buffers, or ZeRO-1 slices), with fp32 masters.

The optimizer never sees modules: it updates ``FlatParams.owned_ranges()``. Without ZeRO every dp
rank updates everything (identically); with ZeRO-1 each updates its 1/dp slice and
``FlatParams.gather_params`` all-gathers the result. Half-precision models keep float32 master
copies of the owned ranges; float32/float64 models update the parameters in place.

Gradient norm (for clipping and logging) is global: each element is counted by exactly one rank
(the dp rank whose 1/dp slice of the bucket holds it — with or without ZeRO, so the work is split —,
and ``SlabSpec.counted_on``: TP rank 0 for TP-replicated weights, never the last stage's
tied-embedding copy; the checkpoint writer uses the same predicate), then summed over the world.

AdamW runs as ONE fused kernel per step (``torch._fused_adamw_``: a multi-tensor kernel on CUDA, a
vectorised loop on the CPU) over every owned slice, cut into weight-decayed runs (dims >= 2) and the rest
(``fused_runs``); the gradient multiplier can be a device tensor (the kernel divides the gradients by its
inverse, in place) and a device flag ``found_inf`` skips the update without a host read
(hpctrain/train/trainer.py's device verdict). float64 masters (the exactness tests), SGD and 1-bit Adam's
frozen steps keep the unfused in-place ops (``adamw_update_``, ``frozen_adam_update_``): the fused kernel's
moment update is a lerp, equal to ``adamw_update_`` within float32 rounding, not bitwise
(tests/unit/test_fused_adamw.py); 1-bit Adam's warm-up is fused, as dense AdamW is.

1-bit Adam (``freeze_variance_after = W``, compression.method = "onebit-adam"): the first W steps are
AdamW; later steps leave ``exp_avg_sq`` (and its bias correction, 1 - beta2^W) frozen and take the
momentum the reducer averaged (``momentum_from_reducer``; hpctrain/compression/onebit_adam.py) from
``full_momentum``: per bucket, the whole bucket's momentum on every rank (with ZeRO-1 too: each rank's
1-bit share needs all of it; its owned block is the slice's ``exp_avg``). The frozen variance's root is
floored at the bias-corrected |momentum| (``frozen_adam_update_``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hpctrain.parallel.buckets import intersect


@dataclass
class OptimizerSlice:
    """Optimizer state of one owned flat range [start, end) of ``bucket`` (a whole bucket, or its ZeRO-1
    slice). ``params`` views the flat parameters; ``master`` is them (float32/64 models) or a float32 copy.
    ``decay_ranges`` / ``norm_ranges``: sub-ranges, relative to ``start``, that get weight decay / that
    this rank counts in the global gradient norm."""

    bucket: object
    start: int
    end: int
    params: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_ranges: list
    norm_ranges: list
    runs: list = field(default_factory=list)  # fused AdamW: (lo, hi, decayed) runs covering [0, end - start), see ``fused_runs``

    def state(self, kind: str, lo: int, hi: int) -> torch.Tensor:
        """View of state ``kind`` ("master", "exp_avg", "exp_avg_sq") for absolute flat [lo, hi)."""
        return getattr(self, kind)[lo - self.start:hi - self.start]


class FlatOptimizer:
    def __init__(self, flat, cfg_optim, *, tp_rank: int = 0, master_dtype: torch.dtype | None = None,
                 freeze_variance_after: int | None = None, momentum_from_reducer: bool = False,
                 fused: bool | None = None, one_pass: bool = False):
        self.flat, self.cfg, self.tp_rank = flat, cfg_optim, tp_rank
        self.freeze_variance_after = freeze_variance_after
        self.momentum_from_reducer = momentum_from_reducer  # 1-bit Adam: the reducer averages the momentum
        # 1-bit Adam runs its frozen steps unfused and reads a skip on the host: the step's outcome must be
        # known before the update (hpctrain/train/outcomes.py)
        self.outcome_before_update = freeze_variance_after is not None
        self.full_momentum: dict[int, torch.Tensor] = {}  # bucket index -> its whole momentum (1-bit Adam)
        param_dtype = flat.param_dtype
        self.master_dtype = master_dtype or (torch.float32 if param_dtype in (torch.float16, torch.bfloat16)
                                             else param_dtype)
        # updates applied (Adam's bias correction): a host count, and a device one the fused kernel reads
        self._step_tensor = torch.zeros((), dtype=torch.float32, device=flat.device)
        self.step_count = 0
        self.scratch: torch.Tensor | None = None  # _scratch(): Adam's denominator, reused by every slice
        self._norm_pieces: list[torch.Tensor] = []  # _slice_norm_pieces(): kept below ZeRO
        self.owned_slices = [self._make_slice(bucket, start, end) for bucket, start, end in flat.owned_ranges()]
        # fused: AdamW on float32 masters (None: whenever it applies); 1-bit Adam's warm-up too, so that it is
        # dense AdamW bit for bit; its frozen steps run the unfused ops (frozen_adam_update_)
        applies = (getattr(cfg_optim, "name", None) == "adamw" and self.master_dtype != torch.float64
                   and hasattr(torch, "_fused_adamw_"))
        self.fused = applies if fused is None else fused and applies
        for s in self.owned_slices:
            s.runs = fused_runs(s.end - s.start, s.decay_ranges)
        self._fused_groups: dict | None = None  # _group_runs(): the kernel's tensor lists, built on the first step
        # one_pass: AdamW as ONE compiled pass that also writes the half-precision parameters (one_pass.py)
        self.one_pass = None
        if one_pass and self.fused and self.master_dtype == torch.float32:
            from hpctrain.optim.one_pass import OnePassAdamW

            self.one_pass = OnePassAdamW(self)
        # half-precision models: the parameters and their float32 masters, written after each fused update by
        # ONE torch._foreach_copy_ (the same rounding as each slice's copy_); empty when the masters are the params
        separate = [s for s in self.owned_slices if s.master is not s.params]
        self._master_copies = ([s.params for s in separate], [s.master for s in separate])

    def _make_slice(self, bucket, start: int, end: int) -> OptimizerSlice:
        flat = self.flat
        params = flat.owned_params(bucket, start, end)
        master = params if params.dtype == self.master_dtype else params.to(self.master_dtype)
        # the norm counts each element once: this dp rank's 1/dp slice of every bucket (all dp ranks hold
        # the same reduced grads without ZeRO, so they split the work), and counted_on(tp_rank)
        n = bucket.size // flat.dp_size
        count_lo, count_hi = bucket.start + flat.dp_rank * n, bucket.start + (flat.dp_rank + 1) * n
        counted = flat.param_ranges(start, end, lambda p: p.spec.counted_on(self.tp_rank))
        norm_ranges = [r for lo, hi in counted if (r := intersect(lo, hi, count_lo - start, count_hi - start))]
        zeros = lambda: torch.zeros(end - start, dtype=self.master_dtype, device=params.device)  # noqa: E731
        exp_avg = zeros()
        if self.freeze_variance_after is not None:  # 1-bit Adam: the whole bucket's momentum on every rank
            whole = exp_avg if (start, end) == (bucket.start, bucket.end) else \
                torch.zeros(bucket.size, dtype=self.master_dtype, device=params.device)
            self.full_momentum[bucket.index] = whole
            exp_avg = whole[start - bucket.start:end - bucket.start]
        return OptimizerSlice(bucket, start, end, params, master, exp_avg, zeros(),
                              flat.param_ranges(start, end, lambda p: p.dim() >= 2), norm_ranges)

    @property
    def update_kind(self) -> str:
        """How ``step`` updates (the start-up line): "compiled" (one_pass.py), "fused" or "unfused"."""
        return "compiled" if self.one_pass is not None else "fused" if self.fused else "unfused"

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """The per-element state a checkpoint holds (the master only when it is a separate copy)."""
        separate = self.master_dtype != self.flat.param_dtype
        return ("exp_avg", "exp_avg_sq") + (("master",) if separate else ())

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps: moments, and masters where they are a separate copy."""
        moments = sum(s.exp_avg.nbytes + s.exp_avg_sq.nbytes for s in self.owned_slices)
        moments += sum(m.nbytes for m in self.full_momentum.values()) - \
            sum(s.exp_avg.nbytes for s in self.owned_slices if self.full_momentum)
        return moments + sum(s.master.nbytes for s in self.owned_slices if s.master is not s.params)

    def owned_pieces(self):
        """(ParamPiece, OptimizerSlice) for every piece of a parameter inside an owned range."""
        for part in self.owned_slices:
            for piece in self.flat.pieces(part.start, part.end):
                yield piece, part

    def grad_norm_sq_tensor(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm of the gradients as they are (loss scale
        included): a float64 0-d tensor on the parameters' device, no host read."""
        total = torch.zeros((), dtype=torch.float64, device=self.flat.device)
        for piece in self._norm_pieces or self._slice_norm_pieces():
            total += torch.dot(piece, piece).double()
        return total

    def _slice_norm_pieces(self) -> list[torch.Tensor]:
        """The gradient pieces this rank counts, slice by slice; below ZeRO (gradients in one flat buffer that
        lives as long as the optimizer) adjacent pieces are merged and kept: at dp = tp = pp = 1 the norm is
        one dot over the whole buffer, not one per bucket."""
        if self.flat.zero:
            return [self.flat.owned_grad(s.bucket, s.start, s.end)[lo:hi]
                    for s in self.owned_slices for lo, hi in s.norm_ranges]
        merged: list[list[int]] = []
        for lo, hi in sorted((s.start + lo, s.start + hi) for s in self.owned_slices for lo, hi in s.norm_ranges):
            if merged and merged[-1][1] == lo:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        self._norm_pieces = [self.flat.grad_buffer[lo:hi] for lo, hi in merged]
        return self._norm_pieces

    @property
    def step_count(self) -> int:
        """Updates applied so far. Fused: counted on the device (a skipped update counts nothing there), so
        reading it waits for the device (checkpoints do; the step does not)."""
        return int(self._step_tensor.item()) if self.fused else self._count

    @step_count.setter
    def step_count(self, count: int) -> None:
        self._count = count
        self._step_tensor.fill_(count)

    @torch.no_grad()
    def step(self, lr: float, grad_coef: float | torch.Tensor = 1.0, found_inf: torch.Tensor | None = None) -> None:
        """One update with gradients multiplied by ``grad_coef`` (clipping x loss-scale inverse): a float, or
        a float64 0-d device tensor that the fused kernel reads on the device (as the divisor 1 / coef; the
        gradients are left divided). ``found_inf`` (float32 0-d, 1.0 = skip): the fused kernel skips the
        update and its count on the device. The unfused paths read both on the host.

        Allocation-free: ``grad_coef`` is folded into the update's coefficients (never a scaled copy
        of the gradients) and Adam's denominator goes into one scratch buffer reused by every slice.
        A fresh multi-MB tensor costs its page faults on every step: at 1.1M parameters on this
        machine the update took 6.5 ms with three temporaries, 1.0 ms without (docs/benchmarks.md)."""
        frozen_next = self.freeze_variance_after is not None and self.step_count >= self.freeze_variance_after
        if self.fused and not frozen_next:
            (self.one_pass.step if self.one_pass is not None else self._fused_step)(lr, grad_coef, found_inf)
            return
        if found_inf is not None and bool(found_inf):
            return
        self.step_count = self.step_count + 1  # both counts (a fused optimizer reads the device one)
        grad_coef = float(grad_coef)
        c = self.cfg
        frozen = self.freeze_variance_after is not None and self.step_count > self.freeze_variance_after
        for s in self.owned_slices:
            grad = self.flat.owned_grad(s.bucket, s.start, s.end).to(self.master_dtype)
            master = s.master
            if c.weight_decay:
                for lo, hi in s.decay_ranges:
                    master[lo:hi].mul_(1 - lr * c.weight_decay)
            if c.name == "adamw" and frozen:
                assert self.freeze_variance_after is not None  # frozen: 1-bit Adam's variance freeze
                frozen_adam_update_(master, grad, s.exp_avg, s.exp_avg_sq, lr, self.step_count, c, grad_coef,
                                    self._scratch(master), self.freeze_variance_after, self.momentum_from_reducer)
            elif c.name == "adamw":
                adamw_update_(master, grad, s.exp_avg, s.exp_avg_sq, lr, self.step_count, c, grad_coef,
                              self._scratch(master))
            elif c.momentum:  # sgd with momentum
                s.exp_avg.mul_(c.momentum).add_(grad, alpha=grad_coef)
                master.add_(s.exp_avg, alpha=-lr)
            else:
                master.add_(grad, alpha=-lr * grad_coef)
            if master is not s.params:
                s.params.copy_(master)
        self.flat.gather_params()

    def _group_runs(self) -> dict:
        """{decayed: (masters, grads, exp_avgs, exp_avg_sqs)}: views of every owned run, the fused kernel's
        tensor lists. Built once and kept (``_fused_groups``) when the gradients are already in the masters'
        dtype: every tensor is then a view of storage that lives as long as the optimizer."""
        decay = bool(self.cfg.weight_decay)
        groups: dict[bool, tuple[list, list, list, list]] = {True: ([], [], [], []), False: ([], [], [], [])}
        kept = True
        for s in self.owned_slices:
            owned = self.flat.owned_grad(s.bucket, s.start, s.end)
            kept = kept and owned.dtype == self.master_dtype
            grad = owned.to(self.master_dtype)
            for lo, hi, decayed in s.runs:
                for into, tensor in zip(groups[decayed and decay], (s.master, grad, s.exp_avg, s.exp_avg_sq)):
                    into.append(tensor[lo:hi])
        self._fused_groups = groups if kept else None
        return groups

    def _fused_step(self, lr: float, grad_coef, found_inf) -> None:
        """``torch._fused_adamw_`` over every owned slice at once: one call for the decayed runs, one for the rest."""
        c = self.cfg
        grad_divisor = self.grad_divisor(grad_coef)
        self._step_tensor.add_(1)
        for decayed, (masters, grads, exp_avgs, exp_avg_sqs) in (self._fused_groups or self._group_runs()).items():
            if masters:
                torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [], [self._step_tensor] * len(masters),
                                    lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps, amsgrad=False, maximize=False,
                                    weight_decay=c.weight_decay if decayed else 0.0, grad_scale=grad_divisor,
                                    found_inf=found_inf)
        if found_inf is not None:
            self._step_tensor.sub_(found_inf)
        if self._master_copies[0]:
            torch._foreach_copy_(*self._master_copies)
        self.flat.gather_params()

    def grad_divisor(self, grad_coef) -> torch.Tensor | None:
        """What the fused kernels divide the gradients by: 1 / ``grad_coef`` as a float32 0-d device tensor (a
        device coefficient stays on the device), or None for a coefficient of 1."""
        if isinstance(grad_coef, torch.Tensor):
            return torch.reciprocal(grad_coef).to(torch.float32)
        if grad_coef != 1.0:
            return torch.full((), 1.0 / grad_coef, dtype=torch.float32, device=self._step_tensor.device)
        return None

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``like``'s length (the largest owned slice, made once), for temporaries."""
        if self.scratch is None:
            longest = max(s.end - s.start for s in self.owned_slices)
            self.scratch = torch.empty(longest, dtype=self.master_dtype, device=like.device)
        return self.scratch[:like.numel()]


def fused_runs(length: int, decay_ranges: list) -> list[tuple[int, int, bool]]:
    """[0, length) cut into runs (lo, hi, decayed): the ``decay_ranges`` (sorted, disjoint) and the gaps."""
    runs, at = [], 0
    for lo, hi in decay_ranges:
        if lo > at:
            runs.append((at, lo, False))
        runs.append((lo, hi, True))
        at = hi
    if at < length:
        runs.append((at, length, False))
    return runs


def adamw_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  lr: float, step: int, c, grad_coef: float = 1.0, scratch: torch.Tensor | None = None) -> None:
    """Adam's moment updates and the parameter step, in place on 1-D tensors of one length, for the
    gradient ``grad_coef * grad`` (``c``: the ``[optim]`` config; weight decay is applied by the caller).
    ``scratch``: a buffer of the same length for the denominator (None: allocated). Also timed by
    ``bench comm --profile``."""
    exp_avg.mul_(c.beta1).add_(grad, alpha=(1 - c.beta1) * grad_coef)
    exp_avg_sq.mul_(c.beta2).addcmul_(grad, grad, value=(1 - c.beta2) * grad_coef * grad_coef)
    bias1 = 1 - c.beta1 ** step
    bias2 = 1 - c.beta2 ** step
    denom = torch.sqrt(exp_avg_sq, out=scratch) if scratch is not None else exp_avg_sq.sqrt()
    denom.div_(math.sqrt(bias2)).add_(c.eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias1)


def frozen_adam_update_(master, grad, exp_avg, exp_avg_sq, lr: float, step: int, c, grad_coef: float,
                        scratch: torch.Tensor, frozen_at: int, momentum_ready: bool) -> None:
    """1-bit Adam's step after the freeze: ``exp_avg_sq`` and its bias correction stay as they were at step
    ``frozen_at``; the momentum is the reducer's average (``momentum_ready``) or, with no reducer to average
    it (a single replica), AdamW's update from ``grad_coef * grad``. The root of the frozen variance is
    floored at the bias-corrected |momentum| (hpctrain's, not the paper's: docs/compression.md), so no
    coordinate moves more than ``lr``, as in AdamW; a coordinate whose gradient was ~0 during the warm-up
    would otherwise step by ``lr m / eps``."""
    if not momentum_ready:
        exp_avg.mul_(c.beta1).add_(grad, alpha=(1 - c.beta1) * grad_coef)
    bias1 = 1 - c.beta1 ** step
    denom = torch.sqrt(exp_avg_sq, out=scratch).div_(math.sqrt(1 - c.beta2 ** frozen_at))
    torch.maximum(denom, exp_avg.abs().div_(bias1), out=denom).add_(c.eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias1)


def lr_at(step: int, train) -> float:
    """Learning rate for 0-based ``step``: linear warmup, then cosine / linear decay to min_lr, or constant."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant" or train.steps <= train.warmup_steps:
        return train.lr
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps))
    if train.lr_schedule == "linear":
        return train.lr + (train.min_lr - train.lr) * progress
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))
