"""The time of one training step for a model, a layout and a machine (the performance model).

Units: seconds, FLOPs, bytes. Per micro-batch on one rank of pipeline stage ``s`` (tp rank share):

- compute: each block's forward is ``F / R + A / HBM``: ``F = 2 b S P_block / t + 4 b S^2 h / t`` FLOPs
  (the score and value products; half with a causal fused kernel that skips the masked half) at
  ``R = peak x efficiency``, plus the memory-bound element-wise work (norms, activations, softmax,
  residuals): ``2 A / HBM``, ``A`` = the block's activation bytes (Korthikanti's formula, stages.py),
  each written by the op that makes it and read by the op that uses it. The backward costs twice the
  forward (twice the FLOPs; saved bytes read, gradients written and read); full recomputation adds one
  more forward. The last stage adds the LM head (``2 b S h V / t`` FLOPs, logits and their float32
  loss copy as traffic; ``V`` the padded vocabulary, ``padded_vocab``), forward and backward.
- tp (blocking, fully exposed): per block 2 all-reduces of ``b S h`` in forward and 2 in backward (with
  sequence parallelism a reduce-scatter + an all-gather each: the same bytes, twice the latency), 2
  more in the recomputed forward; the embedding's, the LM head's and the cross-entropy's on the first
  and last stages.
- pp: a micro-batch's forward input and backward gradient cross each boundary, ``b S h`` bytes
  (``/ t`` with SP: each tp rank sends its sequence chunk), point to point; charged in every pipeline
  slot (x virtual stages).
- A slot is ``forward + backward + tp + pp`` of one micro-batch. Step = ``M x slot_max`` (the slowest
  stage paces the steady state) ``+ (pp - 1) / v x mean slot of the other stages`` (the bubble: fill and
  drain; ``(pp - 1) / (v M)`` of the ideal time for equal stages; ``v`` virtual stages of interleaved
  1F1B, used only to model Megatron runs: hpctrain runs 1F1B and GPipe, ``v = 1``)
  ``+`` exposed dp ``+`` optimizer.
- dp: gradients in float32 (hpctrain's main grads; ``x compression``) are all-reduced (ZeRO-1:
  reduce-scattered) bucket by bucket during the backward of the last micro-batch only. Stage ``s``
  finishes that backward ``s`` backward slots before stage 0, so its reduction is exposed by
  ``max(last bucket - s b_slot, reduction - (1 + s) b_slot)``; the step pays the worst stage. ZeRO-1's
  all-gather of the updated parameters and a tied embedding's exchange over pp and reduction over
  dp (the deferred bucket) are not overlapped.
- optimizer: AdamW is memory-bound: the device's measured seconds per parameter where a profile has
  them (``Device.optimizer_s_per_param``), else 32 bytes of traffic per local parameter in 16-bit training (14
  reads and writes of parameters, main grads, master weights and moments; 7 per element in fp32/fp64),
  plus the loss and gradient-norm all-reduces.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.models.arithmetic import block_matmul_parameters
from hpctrain.parallel.rules import padded_vocab
from hpctrain.plan.devices import DTYPE_BYTES, PlanError
from hpctrain.plan.machine import GroupPlacement
from hpctrain.plan.stages import Stage, layer_activation_bytes, stage_parameters, stages


@dataclass(frozen=True)
class Options:
    """Modelling choices that are not part of a layout.

    ``dtype``: the training dtype (peak and bytes). ``flash_attention``: a fused causal kernel (hpctrain's
    ``scaled_dot_product_attention``): no score matrix stored, the masked half of the score FLOPs skipped;
    False for Megatron-style attention that computes and stores the full square. ``virtual_stages``: the
    interleaved schedule's chunks per stage (1 = plain 1F1B/GPipe). ``dp_compression``: bytes on the wire
    over dense bytes for the dp gradient reduction (``[compression]``: 0.5 for bf16, 0.25 for int8, ...).
    ``pp_scatter_gather``: Megatron-LM's scatter/gather of stage-boundary tensors (each tp rank sends
    ``1 / t`` of it, the receivers all-gather it over tp; Narayanan et al. 2021, section 4.1), used only
    to model Megatron runs: hpctrain sends ``1 / t`` only with sequence parallelism.
    ``bucket_mb``: ``parallel.bucket_mb``. ``reserve_gib``: memory every rank loses to the runtime
    (CUDA context, communication buffers, allocator fragmentation).
    """

    dtype: str = "bfloat16"
    flash_attention: bool = True
    virtual_stages: int = 1
    dp_compression: float = 1.0
    pp_scatter_gather: bool = False
    bucket_mb: float = 25.0
    reserve_gib: float = 2.0

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
        if self.virtual_stages < 1 or not 0 < self.dp_compression <= 1 or self.bucket_mb <= 0:
            raise PlanError(f"bad options {self}: virtual_stages >= 1, 0 < dp_compression <= 1, bucket_mb > 0")


@dataclass(frozen=True)
class Candidate:
    """A layout (hpctrain.parallel.layout.Layout, already validated) and whether blocks are recomputed."""

    layout: object
    recompute: bool = False


@dataclass(frozen=True)
class StepTime:
    """One step in seconds, split where the time goes, and the FLOPs it executes on all ranks."""

    step_s: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    optimizer_s: float
    executed_flops: float
    tokens: int

    def breakdown(self) -> dict[str, float]:
        return {"compute": self.compute_s, "tp_comm": self.tp_comm_s, "pp_comm": self.pp_comm_s,
                "dp_comm": self.dp_comm_s, "bubble": self.bubble_s, "optimizer": self.optimizer_s}


def executed_flops_per_token(model, seq_len: int, recompute: bool, flash_attention: bool, tp: int = 1) -> float:
    """FLOPs a token costs forward + backward (+ the recomputed forward): what the hardware executes.

    With ``flash_attention=False`` and recompute this is Megatron's count (Narayanan et al. 2021, eq. 3:
    ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` per step for a GELU 4h MLP)."""
    h, layers = model.d_model, model.n_layers
    block_fwd = 2.0 * block_matmul_parameters(model) + 4.0 * seq_len * h * (0.5 if flash_attention else 1.0)
    return layers * block_fwd * (4 if recompute else 3) + 6.0 * h * padded_vocab(model, tp)  # the LM head's GEMM


def step_time(model, cand: Candidate, machine, options: Options = Options()) -> StepTime:
    """Predicted step time of ``cand`` (layout + recompute) for ``model`` (a resolved ModelConfig)."""
    lay, recompute = cand.layout, cand.recompute
    t, p, d, m, v = lay.tp_size, lay.pp_size, lay.dp_size, lay.microbatches, options.virtual_stages
    b, seq, h, vocab, sp = lay.micro_batch, lay.seq_len, model.d_model, padded_vocab(model, t), lay.sequence_parallel
    nb = DTYPE_BYTES[options.dtype]
    dev = machine.device
    rate = dev.peak(options.dtype) * dev.efficiency * 1e12
    hbm = dev.hbm_gbps * 1e9
    tp_at, pp_at, dp_at = machine.placement(1, t), machine.placement(t, p), machine.placement(t * p, d)

    def tp_op(op, nbytes):
        return machine.collective_s(op, nbytes, t, tp_at)

    attention = 4.0 * b * seq * seq * h * (0.5 if options.flash_attention else 1.0) / t
    block_f = (2.0 * b * seq * block_matmul_parameters(model) / t + attention) / rate
    block_f += 2 * layer_activation_bytes(model, b, seq, t, sp, options.flash_attention, nb) / hbm
    head_f = 2.0 * b * seq * h * vocab / t / rate + b * seq * vocab / t * (nb + 4) / hbm

    act = float(b * seq * h * nb)
    one = (tp_op("reduce_scatter", act) + tp_op("allgather", act)) if sp else tp_op("allreduce", act)
    p2p = 0.0
    if p > 1:
        split = sp or options.pp_scatter_gather
        p2p = machine.collective_s("sendrecv", act / (t if split else 1), 2, pp_at)
        p2p += tp_op("allgather", act) if options.pp_scatter_gather and not sp else 0.0
    pp_slot = 2 * v * p2p

    def parts(st: Stage) -> tuple[float, float, float, float]:
        """(forward, backward, tp forward, tp backward) seconds of one micro-batch on ``st``."""
        fwd = st.layers * block_f + (head_f if st.last else 0.0)
        bwd = 2 * fwd + (st.layers * block_f if recompute else 0.0)
        tpf = st.layers * 2 * one
        tpb = st.layers * 2 * one * (2 if recompute else 1)
        if t > 1 and st.first:
            tpf += tp_op("reduce_scatter" if sp else "allreduce", act)
            tpb += tp_op("allgather", act) if sp else 0.0
        if t > 1 and st.last:
            tpf += (tp_op("allgather", act) if sp else 0.0) + tp_op("allreduce", 4.0 * b * seq)
            tpf += tp_op("allreduce", 8.0 * b * seq)  # cross-entropy: max, then (target logit, sum exp)
            tpb += tp_op("reduce_scatter" if sp else "allreduce", act)
        return fwd, bwd, tpf, tpb

    reps: dict[tuple, list] = {}  # stages alike (layers, first, last): the first of each, and how many
    for st in stages(model, lay):
        key = (st.layers, st.first, st.last)
        if key in reps:
            reps[key][1] += 1
        else:
            reps[key] = [st, 1, parts(st)]
    firsts = [(st, count, c, sum(c) + pp_slot) for st, count, c in reps.values()]
    _, _, (fk, bk, tfk, tbk), slot_k = max(firsts, key=lambda r: r[3])  # the slowest stage paces the pipe
    bubble = (sum(r[1] * r[3] for r in firsts) - slot_k) / v  # (pp - 1) / v x the other stages' mean slot

    params = [(st.index, stage_parameters(model, st, t), c) for st, _, c, _ in firsts]
    dp_s = _dp_exposed(model, lay, machine, options, dp_at, pp_at, params, p2p)
    world_at = GroupPlacement("inter" if machine.nodes > 1 else "intra", machine.gpus_per_node)
    grad_norm = 2 * machine.collective_s("allreduce", 8.0, lay.world_size, world_at)  # loss, gradient norm
    per_param = 32 if nb == 2 else 7 * nb
    local = max(n for _, n, _ in params) / (d if lay.zero == 1 else 1)
    optimizer = local * (dev.optimizer_s_per_param or per_param / hbm) + grad_norm

    tokens = lay.global_batch * seq
    step = m * slot_k + bubble + dp_s + optimizer
    flops = executed_flops_per_token(model, seq, recompute, options.flash_attention, t) * tokens
    return StepTime(step, m * (fk + bk), m * (tfk + tbk), m * pp_slot, dp_s, bubble, optimizer, flops, tokens)


def _dp_exposed(model, lay, machine, options, dp_at, pp_at, params, p2p) -> float:
    """Seconds of dp communication the step waits for (module docstring: overlap assumption).
    ``params``: (stage index, parameters per rank, (fwd, bwd, tp fwd, tp bwd)) of the first stage of each kind."""
    d, t = lay.dp_size, lay.tp_size
    if d <= 1:
        return 0.0
    reduce_op = "reduce_scatter" if lay.zero == 1 else "allreduce"
    bucket_bytes = options.bucket_mb * 2**20
    exposed = 0.0
    for s, n, (_, bwd, _, tpb) in params:
        grads = n * max(4, DTYPE_BYTES[options.dtype]) * options.dp_compression
        whole = machine.collective_s(reduce_op, grads, d, dp_at)
        last = machine.collective_s(reduce_op, min(grads, bucket_bytes), d, dp_at)
        b_slot = bwd + tpb + p2p
        exposed = max(exposed, last - s * b_slot, whole - (1 + s) * b_slot)
    if lay.zero == 1:
        exposed += machine.collective_s("allgather", max(n for _, n, _ in params) * DTYPE_BYTES[options.dtype],
                                        d, dp_at)
    if model.tie_embeddings and lay.pp_size > 1:
        emb = padded_vocab(model, t) * model.d_model / t * 4.0
        exposed += machine.collective_s("allreduce", emb, 2, pp_at)
        exposed += machine.collective_s(reduce_op, emb * options.dp_compression, d, dp_at)
    return exposed
