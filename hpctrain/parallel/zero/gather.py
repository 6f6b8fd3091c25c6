"""ZeRO-3: each rank keeps 1/dp of every unit's parameters; a unit is all-gathered over the replica group
while it runs.

A unit is what runs as one piece of a ``GPTStage`` (``stage_units``): the embedding (with learned
positions), each transformer block, the final norm with the LM head. Each unit's trainable parameters
are one bucket of ``FlatParams`` (``units=``), whose ``param_slice`` a rank keeps between steps and whose
``param_values`` (the whole unit, which every parameter's ``.data`` views) exist only while gathered:
``allocate``/``free`` give and take the storage, so the views, and the tensors autograd saved, stay valid.

The life of a unit within a step (``ParamGather``; each bucket on the group it is sharded over: the replica
group, or with expert parallelism, for the experts' buckets of an MoE block's unit, ``ep_replica``, the ranks
holding the same experts; ``FlatGroup``'s parts, ``FrozenGroup``'s):

- forward: before it runs its buckets are all-gathered (``Iallgather`` from the slices, waited here)
  and the next ``prefetch`` units' gathers are posted, so they travel while this one computes; after it
  runs it is freed (``reshard_after_forward``) unless it is the final norm + LM head (``Unit.last``:
  its backward follows), and a hook on its output marks where its backward begins;
- backward: when the gradient reaches the unit's output it is gathered again (and the previous
  ``prefetch`` units' gathers posted); ``FlatParams`` reports when a bucket's gradients of the
  micro-batch are complete (``on_backward_done``): the grads go to their reduce-scatter and the
  parameters are freed (with ``reshard_after_forward = false`` only after the step's last micro-batch:
  the unit stays gathered across the micro-batches);
- after the step's reductions (``FlatParams.finish_reduction``) nothing is gathered; the optimizer
  updates the slices.

Every rank of the replica group runs the same schedule and the same hooks, so the collectives are posted
in the same order everywhere; completions (``test``) only move a gather from posted to ready. Under
torch.compile the hooks run eagerly (``torch.compiler.disable``): a compiled block's body stays one graph.
Parameters that stay whole at zero 3 (the deferred bucket: sequence-parallel norm weights, LoRA factors
partial over tp, a tied embedding split over pp) are never gathered.

Frozen parameters (a LoRA run's base, ``frozen_slices.py``) are sharded too, in gather-only buckets
(``Unit.frozen``): gathered with their unit's forward and backward like the trainable ones, but with no
gradient to say when the backward is over. That signal is the gradient reaching the unit's input (a hook on
it: every operation of the unit that reads its weights lies between the two), or, where the input needs no
gradient (the first block after a frozen embedding), the end of the virtual stage's backward pass
(``backward_pass_done``, called by the pipeline executor).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hpctrain.parallel.buckets import Bucket, allocate, free
from hpctrain.parallel.zero.frozen_slices import FrozenGroup
from hpctrain.parallel.zero.groups import FlatGroup


@dataclass
class Unit:
    """One unit of a stage: ``entry`` runs first, ``exit`` last (their hooks bracket the unit);
    ``buckets``: the sharded buckets holding the parameters it uses (a tied LM head uses the embedding's;
    their completed gradients end its backward); ``frozen``: the gather-only buckets of its frozen ones."""
    name: str
    entry: torch.nn.Module
    exit: torch.nn.Module
    params: list
    last: bool = False
    buckets: list[Bucket] = field(default_factory=list)
    frozen: list[Bucket] = field(default_factory=list)

    @property
    def all_buckets(self) -> list[Bucket]:
        """Everything gathered while the unit runs: the trainable buckets, then the frozen ones."""
        return self.buckets + [b for b in self.frozen if b not in self.buckets]


def stage_units(stage) -> list[Unit]:
    """The units of a ``GPTStage``, in forward order: embedding (first stage), blocks, final norm + head
    (last stage; ``last``). That unit's exit is its norm: the fused head loss uses the head's weight
    without calling the module, so it stays gathered from its forward to its backward."""
    units = []
    if stage.is_first:
        modules = [stage.embed] + ([stage.pos_embed] if hasattr(stage, "pos_embed") else [])
        units.append(Unit("embed", modules[0], modules[-1], [p for m in modules for p in m.parameters()]))
    for name, block in stage.layers.items():
        units.append(Unit(f"layers.{name}", block, block, list(block.parameters())))
    if stage.is_last:
        params = list(stage.norm.parameters()) + list(stage.head.parameters())
        if all(p is not stage.head.w for p in params):  # a tied head: the embedding's weight, not registered
            params.append(stage.head.w)
        units.append(Unit("head", stage.norm, stage.norm, params, last=True))
    return units


def unit_params(stages, trainable: bool = True) -> list[list]:
    """The trainable (``trainable=False``: the frozen) parameters of each unit of ``stages`` (FlatParams'
    ``units=``, or FrozenSlices'), a shared one in its first unit only."""
    seen: set[int] = set()
    groups = []
    for stage in stages:
        for unit in stage_units(stage):
            group = [p for p in unit.params if p.requires_grad == trainable and id(p) not in seen]
            seen.update(id(p) for p in group)
            groups.append(group)
    return groups


def _eager(fn):
    """``fn`` run eagerly under torch.compile (a graph break at the unit's edge, by design)."""
    def run(*args):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn, reason="ZeRO-3 parameter gather (mpi4py)")(*args)
        return fn(*args)
    return run


