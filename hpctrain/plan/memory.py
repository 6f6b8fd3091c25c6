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
- ZeRO-2 and ZeRO-3, as hpctrain's engine runs them (hpctrain/parallel/data_parallel.py, zero/gather.py;
  ``whole_parameters``: a tied embedding split over pp stays whole in the "deferred" bucket, its
  gradients whole and, at zero 3, its parameters too). ZeRO-2 reduce-scatters every micro-batch's
  gradients bucket by bucket into each rank's slice (``P x 4 / dp``) and frees a bucket's full gradients
  once its reduce-scatter is done: TWO buckets (``Options.bucket_mb``: one filling, one on the wire) at
  the peak instead of ``P x 4``. ZeRO-3 also keeps only ``1 / dp`` of the parameters of every unit
  (``zero3_units``: the embedding with learned positions, each block, the final norm + LM head, per tp
  rank and virtual stage; a tied head with one stage gathers the embedding's bucket) and adds the
  units gathered at once (``gathered_parameters``), in the dtype: with ``zero_reshard_after_forward``
  the running unit and the ``zero_prefetch`` next (previous, in backward) units of its virtual stage,
  plus the LM head's unit while another micro-batch's backward is pending (it stays gathered from its
  forward to its backward: GPipe's last stage) or while it pins a tied embedding (one stage: until the
  end of the backward), plus ONE unit's full gradient before its reduce-scatter
  (float32 for half models); without resharding every unit of the stage stays gathered from the step's
  first forward to its last backward;
- activations: each block keeps ``block_activation_bytes`` (what hpctrain's blocks save; Korthikanti et al.'s
  ``layer_activation_bytes`` for Megatron's, ``Options.megatron_activations``) per micro-batch
  in flight, or only its input (``2 s b h``, ``/ t`` with SP) with full recomputation plus, during a
  backward, one block's full activations; micro-batches in flight: ``min(pp - s, M)`` for 1F1B, ``M``
  for GPipe; the last stage adds the logits of a micro-batch in flight and their float32 loss copy,
  ``s b V / t x (dtype bytes + 4)`` (``V``: the padded vocabulary; ``memory`` pads the model with ``shapes.for_tp``);
- context parallelism (cp): each cp rank holds ``s = S / cp`` tokens of every micro-batch, so every term
  above is taken at ``S / cp`` (activations and logits fall as ``1 / cp``); ring attention keeps no score
  matrix (its scores live per block of at most 1024 x 1024, recomputed in the backward) whatever
  ``flash_attention`` says, adds a float32 log-sum-exp per query and head per layer, and one layer's ring
  working set at the peak (``ring.ring_workspace_bytes``);
- mixture of experts (``moe``, resolved; ``layout.ep_size``): an MoE block holds its attention, router and
  shared experts like a dense block and ``num_experts / ep`` routed experts (``stages.stage_parameters``);
  the experts' gradients and optimizer state are sharded by ZeRO over the ``dp x cp / ep`` ranks that hold
  the same experts, the rest over dp x cp (``sharded``); at zero 3 a block's unit gathers both (its
  experts a bucket of their own). Its activations add ``stages.moe_activation_bytes`` (the routed copies'
  SwiGLUs in place of the dense MLP's). With MoE blocks only on some layers the stage's MoE blocks are
  taken to come first (ZeRO-3's gathered window: the heaviest units side by side);
- LoRA (``Options.lora_rank`` > 0, dense models; lora.py): the base parameters stay (in the dtype, sharded at
  zero 3), without gradients, optimizer state or masters; the adapters' parameters, gradients and AdamW
  state follow zero 0-3 as above (``lora_state_bytes``), except that with tp > 1 the factors whose gradients
  are partial over tp stay whole at zero >= 2; at zero 3 each block's unit also gathers its sharded
  adapters. The adapters' activations (``r`` wide) and, with ``lora.dropout``, the dropped inputs they keep
  are not counted;
- reserve: ``Options.reserve_gib`` (runtime context, communication buffers, fragmentation).

The layout needs the maximum over its stages.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.arithmetic import moe_rank_parameters
from hpctrain.plan.devices import DTYPE_BYTES
from hpctrain.plan.lora import block_adapter_parameters, partial_adapter_parameters
from hpctrain.plan.ring import lse_bytes, ring_workspace_bytes
from hpctrain.plan.shapes import block_matmul_params, for_tp, position_params
from hpctrain.plan.stages import (block_activation_bytes, deferred_weight_bytes, in_flight, layer_activation_bytes,
                                  moe_activation_bytes, recompute_kind, recompute_layer_bytes, stage_expert_parameters,
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


def activation_bytes(model, layout, stage, recompute, options, moe=None) -> float:
    """Bytes of activations one rank of ``stage`` holds at its peak (see the module docstring)."""
    nb, t, b, c = DTYPE_BYTES[options.dtype], layout.tp_size, layout.micro_batch, layout.cp_size
    seq = layout.seq_len // c  # the tokens of a sequence on this rank
    sp, kind = layout.sequence_parallel, recompute_kind(recompute)
    ring = lse_bytes(model, b, layout.seq_len, c, t, nb)
    block = layer_activation_bytes if options.megatron_activations else block_activation_bytes
    full = block(model, b, seq, t, sp, options.flash_attention or c > 1, nb) + ring
    flight = in_flight(layout, stage, options.virtual_stages)
    held = stage.layers * flight
    routed = moe_activation_bytes(model, moe, b, seq, t, sp, nb) if stage.moe_layers else 0.0
    if kind == "full":
        kept = held * recompute_layer_bytes(model, b, seq, t, sp, nb) + full + routed
    elif kind == "selective":
        kept = held * (block(model, b, seq, t, sp, True, nb) + ring) + full + routed
    elif layout.schedule in ("zb-h1", "zb-v"):  # a micro-batch holds its activations until its B, then its W's
        deferred = stage.layers * deferred_weight_bytes(model, b, seq, t, nb)
        # B keeps the embedding's (dense) gradient until the W, the head's too
        deferred += (stage.first + stage.last) * model.vocab_size * model.d_model / t * nb
        kept = flight * max(stage.layers * full, deferred)
    else:
        kept = held * full
    if kind != "full":
        kept += stage.moe_layers * flight * routed
    kept += ring_workspace_bytes(model, b, layout.seq_len, c, t, nb)
    if stage.last:
        logits_in_flight = layout.microbatches if layout.schedule == "gpipe" else 1
        kept += seq * b * model.vocab_size / t * (nb + 4) * logits_in_flight
    return kept


def whole_parameters(model, stage, layout) -> int:
    """Parameters of one tp rank of ``stage`` in the engine's deferred bucket that matter for memory: a
    tied embedding split over pp (stage 0's rows and the last stage's copy, ``V h / t`` each), whose
    gradients stay whole at zero >= 2 and parameters whole at zero 3 (the sequence-parallel norm weights
    there too, ``2 h`` per block, are left out)."""
    split = model.tie_embeddings and layout.pp_size > 1 and (stage.first or stage.last)
    return model.vocab_size * model.d_model // layout.tp_size if split else 0


def zero3_units(model, stage, layout, virtual_stages: int = 1, moe=None, adapters: int = 0,
                frozen: bool = False) -> list[list[dict[str, int]]]:
    """The ZeRO-3 units of one tp rank of ``stage`` per virtual stage, in forward order (zero/gather.py
    ``stage_units``): each unit is ``{bucket: sharded parameters}`` of the buckets it gathers. The
    embedding (+ learned positions) opens the first stage, the final norm + LM head closes the last (a
    tied head with one stage gathers the embedding's bucket; a tied embedding split over pp stays whole:
    ``whole_parameters``). An MoE block's unit is its dense part and its ``num_experts / ep`` experts
    (bucket ``experts...``: gathered over dp x cp / ep); the stage's MoE blocks come first. ``adapters``: a
    LoRA run's adapter parameters per block (bucket ``lora...``, the block's trainable one; lora.py);
    ``frozen``: a LoRA run, whose frozen base is sharded whole, a tied embedding split over pp too (the first
    stage's in its embedding unit, the last stage's copy in its head unit: zero/frozen_slices.py).
    ``model``'s vocabulary as given (padded by the caller)."""
    h, t = model.d_model, layout.tp_size
    copy = frozen and model.tie_embeddings and layout.pp_size > 1  # the last stage's own (sharded) copy
    vh, split = model.vocab_size * h // t, model.tie_embeddings and layout.pp_size > 1 and not frozen
    v = virtual_stages if layout.pp_size > 1 else 1
    block = block_matmul_params(model) // t + 2 * h
    dense, experts = moe_rank_parameters(model, moe, t, layout.ep_size) if stage.moe_layers else (0, 0)

    def unit(c: int, i: int, j: int) -> dict[str, int]:  # block i of chunk c, the stage's j-th
        if j < stage.moe_layers:
            return {f"block{c}.{i}": dense + 2 * h, f"experts{c}.{i}": experts}
        return {f"block{c}.{i}": block, f"lora{c}.{i}": adapters} if adapters else {f"block{c}.{i}": block}
    counts = [stage.layers // v + (1 if c < stage.layers % v else 0) for c in range(v)]
    chunks: list[list[dict[str, int]]] = [[unit(c, i, sum(counts[:c]) + i) for i in range(k)]
                                          for c, k in enumerate(counts)]
    embed = (0 if split else vh) + position_params(model)
    if stage.first and embed:
        chunks[0].insert(0, {"embed": embed})
    if stage.last:
        head = {"head": h + (vh if copy or not model.tie_embeddings else 0)}
        if model.tie_embeddings and not split and not copy:  # one stage: the head's weight is the embedding's
            head["embed"] = embed
        chunks[-1].append(head)
    return [chunk for chunk in chunks if chunk]


def head_buckets(chunks: list[list[dict[str, int]]]) -> dict[str, int]:
    """The buckets of the LM head's unit in ``zero3_units`` (none off the last stage): the one unit that stays
    gathered from its forward to its backward (zero/gather.py ``Unit.last``: the fused loss uses its weight)."""
    return next((unit for chunk in chunks for unit in chunk if "head" in unit), {})


def gathered_parameters(chunks: list[list[dict[str, int]]], prefetch: int, reshard: bool, held: bool) -> int:
    """Parameters gathered at once at zero 3 (the peak over a step), from ``zero3_units``. ``reshard``: the
    running unit and the ``prefetch`` next ones of its virtual stage, plus the LM head's unit when ``held``
    (another micro-batch's backward pending while this one runs) or when it holds another unit's bucket (a
    tied head pins the embedding until the end of the backward); else every unit."""
    if not reshard:
        return sum({k: n for chunk in chunks for unit in chunk for k, n in unit.items()}.values())
    head = head_buckets(chunks)
    shared = any(k in unit for chunk in chunks for unit in chunk if unit is not head for k in head)
    pinned = dict(head) if held or shared else {}
    best = 0
    for chunk in chunks:  # the units of a window share no bucket once the pinned ones are set apart
        sizes = [sum(n for k, n in unit.items() if k not in pinned) for unit in chunk]
        width = min(1 + prefetch, len(sizes))
        window = sum(sizes[:width])
        best = max(best, window)
        for i in range(width, len(sizes)):
            window += sizes[i] - sizes[i - width]
            best = max(best, window)
    return best + sum(pinned.values())


def sliced(n: float, experts: float, layout, nbytes: float) -> float:
    """Bytes of one rank's ZeRO slice of ``n`` parameters of ``nbytes`` each, ``experts`` of them routed
    experts: the rest over the dp x cp group, the experts over the ``dp x cp / ep`` ranks holding the same ones."""
    d, ep = layout.replica_size, layout.ep_size
    return (n - experts) * nbytes / d + experts * nbytes * ep / d


def unit_gradient(unit: dict[str, int]) -> int:
    """Parameters of a ZeRO-3 unit whose full gradient exists at once before its reduce-scatter: its largest
    bucket (a block's experts: with its dense bucket)."""
    return sum(unit.values()) if any(k.startswith("experts") for k in unit) else max(unit.values())


def state_bytes(model, stage, layout, options, moe=None) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes on one rank of ``stage`` for ``layout.zero`` 0-3 (module
    docstring); the dp x cp group shards them (the experts: dp x cp / ep, ``sharded``). ``options``: dtype,
    bucket_mb, zero_prefetch, zero_reshard_after_forward, virtual_stages (cost.Options)."""
    nb, gb = DTYPE_BYTES[options.dtype], max(4, DTYPE_BYTES[options.dtype])
    zero = layout.zero
    n = stage_parameters(model, stage, layout.tp_size, moe, layout.ep_size)
    e = stage_expert_parameters(model, stage, layout.tp_size, moe, layout.ep_size)
    ob = optimizer_bytes_per_param(options.dtype)
    if options.lora_rank:
        return lora_state_bytes(model, stage, layout, options, n)
    optimizer = sliced(n, e, layout, ob) if zero >= 1 else n * ob / 1
    if zero <= 1:
        return n * nb, n * gb + (sliced(n, e, layout, gb) if zero == 1 else 0.0), optimizer
    whole, slices = whole_parameters(model, stage, layout), sliced(n, e, layout, gb)  # every bucket's reduced slice
    if zero == 2:  # a bucket filling while the previous one's reduce-scatter travels
        transient = min((n - whole) * gb, 2 * options.bucket_mb * 2**20)
        return n * nb, whole * gb + slices + transient, optimizer
    chunks = zero3_units(model, stage, layout, options.virtual_stages, moe)
    held = in_flight(layout, stage, options.virtual_stages) > 1  # for the head: GPipe's last stage
    gathered = gathered_parameters(chunks, options.zero_prefetch, options.zero_reshard_after_forward, held)
    largest = max((unit_gradient(unit) for chunk in chunks for unit in chunk), default=0)
    return sliced(n - whole, e, layout, nb) + (whole + gathered) * nb, whole * gb + slices + largest * gb, optimizer


def lora_state_bytes(model, stage, layout, options, base: int) -> tuple[float, float, float]:
    """``state_bytes`` of a LoRA run (dense): the ``base`` parameters frozen (stored in the dtype, sharded at
    zero 3 like any parameter; no gradients, no optimizer state, no float32 masters), the adapters trained:
    zero 0-3 as for full training, on the adapters only, except that with tp > 1 the factors whose gradients
    are partial over tp stay whole at zero >= 2, gradients and parameters (the deferred bucket; lora.py)."""
    nb, gb = DTYPE_BYTES[options.dtype], max(4, DTYPE_BYTES[options.dtype])
    zero, d, t = layout.zero, layout.replica_size, layout.tp_size
    per_block = block_adapter_parameters(model, t, options.lora_rank, options.lora_targets)
    partial = partial_adapter_parameters(model, t, options.lora_rank, options.lora_targets)
    a, w = stage.layers * per_block, stage.layers * partial
    optimizer = a * optimizer_bytes_per_param(options.dtype) / (d if zero >= 1 else 1)
    if zero <= 1:
        return (base + a) * nb, a * gb + (a * gb / d if zero == 1 else 0.0), optimizer
    grads = w * gb + a * gb / d  # the deferred bucket's whole gradients, every bucket's reduced slice
    if zero == 2:  # a bucket filling while the previous one's reduce-scatter travels
        return (base + a) * nb, grads + min((a - w) * gb, 2 * options.bucket_mb * 2**20), optimizer
    chunks = zero3_units(model, stage, layout, options.virtual_stages, adapters=per_block - partial, frozen=True)
    held = in_flight(layout, stage, options.virtual_stages) > 1
    gathered = gathered_parameters(chunks, options.zero_prefetch, options.zero_reshard_after_forward, held)
    return (base + a - w) * nb / d + (w + gathered) * nb, grads + (per_block - partial) * gb, optimizer


def memory(model, layout, recompute, options, moe=None) -> Memory:
    """Memory per rank of ``layout`` (validated) for ``model`` (its vocabulary padded for the layout's tp
    here; ``moe``: its resolved ``[moe]`` section, None = dense): the stage that needs the most."""
    model = for_tp(model, layout.tp_size)
    best, seen = None, set()
    for st in stages(model, layout, moe):
        if st.kind in seen:
            continue  # a later stage of the same kind holds fewer micro-batches
        seen.add(st.kind)
        params, grads, optimizer = state_bytes(model, st, layout, options, moe)
        m = Memory(params / GIB, grads / GIB, optimizer / GIB,
                   activation_bytes(model, layout, st, recompute, options, moe) / GIB, options.reserve_gib, st.index)
        if best is None or m.total_gib > best.total_gib:
            best = m
    assert best is not None  # a layout has at least one stage
    return best
