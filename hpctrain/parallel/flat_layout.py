"""How one gradient group's parameters lie in flat buffers: buckets in backward order, and the storage behind
them at each ZeRO stage (``FlatParams``, data_parallel.py, builds both once, at construction).

Buckets hold about ``bucket_mb`` each, in reverse parameter order (the order backward produces gradients),
each padded to a multiple of dp; at ZeRO-3 one bucket per unit (zero/gather.py). The parameters whose
gradient needs a reduction over another group first (``SlabSpec.partial_grad_over_tp``, a tied embedding's
copy: pre_reduce.py) go to a last, deferred bucket.
"""
from __future__ import annotations

import torch

from hpctrain.parallel.buckets import Bucket, free


def make_buckets(params: list, dp_size: int, bucket_elems: float, units: list[list] | None,
                 first_index: int = 0) -> list[Bucket]:
    """Buckets of ``params`` in backward order: by size (``bucket_elems``), or one per unit (zero 3: ``units``,
    in forward order); then the deferred bucket. Indices start at ``first_index``."""
    def needs_pre_reduction(p):
        return p.spec.partial_grad_over_tp or bool(p.spec.tied)

    ordered = list(reversed(params))
    regular = [p for p in ordered if not needs_pre_reduction(p)]
    # the grads partial over tp first: one contiguous span, summed by one all-reduce (pre_reduce.py)
    deferred = sorted((p for p in ordered if needs_pre_reduction(p)), key=lambda p: not p.spec.partial_grad_over_tp)
    groups: list[tuple[list, bool]] = []
    if units is not None:
        taken = {id(p) for p in regular}
        for unit in reversed(units):
            members = [p for p in reversed(unit) if id(p) in taken]
            taken -= {id(p) for p in members}
            if members:
                groups.append((members, False))
        if taken:
            raise ValueError(f"zero 3: {len(taken)} trainable parameter(s) belong to no unit")
    else:
        current: list = []
        for p in regular:
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_elems:
                groups.append((current, False))
                current = []
        if current:
            groups.append((current, False))
    if deferred:
        groups.append((deferred, True))
    buckets: list[Bucket] = []
    start = 0
    for members, is_deferred in groups:
        n = sum(p.numel() for p in members)
        padded = -(-n // dp_size) * dp_size
        buckets.append(Bucket(start, start + padded, members, is_deferred, index=first_index + len(buckets)))
        start += padded
    return buckets


def make_storage(buckets: list[Bucket], dp: int, zero: int, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers behind every bucket's ``param_values``, ``grads``, ``param_slice`` and the gradient slices
    (see ``Bucket``), set on the buckets; returns (``param_buffer``, ``grad_buffer``).

    ``param_buffer``: the parameter values this rank keeps between steps: every bucket at zero <= 2; at zero 3
    the parameter slices of the sliced buckets, then the deferred bucket whole. ``grad_buffer``: every bucket's
    main grads at zero <= 1; at zero >= 2 empty (each bucket's ``grads`` is its own)."""
    kept = sum(b.size // dp if zero == 3 and not b.deferred else b.size for b in buckets)
    param_buffer = torch.zeros(kept, dtype=param_dtype, device=device)
    total = buckets[-1].end if buckets else 0
    grad_buffer = torch.zeros(total if zero <= 1 else 0, dtype=grad_dtype, device=device)
    at = 0
    for b in buckets:
        if zero == 3 and not b.deferred:  # the whole unit: storage only while gathered (``place_params``)
            b.param_slice = param_buffer[at:at + b.size // dp]
            b.param_values = torch.empty(b.size, dtype=param_dtype, device=device)
            free(b.param_values)
            at += b.size // dp
        else:
            b.param_values = param_buffer[at:at + b.size] if zero == 3 else param_buffer[b.start:b.end]
            at += b.size if zero == 3 else 0
        per_microbatch = zero >= 2 and not b.deferred  # storage only while a micro-batch's grads are there
        b.grads = grad_buffer[b.start:b.end] if zero <= 1 else \
            (torch.empty if per_microbatch else torch.zeros)(b.size, dtype=grad_dtype, device=device)
        if zero:
            b.slice_grad = b.slice_out = torch.zeros(b.size // dp, dtype=grad_dtype, device=device)
        if per_microbatch:
            b.incoming = torch.empty(b.size // dp, dtype=grad_dtype, device=device)
            free(b.grads)  # a whole stage's gradients are never held at once
            free(b.incoming)
    return param_buffer, grad_buffer
