"""Memory per rank of a layout: parameters, gradients, optimizer state, activations (GiB, 2**30 bytes).

Per rank of pipeline stage ``s`` holding ``P`` parameters (stages.stage_parameters), hpctrain's flat
buffers (hpctrain/parallel/data_parallel.py, hpctrain/optim/flat.py):

- parameters: ``P x dtype bytes``;
- gradients: ``P x 4`` (float32 main grads; ``x 8`` in float64), plus with ZeRO-1 the reduced slice
  ``P x 4 / dp``;
- optimizer (AdamW): two moments in float32 (``8 P``; ``16 P`` in float64), plus float32 master weights
  (``4 P``) in 16-bit training; ZeRO-1 divides all of it by dp. So 18 bytes per parameter in bf16
  without ZeRO (2 + 4 + 8 + 4), as in Megatron-LM. With context parallelism every "dp" here is ``dp x
  cp``: the cp ranks of a replica hold the same parameters, their gradients are reduced over the grid's
  dp_cp group and ZeRO shards over it;
- ZeRO-2 and ZeRO-3 / FSDP (PLANNER ONLY: hpctrain's engine trains with zero 0 or 1): ZeRO-2 also
  divides the float32 gradients by dp (``P x 4 / dp``, reduce-scattered bucket by bucket); ZeRO-3 also
  divides the parameters (``P x dtype / dp``) and adds the gathered FSDP units in flight: TWO units'
  full parameters in the dtype (the one computing and the one prefetched, FSDP's backward prefetch)
  plus ONE unit's full float32 gradient before its reduce-scatter. A unit (``fsdp_unit_parameters``) is
  the largest of a block (per tp rank) and, on the first / last stage, the embedding / LM head rows
  per tp rank. Parameters are resharded after every use (FSDP's ``reshard_after_forward=True``: the
  least memory; cost.py charges the matching all-gathers per micro-batch);
- activations: each block keeps ``layer_activation_bytes`` (Korthikanti et al.'s formula) per micro-batch
  in flight, or only its input (``2 s b h``, ``/ t`` with SP) with full recomputation plus, during a
  backward, one block's full activations; micro-batches in flight: ``min(pp - s, M)`` for 1F1B, ``M``
  for GPipe; the last stage adds the logits of a micro-batch in flight and their float32 loss copy,
  ``s b V / t x (dtype bytes + 4)`` (``V``: the padded vocabulary; ``memory`` pads the model with ``shapes.for_tp``);
- context parallelism (cp): each cp rank holds ``s = S / cp`` tokens of every micro-batch, so every term
  above is taken at ``S / cp`` (activations and logits fall as ``1 / cp``); ring attention keeps no score
  matrix (its scores live per block of at most 1024 x 1024, recomputed in the backward) whatever
  ``flash_attention`` says, adds a float32 log-sum-exp per query and head per layer, and one layer's ring
  working set at the peak (``ring.ring_workspace_bytes``);
- reserve: ``Options.reserve_gib`` (runtime context, communication buffers, fragmentation).

The layout needs the maximum over its stages.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan.devices import DTYPE_BYTES
from hpctrain.plan.ring import lse_bytes, ring_workspace_bytes
from hpctrain.plan.shapes import block_matmul_params, for_tp
from hpctrain.plan.stages import (in_flight, layer_activation_bytes, recompute_kind, recompute_layer_bytes,
                                  stage_parameters, stages)

GIB = 2**30


@dataclass(frozen=True)
class Memory:
    """GiB on one rank of the heaviest stage (``stage``)."""

    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    reserve_gib: float
    stage: int

    @property
    def total_gib(self) -> float:
        return self.params_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.reserve_gib

    def breakdown(self) -> dict[str, float]:
        return {"params": self.params_gib, "grads": self.grads_gib, "optimizer": self.optimizer_gib,
                "activations": self.activations_gib, "reserve": self.reserve_gib}


def optimizer_bytes_per_param(dtype: str) -> int:
    """AdamW state bytes per parameter: two moments (float32, float64 for float64) + float32 master weights
    for 16-bit training."""
    nb = DTYPE_BYTES[dtype]
    return 2 * max(4, nb) + (4 if nb == 2 else 0)


def activation_bytes(model, layout, stage, recompute, options) -> float:
    """Bytes of activations one rank of ``stage`` holds at its peak (see the module docstring)."""
    nb, t, b, c = DTYPE_BYTES[options.dtype], layout.tp_size, layout.micro_batch, layout.cp_size
    seq = layout.seq_len // c  # the tokens of a sequence on this rank
    sp, kind = layout.sequence_parallel, recompute_kind(recompute)
    ring = lse_bytes(model, b, layout.seq_len, c, t, nb)
    full = layer_activation_bytes(model, b, seq, t, sp, options.flash_attention or c > 1, nb) + ring
    held = stage.layers * in_flight(layout, stage, options.virtual_stages)
    if kind == "full":
        kept = held * recompute_layer_bytes(model, b, seq, t, sp, nb) + full
    elif kind == "selective":
        kept = held * (layer_activation_bytes(model, b, seq, t, sp, True, nb) + ring) + full
    else:
        kept = held * full
    kept += ring_workspace_bytes(model, b, layout.seq_len, c, t, nb)
    if stage.last:
        logits_in_flight = layout.microbatches if layout.schedule == "gpipe" else 1
        kept += seq * b * model.vocab_size / t * (nb + 4) * logits_in_flight
    return kept


def fsdp_unit_parameters(model, stage, tp: int) -> int:
    """Parameters of the largest ZeRO-3 / FSDP unit on one tp rank of ``stage``: a block, or the
    embedding (first stage) / LM head (last stage) rows ``V h / t`` (``model``'s vocabulary as given)."""
    block = block_matmul_params(model) // tp + 2 * model.d_model if stage.layers else 0
    ends = model.vocab_size * model.d_model // tp if (stage.first or stage.last) else 0
    return max(block, ends)


def state_bytes(model, stage, layout, dtype: str) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes on one rank of ``stage`` for ``layout.zero`` 0-3 (module
    docstring); the dp x cp group shards them."""
    nb, d, t = DTYPE_BYTES[dtype], layout.replica_size, layout.tp_size
    n, zero, gb = stage_parameters(model, stage, t), layout.zero, max(4, DTYPE_BYTES[dtype])
    params = n * nb
    grads = n * gb + (n * 4 / d if zero == 1 else 0.0)
    optimizer = n * optimizer_bytes_per_param(dtype) / (d if zero >= 1 else 1)
    if zero >= 2:
        grads = n * gb / d
    if zero >= 3:
        unit = fsdp_unit_parameters(model, stage, t)
        params = n * nb / d + 2 * unit * nb
        grads += unit * gb
    return params, grads, optimizer


def memory(model, layout, recompute, options) -> Memory:
    """Memory per rank of ``layout`` (validated) for ``model`` (its vocabulary padded for the layout's tp
    here): the stage that needs the most."""
    model = for_tp(model, layout.tp_size)
    best, seen = None, set()
    for st in stages(model, layout):
        if (st.layers, st.first, st.last) in seen:
            continue  # a later stage of the same kind holds fewer micro-batches
        seen.add((st.layers, st.first, st.last))
        params, grads, optimizer = state_bytes(model, st, layout, options.dtype)
        m = Memory(params / GIB, grads / GIB, optimizer / GIB,
                   activation_bytes(model, layout, st, recompute, options) / GIB, options.reserve_gib, st.index)
        if best is None or m.total_gib > best.total_gib:
            best = m
    assert best is not None  # a layout has at least one stage
    return best
