"""Every parameter of a Trainer at its GLOBAL shape on world rank 0: what the fidelity scripts compare with a
one-process reference (a test's view of the model; training and checkpoints never need it)."""
from __future__ import annotations

import torch


def global_parameters(trainer) -> dict | None:
    """Collective over the world: {name: float64 tensor at the global shape} on world rank 0 (None elsewhere).

    Built from the slab specs: tp slabs (their real rows) are placed at their slices; each dp x cp replica
    holds the same values, so only replica rank 0 contributes; the tied copy is skipped."""
    with trainer.parts.params.gathered():  # ZeRO-3: the units (trainable and frozen) gathered over the replica group meanwhile
        return _global_parameters(trainer)


def _global_parameters(trainer) -> dict | None:
    grid, pieces = trainer.grid, []
    first_replica = grid.coords["dp"] == 0 and grid.coords["cp"] == 0
    first_holder = first_replica if trainer.parts.layout.ep_size == 1 else grid.comm("ep_replica").rank == 0
    if first_holder:  # experts split over ep: the first replica holding them; the rest: replica 0
        for p in trainer.parts.local_model.parameters():
            spec = p.spec  # the SlabSpec hpctrain attaches (parallel/slab.py)
            if not spec.tied_copy and (first_replica or spec.experts is not None):
                index = [(s.start, s.stop) for s in spec.local_slices()]
                real = p.detach()[spec.valid_local()]  # without vocabulary padding rows
                pieces.append((spec.name, spec.global_shape, index, real.to("cpu", torch.float64, copy=True).numpy()))
    gathered = grid.world.gather_object(pieces, root=0)
    if gathered is None:
        return None
    result: dict[str, torch.Tensor] = {}
    for rank_pieces in gathered:
        for name, shape, index, array in rank_pieces:
            full = result.setdefault(name, torch.full(shape, float("nan"), dtype=torch.float64))
            full[tuple(slice(a, b) for a, b in index)] = torch.from_numpy(array)
    return result
