"""The split backward of the zero-bubble schedules (``zero_bubble.py``): B, the input gradient, now; W, the
weight gradients, later (Qi et al.'s WeightGradStore; Megatron's delayed weight-gradient computation).

A ``WeightGradStore`` belongs to the pipeline executor that runs a zb schedule (``PipelineExecutor``), which
hands it to the tensor-parallel linears of its stages (``attach``: ``ColumnParallelLinear`` and
``RowParallelLinear`` then run ``deferrable_linear``). Inside ``store.deferring(key)`` (key = (micro-batch,
c), the executor's B) such a linear's backward computes only dL/dx and queues (x, dy) for dL/dW = dy^T x: no
communication (under tp and SP, x is the linear's own, already gathered, input). The executor's B asks
autograd for the input gradient and the other trainable parameters' gradients (norms, embeddings, LoRA
factors, experts: ``torch.autograd.grad``, nothing accumulated) and ``keep``s those; its W (``run``) computes
the queued weight gradients and hands every gradient of that (micro-batch, c) to autograd's accumulation (one
backward through ``_Deliver``, a node whose gradients are the ones held here), exactly where a full backward
would have put them: ``param.grad`` and its post-accumulate hooks, i.e. ``FlatParams``' main-grad accumulation
and bucket reduction. So a bucket is reduced after its last W, and ZeRO-2's per-micro-batch reduce-scatter sees
one whole micro-batch at a time. Its weight gradients need neither the weights nor communication: ZeRO-3
releases a unit once its B has passed it (``zero.gather.ParamGather``, ``split_backward``).

A W is deferred, never lost: ``check_drained`` raises naming every (micro-batch, c) whose W did not run.
Outside ``deferring`` a ``deferrable_linear`` is an ordinary linear (evaluation, a full backward).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

Key = tuple[int, int]  # (micro-batch, c)


class WeightGradStore:
    """Per (micro-batch, c): the queued (weight, x, dy) of the deferring linears and the kept (param, grad) of
    the rest, until that key's W. Local to this rank: no communication."""

    def __init__(self) -> None:
        self._key: Key | None = None
        self._queued: dict[Key, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._kept: dict[Key, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @contextmanager
    def deferring(self, key: Key) -> Iterator[None]:
        """The B of ``key``: linears queue their weight gradients under it."""
        assert self._key is None and key not in self._queued, f"B of {key} twice, or inside another"
        self._key, self._queued[key] = key, []
        try:
            yield
        finally:
            self._key = None

    @property
    def active(self) -> bool:
        return self._key is not None

    def put(self, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
        """A linear's backward under ``deferring``: ``weight`` [out, in] (the parameter), x [..., in], dy [..., out]."""
        assert self._key is not None
        self._queued[self._key].append((weight, x, dy))

    def keep(self, key: Key, params: list, grads: tuple) -> None:
        """The B of ``key`` computed these gradients (None: the parameter took no part); accumulated at its W."""
        self._kept[key] = [(p, g) for p, g in zip(params, grads) if g is not None]

    def run(self, key: Key) -> None:
        """The W of ``key``: every queued weight gradient computed, then every gradient of ``key`` accumulated
        by autograd (one backward: ``param.grad`` and its post-accumulate hooks, as a full backward would;
        through ``_Deliver``, so that autograd takes the gradients over instead of copying them)."""
        params, holder = self._gradients(key)
        if params:
            torch.autograd.backward(_Deliver.apply(holder, *params))

    def _gradients(self, key: Key) -> tuple[list, list]:
        """(parameters, [their gradients of ``key``]): the queue's and the kept ones, a parameter's summed; the
        store keeps no reference to them (the inputs and output gradients of the linears are dropped)."""
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, x, dy in self._queued.pop(key):
            g = weight_grad(x, dy)
            if id(weight) in grads:  # a weight used twice in one micro-batch: summed, accumulated once
                g = grads[id(weight)][1] + g
            grads[id(weight)] = (weight, g)
        for p, g in self._kept.pop(key, []):
            grads[id(p)] = (p, g if id(p) not in grads else grads[id(p)][1] + g)
        return [p for p, _ in grads.values()], [[g for _, g in grads.values()]]

    def held(self) -> list:
        """What the pending Ws keep alive: each queued (weight, x, dy) and kept (param, grad); for metering."""
        return [*self._queued.values(), *self._kept.values()]

    def clear(self) -> None:
        """Forget everything (a step begins: what an interrupted one left is not this step's)."""
        self._key = None
        self._queued.clear()
        self._kept.clear()

    def pending(self) -> list[Key]:
        """The keys whose B ran and W did not."""
        return sorted(set(self._queued) | set(self._kept))

    def check_drained(self) -> None:
        """Raises if a W is missing (a weight gradient would be lost at the update)."""
        missing = self.pending()
        if missing:
            raise RuntimeError(f"zero-bubble schedule: the weight gradients of (micro-batch, c) {missing} were "
                               f"never accumulated (their W did not run)")


class _Deliver(torch.autograd.Function):
    """A node whose backward hands ``holder``'s one list of gradients to ``params``' accumulation. Autograd
    steals a gradient that nothing else references (``torch.autograd.backward(params, grads)`` cannot: the
    caller's list holds them), so the W writes no copy of a weight gradient."""

    @staticmethod
    def forward(ctx, holder, *params):  # type: ignore[override]  # autograd.Function: (ctx, *inputs)
        ctx.holder = holder
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]  # autograd.Function: (ctx, *inputs)
        return (None, *ctx.holder.pop())


def weight_grad(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dL/dW [out, in] of y = x W^T from x [..., in] and dy [..., out]."""
    return dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _DeferrableLinear(torch.autograd.Function):
    """y = x W^T whose weight gradient goes to ``store`` while it is ``deferring``."""

    @staticmethod
    def forward(ctx, x, weight, store):  # type: ignore[override]  # autograd.Function: (ctx, *inputs)
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.weight = store, weight  # the parameter itself: its gradient is accumulated at the W
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]  # autograd.Function: (ctx, *inputs)
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if ctx.store.active:
                ctx.store.put(ctx.weight, x, dy)
            else:
                dw = weight_grad(x, dy)
        return dx, dw, None


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore) -> torch.Tensor:
    """F.linear(x, weight) whose weight gradient ``store`` defers to the W while it is ``deferring``. Under
    torch.compile it runs eagerly (a graph break by design): a traced backward would fix at compile time
    whether it defers (it would never: nothing defers while a forward is traced)."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_DeferrableLinear.apply, reason="zero-bubble deferred weight gradient")(
            x, weight, store)
    return _DeferrableLinear.apply(x, weight, store)


def attach(modules, store: WeightGradStore | None) -> int:
    """Give ``store`` to every linear of ``modules`` that can defer its weight gradient (those with an
    attribute ``weight_grads``: the tensor-parallel linears); returns how many. ``store`` None detaches."""
    count = 0
    for module in modules:
        for sub in module.modules():
            if hasattr(sub, "weight_grads"):
                sub.weight_grads = store
                count += 1
    return count