class ParamGather:
    """Gathers and frees the units of ``stages`` (this rank's virtual stages) around their forward and
    backward; see the module docstring. ``flat``: the trainable parameters' buckets (with experts, theirs
    over ep_replica a part of their own); ``prefetch``: units whose gathers are posted ahead; ``frozen``:
    the frozen parameters' gather-only buckets (a group of none without frozen parameters). Buckets are
    keyed by ``index``, unique over all of them."""

    def __init__(self, flat: FlatGroup, stages, *, frozen: FrozenGroup, reshard_after_forward: bool = True,
                 prefetch: int = 1, split_backward: bool = False):
        self.flat = flat
        self.split_backward = split_backward
        groups: list[Any] = [*flat.parts, *frozen.parts]  # FlatParams and FrozenSlices: buckets sliced over dp_comm
        # bucket index -> the group it is sharded over: the replica group (dp x cp), or the experts' ep_replica
        self._comm_of = {b.index: part.dp_comm for part in groups for b in part.buckets}
        self._buckets: list[Bucket] = [b for part in groups for b in part.buckets]
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self._posted: dict[int, Any] = {}  # bucket index -> its all-gather in flight
        self._ready: set[int] = set()  # bucket indices gathered and waited
        self._in_backward: set[int] = set()  # id(unit) between its backward's start and its grads' completion
        # bucket index -> forwards of the LM head's unit whose backward has not completed the bucket's grads
        # (each micro-batch's backward completes a bucket once): a tied head keeps the embedding's bucket
        self._pinned: dict[int, int] = {}
        self.stage_units: list[list[Unit]] = []
        self._units_of: dict[int, list[Unit]] = {}  # id(stage) -> its units
        self.frozen = frozen
        self.gathers = 0  # all-gathers posted (metrics, tests)
        for stage in stages:
            units = stage_units(stage)
            for unit in units:
                unit.buckets = self._buckets_of(unit.params)
                unit.frozen = frozen.buckets_of(unit.params)
                unit.entry.register_forward_pre_hook(_eager(lambda module, args, u=unit, us=units:
                                                            self._before_forward(u, us, args)))
                unit.exit.register_forward_hook(_eager(lambda module, args, output, u=unit, us=units:
                                                       self._after_forward(u, us, output)))
            self.stage_units.append(units)
            self._units_of[id(stage)] = units
        for part in flat.parts:
            part.on_backward_done = self._backward_done

    def _buckets_of(self, params) -> list[Bucket]:
        found: list[Bucket] = []
        for p in params:
            bucket = self.flat.bucket_of.get(id(p))
            if bucket is not None and bucket.sliced and bucket not in found:
                found.append(bucket)
        return found

    # ------------------------------------------------------------- gathers
    def _post(self, bucket: Bucket) -> None:
        """Start gathering ``bucket`` unless it is gathered or on its way."""
        if bucket.index in self._posted or bucket.index in self._ready:
            return
        assert bucket.param_slice is not None  # a sharded bucket
        allocate(bucket.param_values)
        comm = self._comm_of[bucket.index]
        if comm is not None and comm.size > 1:
            self._posted[bucket.index] = comm.allgather(bucket.param_values, bucket.param_slice, nonblocking=True)
        else:
            self._posted[bucket.index] = None
            bucket.param_values.copy_(bucket.param_slice)
        self.gathers += 1

    def _wait(self, bucket: Bucket) -> None:
        self._post(bucket)
        handle = self._posted.pop(bucket.index, None)
        if handle is not None:
            with self.flat.timer.phase("zero3_wait"):
                handle.wait()
        self._ready.add(bucket.index)

    def _free(self, bucket: Bucket) -> None:
        if bucket.index in self._posted:  # never free a buffer MPI is writing
            self._wait(bucket)
        self._ready.discard(bucket.index)
        free(bucket.param_values)

    def progress(self) -> None:
        for handle in list(self._posted.values()):
            if handle is not None:
                handle.test()

    def _prefetch(self, units: list[Unit], at: int, step: int) -> None:
        for k in range(1, self.prefetch + 1):
            if 0 <= at + step * k < len(units):
                for bucket in units[at + step * k].all_buckets:
                    self._post(bucket)

    # ------------------------------------------------------------- hooks
    def _before_forward(self, unit: Unit, units: list[Unit], args) -> None:
        for bucket in unit.all_buckets:
            self._post(bucket)
        if id(unit) not in self._in_backward:  # not a recomputation inside backward
            self._prefetch(units, units.index(unit), +1)
            x = args[0] if args else None
            if (unit.frozen or self.split_backward) and torch.is_grad_enabled() and isinstance(x, torch.Tensor) \
                    and x.requires_grad:
                x.register_hook(_eager(lambda grad, u=unit: self._input_grad_ready(u)))
        for bucket in unit.all_buckets:
            self._wait(bucket)

    def _after_forward(self, unit: Unit, units: list[Unit], output) -> None:
        if id(unit) in self._in_backward:  # a recomputation (train.recompute): its backward needs it
            return
        training = torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad
        if training and not unit.last:
            output.register_hook(_eager(lambda grad, u=unit, us=units: self._before_backward(u, us)))
        if training and unit.last:
            for bucket in unit.all_buckets:
                self._pinned[bucket.index] = self._pinned.get(bucket.index, 0) + 1
        if self.reshard_after_forward and not unit.last:  # the last: its backward (or the head) follows
            for bucket in unit.all_buckets:
                if not self._pinned.get(bucket.index):
                    self._free(bucket)
        self.progress()

    def _before_backward(self, unit: Unit, units: list[Unit]) -> None:
        self._in_backward.add(id(unit))
        for bucket in unit.all_buckets:
            self._post(bucket)
        self._prefetch(units, units.index(unit), -1)
        for bucket in unit.all_buckets:
            self._wait(bucket)

    def _backward_done(self, bucket: Bucket) -> None:
        """FlatParams: ``bucket``'s gradients of this micro-batch are complete."""
        for units in self.stage_units:
            for unit in units:
                if bucket in unit.buckets:
                    self._in_backward.discard(id(unit))
        if self._pinned.get(bucket.index):
            self._pinned[bucket.index] -= 1
        gathered = bucket.index in self._ready or bucket.index in self._posted  # a zb schedule's W comes late:
        # the unit's next forward may have freed it already (its parameters: not needed by the W)
        if bucket.sliced and gathered and not self._pinned.get(bucket.index) and \
                (self.reshard_after_forward or self.flat.last_microbatch):
            self._free(bucket)
        self.progress()

    def _input_grad_ready(self, unit: Unit) -> None:
        """The gradient reached ``unit``'s input: its backward of this micro-batch is over, so its frozen
        buckets may go (the trainable ones go when their gradients are complete, ``_backward_done``; with
        ``split_backward`` now too: a zero-bubble schedule's W needs no parameter)."""
        self._in_backward.discard(id(unit))
        for bucket in unit.frozen:
            if unit.last and self._pinned.get(bucket.index):
                self._pinned[bucket.index] -= 1
            self._release_frozen(bucket)
        for bucket in unit.buckets if self.split_backward else []:
            self._release_frozen(bucket)
        self.progress()

    def _release_frozen(self, bucket: Bucket) -> None:
        """Free ``bucket`` if gathered, unpinned, and resharded after use (or this is the last micro-batch)."""
        gathered = bucket.index in self._ready or bucket.index in self._posted
        if gathered and not self._pinned.get(bucket.index) and \
                (self.reshard_after_forward or self.flat.last_microbatch):
            self._free(bucket)

    def backward_pass_done(self, stage) -> None:
        """The pipeline executor: a micro-batch's backward through virtual stage ``stage`` returned. Frozen
        buckets no input gradient released (a unit whose input needs none) go now; with ``split_backward`` (a
        zero-bubble schedule's B: its W needs no parameter, only the linears' inputs and output gradients) the
        trainable ones too, unless pinned (the LM head's, until its W)."""
        for unit in self._units_of.get(id(stage), []):
            self._in_backward.discard(id(unit))
            for bucket in unit.frozen:
                self._release_frozen(bucket)
            for bucket in unit.buckets if self.split_backward else []:
                self._release_frozen(bucket)  # the same rule: gathered, not pinned, resharded (or the last)

    def release_all(self) -> None:
        """Free every gathered unit (after a step's reductions, after an evaluation)."""
        self._in_backward.clear()
        self._pinned.clear()
        for bucket in self._buckets:
            if bucket.sliced and (bucket.index in self._ready or bucket.index in self._posted):
                self._free(bucket)
