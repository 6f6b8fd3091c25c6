"""AdamW in one pass over the flat buffers (issue #52 item 3): one compiled region per step.

``torch._fused_adamw_`` (``FlatOptimizer._fused_step``) reads and writes the float32 masters, moments and
gradients (dividing the gradients in place by the clip/loss-scale divisor), and then a second pass,
``_foreach_copy_``, rounds the masters into the half-precision parameters. Here one ``torch.compile``'d
function does both, per owned slice: it reads master, gradient and both moments once and writes master,
moments and the low-precision parameters, leaving the gradients as they are. Weight decay applies to the
matrices only (``OptimizerSlice.decay_ranges``): a slice mixing both kinds carries a bool mask (1 byte an
element, made once), so each slice is one loop rather than one per run.

Every per-step number is a 0-d device tensor (``lr``, the step count, the gradient divisor, the skip flag
``found_inf``), so a schedule never recompiles and nothing is read on the host; the betas, eps and weight
decay are constants of the graph. The arithmetic is ``_fused_adamw_``'s (lerp for the first moment, the
bias-corrected denominator), equal to it within float32 rounding (tests/unit/test_one_pass_update.py).
"""
from __future__ import annotations

import torch


def adamw_one_pass(masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], lows: list[torch.Tensor | None],
                   masks: list[torch.Tensor | None], lr: torch.Tensor, step: torch.Tensor,
                   grad_divisor: torch.Tensor, found_inf: torch.Tensor, *, beta1: float, beta2: float, eps: float,
                   weight_decay: float) -> None:
    """One AdamW update of each slice ``i``, in place: ``masters[i]`` (float32, 1-D), ``exp_avgs[i]``,
    ``exp_avg_sqs[i]`` (its length), from ``grads[i] / grad_divisor``; ``lows[i]`` (the half-precision
    parameters of the slice, or None when the master is the parameter) gets the new master rounded.
    ``masks[i]``: True where weight decay applies (None: everywhere when ``weight_decay`` is given).
    ``step``: the update's 1-based count (already advanced); ``found_inf`` 1.0 leaves everything as it was."""
    keep = found_inf > 0
    step_size = lr / (1 - beta1 ** step)
    bias2_sqrt = torch.sqrt(1 - beta2 ** step)
    decay = 1 - lr * weight_decay
    for master, grad, exp_avg, exp_avg_sq, low, mask in zip(masters, grads, exp_avgs, exp_avg_sqs, lows, masks):
        g = grad.float() / grad_divisor
        m = exp_avg + (g - exp_avg) * (1 - beta1)
        v = exp_avg_sq * beta2 + g * g * (1 - beta2)
        p = master
        if weight_decay:
            p = p * (decay if mask is None else torch.where(mask, decay, torch.ones_like(decay)))
        p = p - step_size * m / (torch.sqrt(v) / bias2_sqrt + eps)
        p = torch.where(keep, master, p)
        exp_avg.copy_(torch.where(keep, exp_avg, m))
        exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, v))
        master.copy_(p)
        if low is not None:
            low.copy_(p)


class OnePassAdamW:
    """The compiled ``adamw_one_pass`` of one ``FlatOptimizer`` and its device scalars. Its tensor lists are
    taken afresh each step (ZeRO-2/3 re-allocate gradient storage), with the same shapes, so the graph
    compiled on the first step serves every later one."""

    def __init__(self, optimizer, compile_fn=torch.compile):
        c = optimizer.cfg
        self.optimizer = optimizer
        device = optimizer._step_tensor.device
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.no_skip = torch.zeros((), dtype=torch.float32, device=device)
        self.unit = torch.ones((), dtype=torch.float32, device=device)
        self.weight_decay = float(c.weight_decay)
        self.masks = [self._mask(s) for s in optimizer.owned_slices if s.end > s.start]
        self.constants = dict(beta1=float(c.beta1), beta2=float(c.beta2), eps=float(c.eps),
                              weight_decay=self.weight_decay)
        self.update = compile_fn(adamw_one_pass, fullgraph=True, dynamic=False)

    def _mask(self, s) -> torch.Tensor | None:
        """True where weight decay applies in slice ``s``; None when the slice is all one kind."""
        length = s.end - s.start
        decayed = sum(hi - lo for lo, hi in s.decay_ranges)
        if not self.weight_decay or decayed in (0, length):
            return None
        mask = torch.zeros(length, dtype=torch.bool, device=s.master.device)
        for lo, hi in s.decay_ranges:
            mask[lo:hi] = True
        return mask

    def step(self, lr: float, grad_coef, found_inf: torch.Tensor | None) -> None:
        """The update of every owned slice (the step count advanced on the device first, then taken back if
        ``found_inf``), lr written into its device scalar."""
        opt = self.optimizer
        self.lr.fill_(lr)
        divisor = opt.grad_divisor(grad_coef)
        slices = [s for s in opt.owned_slices if s.end > s.start]
        skip = self.no_skip if found_inf is None else found_inf.to(torch.float32)
        opt._step_tensor.add_(1)
        # a slice whose master is the parameter itself (float32 models) has no low-precision copy to write
        self.update([s.master for s in slices], [opt.flat.owned_grad(s.bucket, s.start, s.end) for s in slices],
                    [s.exp_avg for s in slices], [s.exp_avg_sq for s in slices],
                    [None if s.master is s.params else s.params for s in slices], self.masks, self.lr,
                    opt._step_tensor, self.unit if divisor is None else divisor, skip, **self.constants)
        if found_inf is not None:
            opt._step_tensor.sub_(found_inf)
        opt.flat.gather_params()
