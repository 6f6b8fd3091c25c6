"""AdamW / SGD over the flat ranges a rank owns (whole buffers, or ZeRO-1 shards), with fp32 masters.

The optimizer never sees modules: it updates ``FlatParams.owned_ranges()``. Without ZeRO every dp
rank updates everything (identically); with ZeRO-1 each updates its 1/dp slice and
``FlatParams.gather_params`` all-gathers the result. Half-precision models keep float32 master
copies of the owned ranges; float32/float64 models update the parameters in place.

Gradient norm (for clipping and logging) is global: each element is counted by exactly one rank
(its dp owner — dp rank 0 without ZeRO —, TP rank 0 for TP-replicated weights, never the last
stage's tied-embedding copy), then summed over the world.
"""
from __future__ import annotations

import math

import torch


class FlatOptimizer:
    def __init__(self, flat, cfg_optim, *, tp_rank: int = 0, master_dtype: torch.dtype | None = None):
        self.flat, self.cfg = flat, cfg_optim
        param_dtype = flat.param_buffer.dtype
        self.master_dtype = master_dtype or (torch.float32 if param_dtype in (torch.float16, torch.bfloat16)
                                             else param_dtype)
        self.step_count = 0
        self.shards = []
        dp_duplicate = not flat.zero and flat.dp_rank != 0  # every dp rank holds the same grads
        for bucket, start, end in flat.owned_ranges():
            params = flat.param_buffer[start:end]
            master = params if param_dtype == self.master_dtype else params.to(self.master_dtype)
            shard = {
                "bucket": bucket, "start": start, "end": end, "params": params, "master": master,
                "exp_avg": torch.zeros(end - start, dtype=self.master_dtype),
                "exp_avg_sq": torch.zeros(end - start, dtype=self.master_dtype),
                "decay": flat.element_mask(start, end, lambda p: p.dim() >= 2),
                "norm_mask": flat.element_mask(start, end, lambda p: not dp_duplicate and not p.spec.tied_copy
                                               and (tp_rank == 0 or not p.spec.replicated_over_tp)),
            }
            self.shards.append(shard)

    def grad_norm_sq_local(self, inv_scale: float = 1.0) -> float:
        """This rank's share of the squared global gradient norm (float64)."""
        total = 0.0
        for s in self.shards:
            g = self.flat.owned_grad(s["bucket"], s["start"], s["end"]).to(torch.float64)
            total += float((g[s["norm_mask"]] * inv_scale).pow(2).sum())
        return total

    @torch.no_grad()
    def step(self, lr: float, grad_coef: float = 1.0) -> None:
        """One update with gradients multiplied by ``grad_coef`` (clipping x loss-scale inverse)."""
        self.step_count += 1
        c = self.cfg
        for s in self.shards:
            grad = self.flat.owned_grad(s["bucket"], s["start"], s["end"]).to(self.master_dtype)
            if grad_coef != 1.0:
                grad = grad * grad_coef
            master, decay = s["master"], s["decay"]
            if c.weight_decay:
                master.sub_(master * decay * (lr * c.weight_decay))
            if c.name == "adamw":
                m, v = s["exp_avg"], s["exp_avg_sq"]
                m.mul_(c.beta1).add_(grad, alpha=1 - c.beta1)
                v.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
                bias1 = 1 - c.beta1 ** self.step_count
                bias2 = 1 - c.beta2 ** self.step_count
                denom = (v.sqrt() / math.sqrt(bias2)).add_(c.eps)
                master.addcdiv_(m, denom, value=-lr / bias1)
            else:  # sgd with optional momentum
                if c.momentum:
                    buf = s["exp_avg"].mul_(c.momentum).add_(grad)
                    master.add_(buf, alpha=-lr)
                else:
                    master.add_(grad, alpha=-lr)
            if master is not s["params"]:
                s["params"].copy_(master)
        self.flat.gather_params()

    def state_tensors(self) -> dict:
        """Optimizer state of the owned ranges (for checkpoints): name -> list of flat tensors."""
        return {key: [s[key] for s in self.shards] for key in ("master", "exp_avg", "exp_avg_sq")}


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
