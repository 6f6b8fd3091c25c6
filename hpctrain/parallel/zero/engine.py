"""The parameter engine: the one owner of where this rank's parameter bytes live.

``build_param_engine`` turns this rank's stages (built on the meta device, parameters without storage) into
a ``ParamEngine``, the only place that knows the containers behind them:

- ``flat``: the trainable parameters' flat buffers and gradient reducer (``FlatParams``, data_parallel.py),
  the dense ones over the replica group (dp x cp) and, with expert parallelism, the experts' over
  ``ep_replica``, behind one ``FlatGroup`` (groups.py); each sliced by ``parallel.zero`` over its group;
- ``frozen``: at ZeRO-3 the frozen parameters (a LoRA run's base) in gather-only buckets, the same two groups
  (frozen_slices.py; a group of none otherwise: below ZeRO-3 the base is whole on every replica);
- ``gather``: at ZeRO-3 the ``ParamGather`` that gathers each unit around its forward and backward
  (gather.py), else None.

Everything above asks the engine, never the containers: the step (``reducer``, ``release``,
``after_backward``), a read of the whole model between steps (``gathered``), the checkpoint (``sliced``,
``writes``, ``flat``'s and ``frozen``'s pieces) and the metrics (``memory_bytes``). The optimizer over
``flat``'s owned slices is ``hpctrain.optim.group.build_optimizer``'s (the optimizer layer sits above this one).

Words (docs/architecture.md, glossary): a **slice** is a rank's part of a flat range; a **shard** is a
checkpoint file, never a rank's part of a parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from hpctrain.compression import build_reducer
from hpctrain.parallel.buckets import all_gathered
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.param_init import materialize_
from hpctrain.parallel.zero.frozen_slices import FrozenGroup, FrozenSlices
from hpctrain.parallel.zero.gather import ParamGather, unit_params
from hpctrain.parallel.zero.groups import FlatGroup
from hpctrain.parallel.zero_bubble import ZERO_BUBBLE_SCHEDULES


@dataclass
class ParamEngine:
    """Where this rank's parameter bytes live (see the module docstring). ``whole_frozen``: the frozen
    parameters kept whole on this rank (below ZeRO-3), counted in ``memory_bytes``."""
    flat: FlatGroup
    frozen: FrozenGroup
    gather: ParamGather | None
    whole_frozen: list[torch.nn.Parameter]

    @property
    def reducer(self):
        """The dense group's gradient reducer (the experts' are dense all-reduces or reduce-scatters)."""
        return self.flat.reducer

    @property
    def after_backward(self):
        """What the pipeline executor calls when a micro-batch's backward through a virtual stage returned
        (ZeRO-3: frozen units released, a split backward's units too), or None."""
        return self.gather.backward_pass_done if self.gather is not None else None

    def release(self) -> None:
        """Free every gathered unit (after a step's reductions, after an evaluation); nothing below ZeRO-3."""
        if self.gather is not None:
            self.gather.release_all()

    def gathered(self):
        """Collective over each group: the whole local model readable between steps (ZeRO-3's trainable and
        frozen units gathered, freed on exit; nothing to do below ZeRO-3)."""
        return all_gathered([self.flat, self.frozen])

    def sliced(self, p) -> bool:
        """Whether parameter ``p`` lives only as this rank's slices between steps (ZeRO-3's units): read and
        written through the pieces (``flat``'s owned ranges, ``frozen.pieces()``), never through ``p.data``."""
        bucket = self.flat.bucket_of.get(id(p))
        if bucket is None:
            bucket = self.frozen.bucket_of.get(id(p))
        return bucket is not None and bucket.sliced

    def writes(self, p, first_replica: bool) -> bool:
        """Whether this rank writes trainable ``p``'s pieces it owns (``FlatGroup.writes``)."""
        return self.flat.writes(p, first_replica)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's parameter and gradient bytes kept between steps: {"params", "grads"}; the frozen base's
        (its slices at ZeRO-3, else its whole tensors) counts as parameters."""
        kept = self.flat.memory_bytes()
        frozen = self.frozen.memory_bytes() + sum(p.nbytes for p in self.whole_frozen)
        return {"params": kept["params"] + frozen, "grads": kept["grads"]}


def build_param_engine(stages, local_model: torch.nn.Module, grid, layout, cfg, *, device: torch.device,
                       dtype: torch.dtype, timer) -> ParamEngine:
    """This rank's ``ParamEngine`` for ``stages`` (``local_model``: all of them, parameters on ``device``
    without storage; each container draws or places the bytes it keeps). Collective over nothing; the
    reducers' persistent requests are made over the replica group and ``ep_replica``. ``grid``: its ``comm``
    by axis and ``coords``; ``layout``: the validated ``Layout``; ``cfg``: the whole config."""
    t, comp = cfg.train, cfg.compression
    tp_comm, pp_comm = grid.comm("tp"), grid.comm("pp")
    # the trainable parameters (a LoRA run's adapters); with expert parallelism the experts are a group of
    # their own, summed over the replicas holding the same ones
    trainable = [p for p in local_model.parameters() if p.requires_grad]
    is_expert = [getattr(p, "spec").experts is not None for p in trainable]  # the SlabSpec (parallel/slab.py)
    units = unit_params(stages) if layout.zero == 3 else None  # each FlatParams takes its own members of each unit
    common = dict(tp_comm=tp_comm, pp_comm=pp_comm, bucket_mb=cfg.parallel.bucket_mb, zero=layout.zero, units=units,
                  timer=timer, check_finite=dtype == torch.float16)
    parts = [FlatParams([p for p, e in zip(trainable, is_expert) if not e], grid.comm(grid.replica_axis), **common,
                        make_reducer=partial(build_reducer, comp, grid=grid, seed=t.seed, optimizer=cfg.optim.name,
                                             steps=t.steps))]
    if any(is_expert):  # (validation refused compression with parallel.ep > 1) sliced over ep_replica at zero >= 1
        parts.append(FlatParams([p for p, e in zip(trainable, is_expert) if e], grid.comm("ep_replica"), **common,
                                first_index=len(parts[0].buckets)))
    flat = FlatGroup(parts)
    frozen_params = [p for p in local_model.parameters() if not p.requires_grad]
    if layout.zero == 3 and frozen_params:  # the frozen base sliced too, in gather-only buckets after the trainable ones
        frozen = _frozen_slices(stages, frozen_params, grid, first_index=flat.buckets[-1].index + 1)
        whole: list[torch.nn.Parameter] = []
    else:
        materialize_(frozen_params, device)  # below zero 3 a frozen base is whole on every replica
        frozen, whole = FrozenGroup([]), frozen_params
    gather = ParamGather(flat, stages, frozen=frozen, reshard_after_forward=cfg.parallel.zero_reshard_after_forward,
                         prefetch=cfg.parallel.zero_prefetch,
                         split_backward=layout.schedule in ZERO_BUBBLE_SCHEDULES) if layout.zero == 3 else None
    return ParamEngine(flat, frozen, gather, whole)


def _frozen_slices(stages, frozen_params: list, grid, first_index: int) -> FrozenGroup:
    """ZeRO-3's frozen parameters, unit by unit: the dense ones sliced over the replica group, the experts'
    over ``ep_replica``."""
    frozen_units = unit_params(stages, trainable=False)
    if sum(map(len, frozen_units)) != len(frozen_params):
        raise ValueError("zero 3: a frozen parameter belongs to no unit")
    dense = FrozenSlices([[p for p in u if getattr(p, "spec").experts is None] for u in frozen_units],
                         grid.comm(grid.replica_axis), first_index=first_index)
    experts = [[p for p in u if getattr(p, "spec").experts is not None] for u in frozen_units]
    if not any(experts):
        return FrozenGroup([dense])
    return FrozenGroup([dense, FrozenSlices(experts, grid.comm("ep_replica"),
                                            first_index=first_index + len(dense.buckets))])
