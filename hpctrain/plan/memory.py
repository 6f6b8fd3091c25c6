"""Memory per rank of a layout: parameters, gradients, optimizer state, activations (GiB, 2**30 bytes).

Per rank of pipeline stage ``s`` holding ``P`` parameters (stages.stage_parameters), hpctrain's flat
buffers (hpctrain/parallel/data_parallel.py, hpctrain/optim/flat.py):

- parameters: ``P x dtype bytes``;
- gradients: ``P x 4`` (float32 main grads; ``x 8`` in float64), plus with ZeRO-1 the reduced slice
  ``P x 4 / dp``;
- optimizer (AdamW): two moments in float32 (``8 P``; ``16 P`` in float64), plus float32 master weights
  (``4 P``) in 16-bit training; ZeRO-1 divides all of it by dp. So 18 bytes per parameter in bf16
  without ZeRO (2 + 4 + 8 + 4), as in Megatron-LM;
- activations: each block keeps ``layer_activation_bytes`` (Korthikanti et al.'s formula) per micro-batch
  in flight, or only its input (``2 s b h``, ``/ t`` with SP) with full recomputation plus, during a
  backward, one block's full activations; micro-batches in flight: ``min(pp - s, M)`` for 1F1B, ``M``
  for GPipe; the last stage adds the logits of a micro-batch in flight and their float32 loss copy,
  ``s b V / t x (dtype bytes + 4)`` (``V``: the padded vocabulary; ``memory`` pads the model with ``shapes.for_tp``);
- reserve: ``Options.reserve_gib`` (runtime context, communication buffers, fragmentation).

The layout needs the maximum over its stages.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan.devices import DTYPE_BYTES
from hpctrain.plan.shapes import for_tp
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
    nb, t, b, seq = DTYPE_BYTES[options.dtype], layout.tp_size, layout.micro_batch, layout.seq_len
    sp, kind = layout.sequence_parallel, recompute_kind(recompute)
    full = layer_activation_bytes(model, b, seq, t, sp, options.flash_attention, nb)
    held = stage.layers * in_flight(layout, stage, options.virtual_stages)
    if kind == "full":
        kept = held * recompute_layer_bytes(model, b, seq, t, sp, nb) + full
    elif kind == "selective":
        kept = held * layer_activation_bytes(model, b, seq, t, sp, True, nb) + full
    else:
        kept = held * full
    if stage.last:
        logits_in_flight = layout.microbatches if layout.schedule == "gpipe" else 1
        kept += seq * b * model.vocab_size / t * (nb + 4) * logits_in_flight
    return kept


def memory(model, layout, recompute, options) -> Memory:
    """Memory per rank of ``layout`` (validated) for ``model`` (its vocabulary padded for the layout's tp
    here): the stage that needs the most."""
    model = for_tp(model, layout.tp_size)
    nb, d = DTYPE_BYTES[options.dtype], layout.dp_size
    zero_split = d if layout.zero == 1 else 1
    best, seen = None, set()
    for st in stages(model, layout):
        if (st.layers, st.first, st.last) in seen:
            continue  # a later stage of the same kind holds fewer micro-batches
        seen.add((st.layers, st.first, st.last))
        n = stage_parameters(model, st, layout.tp_size)
        grads = n * max(4, nb) + (n * 4 / d if layout.zero == 1 else 0.0)
        m = Memory(n * nb / GIB, grads / GIB, n * optimizer_bytes_per_param(options.dtype) / zero_split / GIB,
                   activation_bytes(model, layout, st, recompute, options) / GIB, options.reserve_gib, st.index)
        if best is None or m.total_gib > best.total_gib:
            best = m
    return best
