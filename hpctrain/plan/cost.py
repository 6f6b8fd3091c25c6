"""The time of one training step for a model, a layout and a machine (the performance model).

Units: seconds, FLOPs, bytes. Per micro-batch on one rank of pipeline stage ``s`` (tp rank share):

- compute: each block's forward is its matrix multiplications (``shapes.block_gemms``: q, k/v, o, the
  MLP's two or three matrices, per tp rank), each ``FLOPs / (peak x Device.gemm_efficiency(its smallest
  dimension on the rank))``: the GEMM curve, so thin tp shards and small GQA projections run slower),
  plus the score and value products ``4 b S^2 h / t`` (half with a causal fused kernel that skips the
  masked half) at the efficiency of the sequence dimension, plus the memory-bound element-wise work
  (norms, activations, softmax, residuals): ``2 A / HBM``, ``A`` = the block's activation bytes
  (Korthikanti's formula, stages.py), each written by the op that makes it and read by the op that
  uses it. The backward costs twice the forward (twice the FLOPs; saved bytes read, gradients written
  and read). Recomputation (``Candidate.recompute``): "full" adds one more forward of every block;
  "selective" (Korthikanti et al. 2022) only the attention core (score and value products, softmax,
  dropout: nothing with a fused kernel, which keeps no scores). The last stage adds the LM head over the
  PADDED vocabulary (``shapes.padded_vocab``: ``2 b S h V_pad / t`` FLOPs, logits and their float32 loss
  copy as traffic), forward and backward.
- cp (context parallelism, ``ring.py``): every per-token term above runs on the rank's ``S / cp`` tokens;
  attention is ring attention's computed blocks (``ring.ring_pairs``: the zig-zag split balances causal work,
  a sliding window skips blocks outside it), as hpctrain computes them: plain products in float32 (the
  float32 peak: TF32 with ``train.allow_tf32``) at the efficiency of a block's size, plus the scores'
  passes through memory (``ring.SCORE_PASSES``); the ring's K/V (forward,
  backward) and dK/dV (backward) exchanges are charged where they outlast the same step's block compute,
  plus the last dK/dV pass (``cp_comm``). Without cp, a sliding window (``model.attention_window``) is an
  SDPA mask: the whole square is computed.
- tp (blocking, fully exposed): per block 2 all-reduces of ``b S h`` in forward and 2 in backward (with
  sequence parallelism a reduce-scatter + an all-gather each: the same bytes, twice the latency), 2
  more in the recomputed forward; the embedding's, the LM head's and the cross-entropy's on the first
  and last stages.
- pp: a micro-batch's forward input and backward gradient cross each boundary, ``b S h`` bytes
  (``/ t`` with SP: each tp rank sends its local sequence), point to point; charged in every pipeline
  slot (x virtual stages).
- A slot is ``forward + backward + tp + cp + pp`` of one micro-batch. Step = ``M x slot_max`` (the slowest
  stage paces the steady state) ``+ (pp - 1) / v x mean slot of the other stages`` (the bubble: fill and
  drain; ``(pp - 1) / (v M)`` of the ideal time for equal stages; ``v`` virtual stages of interleaved
  1F1B, Narayanan et al. 2021 section 2.2.2, whose p2p is ``v`` times as frequent; the zero-bubble
  schedules' share of 1F1B's, ``ZERO_BUBBLE_SHARE``: zb-h1 (pp - 1) / (3 M), zb-v (pp - 1) / (6 M) at
  F = B = W, zb-v's p2p as V = 2's) ``+`` exposed dp ``+`` optimizer.
- dp: over the ``dp x cp`` ranks holding the same parameters (the grid's ``dp_cp`` group), gradients in
  float32 (hpctrain's main grads; ``x compression`` at zero <= 1: compression is refused at zero >= 2)
  are all-reduced (ZeRO-1: reduce-scattered) bucket by bucket during the backward of the last
  micro-batch only. Stage ``s`` finishes that backward ``s`` backward slots before stage 0, so its
  reduction is exposed by ``max(last bucket - s b_slot, reduction - (1 + s) b_slot)`` (the tail); the
  step pays the worst stage. ZeRO-1's all-gather of the updated parameters and a tied embedding's
  exchange over pp and reduction over dp (the deferred bucket) are not overlapped.
- ZeRO-2 (as the engine runs it, hpctrain/parallel/data_parallel.py): EVERY micro-batch's gradients are
  reduce-scattered bucket by bucket during its backward (``M`` reduce-scatters per step, the deferred
  bucket once); a bucket's reduction must end before the next micro-batch's gradients reach it, so each
  of the first ``M - 1`` exposes ``max(0, reduction - slot)`` and the last the tail above; then ZeRO-1's
  parameter all-gather.
- ZeRO-3 (hpctrain/parallel/zero/gather.py; units: memory.zero3_units): with ``zero_reshard_after_forward``
  every micro-batch all-gathers each unit before its forward and again before its backward, except the
  LM head's unit (kept from its forward to its backward, and with GPipe's micro-batches in flight never
  freed), so each pass's units (per virtual stage) are simulated in order (``_gather_stall_s``): one
  gather on the dp link at a time, each posted ``zero_prefetch`` units ahead, so it overlaps the compute
  (tp included) of the units before it; a pass's first gather, and every gather with prefetch 0, is
  exposed. A micro-batch exposes ``max(stalls, gathers + reduce-scatter - slot)`` (the link's time
  beyond the slot), the last one its stalls plus the tail, whose overlap window shrinks by the
  backward's gathers (same link). Without resharding each unit is gathered once per step, in the first
  forward (its stalls), and the micro-batches' reduce-scatters are charged as at ZeRO-2. No parameter
  all-gather after the step, except of what stays whole (a tied embedding split over pp). Conservative:
  a stall is charged as if it held up the whole pipeline.
- mixture of experts (``moe``, resolved; ``layout.ep_size`` = ep): an MoE block's forward is
  ``shapes.moe_block_gemms`` (attention, router, the rank's ``E / ep`` experts on ``top_k x`` the ep group's
  tokens spread evenly over them, the shared experts) plus its activations' traffic
  (``stages.moe_activation_bytes`` on top of the dense block's); the shared experts add one MLP's tp
  exchange. With ep > 1 each MoE layer runs, per micro-batch, an all-to-all of the per-expert counts and
  two of the (token, choice) rows, ``b S top_k h`` bytes per rank (dispatch, combine; ``(ep - 1) / ep``
  of them on the wire) in forward, two of their gradients in backward, two more (and the counts) in a
  recomputed forward: ``ep_comm``, blocking, on the ep group's links (``machine.collective_s``
  "alltoall": a profile's own fit where it has one). The ep group is ep consecutive ranks of the dp x cp
  group (cp fastest); the experts' gradients are reduced (ZeRO: sharded and gathered) over the dp x cp /
  ep ranks holding the same experts (``ep_placements``), the rest over dp x cp, one after the other on
  the link. The executed FLOPs count the ACTIVE parameters (``arithmetic.active_matmul_parameters``).
- LoRA (``Options.lora_rank`` > 0, dense models; lora.py): each block's forward adds its adapters' thin
  matmuls (``lora.adapter_gemms``, on the GEMM curve) and the tensors they make (``lora.adapter_traffic_bytes``
  through memory); the backward skips the frozen base's weight gradients
  (the block's and the LM head's matmuls once less: twice the forward minus them); only the adapters'
  gradients are reduced over dp (nothing of a frozen tied embedding) and stepped by the optimizer; at zero 3
  every unit is still gathered (the base is sharded too), with its sharded adapters.
- optimizer: AdamW is memory-bound: the device's measured seconds per parameter where a profile has
  them (``Device.optimizer_s_per_param``), else 32 bytes of traffic per local parameter in 16-bit training (14
  reads and writes of parameters, main grads, master weights and moments; 7 per element in fp32/fp64),
  plus the loss and gradient-norm all-reduces.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.arithmetic import attention_matmul_parameters, moe_layer_count, moe_layer_parameters
from hpctrain.config.layout import Layout
from hpctrain.plan.devices import DTYPE_BYTES, PlanError
from hpctrain.plan.machine import GroupPlacement
from hpctrain.plan.compressed import dp_wire_fraction, payload_fraction
from hpctrain.plan.lora import (adapter_gemms, adapter_traffic_bytes, block_adapter_parameters, check_targets,
                               lora_flops_per_token, partial_adapter_parameters, unit_adapter_parameters)
from hpctrain.plan.memory import head_buckets, sliced, whole_parameters, zero3_units
from hpctrain.plan.ring import RING_TILE, SCORE_PASSES, exposed_s, kv_elements, ring_math_dtype, ring_pairs
from hpctrain.plan.shapes import block_gemms, block_matmul_params, for_tp, moe_block_gemms
from hpctrain.plan.stages import (Stage, in_flight, layer_activation_bytes, moe_activation_bytes, recompute_kind,
                                  score_bytes, stage_expert_parameters, stage_parameters, stages)


@dataclass(frozen=True)
class Options:
    """Modelling choices that are not part of a layout.

    ``dtype``: the training dtype (peak and bytes). ``flash_attention``: a fused causal kernel (hpctrain's
    ``scaled_dot_product_attention``): no score matrix stored, the masked half of the score FLOPs skipped;
    False for Megatron-style attention that computes and stores the full square. ``virtual_stages``: the
    interleaved schedule's virtual stages per pp rank (1 = plain 1F1B/GPipe). ``dp_compression``: bytes on
    the wire over dense bytes for the dp gradient reduction, times what ``compression`` (a
    ``compression.method``, with ``zfp_rate``) sends: compressed.py (0.5 for bf16, 1/31.5 for onebit-adam, 2/31.5 with ZeRO-1).
    ``pp_scatter_gather``: Megatron-LM's scatter/gather of stage-boundary tensors (each tp rank sends
    ``1 / t`` of it, the receivers all-gather it over tp; Narayanan et al. 2021, section 4.1), used only
    to model Megatron runs: hpctrain sends ``1 / t`` only with sequence parallelism.
    ``bucket_mb``: ``parallel.bucket_mb``. ``reserve_gib``: memory every rank loses to the runtime
    (CUDA context, communication buffers, allocator fragmentation). ``fused_ring``: ring attention's blocks
    in a fused kernel in the training dtype (TransformerEngine's, as Megatron-LM runs cp), to compare with
    hpctrain's ring, which computes them unfused in float32 (ring.py). ``zero_prefetch``,
    ``zero_reshard_after_forward``: ``parallel.zero_prefetch`` / ``parallel.zero_reshard_after_forward``
    (ZeRO-3's gathers: memory.py, ``_dp_exposed``). ``lora_rank`` > 0 (``lora.rank``) and ``lora_targets``
    (``lora.targets``): a LoRA run, its base frozen (lora.py). ``megatron_activations``: a block keeps
    Korthikanti et al.'s count of Megatron's GPT block (``stages.layer_activation_bytes``, which re-gathers a
    sequence-parallel linear's input in its backward) instead of what hpctrain's blocks keep
    (``stages.block_activation_bytes``), used only to model published Megatron-style runs.
    """

    dtype: str = "bfloat16"
    flash_attention: bool = True
    virtual_stages: int = 1
    dp_compression: float = 1.0
    compression: str = "none"
    zfp_rate: float = 8.0
    pp_scatter_gather: bool = False
    bucket_mb: float = 25.0
    reserve_gib: float = 2.0
    fused_ring: bool = False
    zero_prefetch: int = 1
    zero_reshard_after_forward: bool = True
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    megatron_activations: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
        if self.virtual_stages < 1 or not 0 < self.dp_compression <= 1 or self.bucket_mb <= 0 or self.zero_prefetch < 0:
            raise PlanError(f"bad options {self}: virtual_stages >= 1, 0 < dp_compression <= 1, bucket_mb > 0, "
                            f"zero_prefetch >= 0")
        payload_fraction(self.compression, self.zfp_rate)  # a method the model does not know: one line
        if self.lora_rank < 0:
            raise PlanError(f"lora_rank {self.lora_rank}: must be >= 0")
        if self.lora_rank:
            try:
                check_targets(self.lora_targets)
            except ValueError as exc:
                raise PlanError(str(exc)) from exc


@dataclass(frozen=True)
class Candidate:
    """A layout (hpctrain.config.layout.Layout, already validated) and its recomputation: "off",
    "selective" or "full" (True/False are read as "full"/"off")."""

    layout: Layout
    recompute: str = "off"

    def __post_init__(self):
        object.__setattr__(self, "recompute", recompute_kind(self.recompute))


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
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0

    def breakdown(self) -> dict[str, float]:
        """Seconds by part; "ep_comm" (the MoE layers' all-to-alls) only where there is some."""
        return {"compute": self.compute_s, "tp_comm": self.tp_comm_s, "pp_comm": self.pp_comm_s,
                "cp_comm": self.cp_comm_s, **({"ep_comm": self.ep_comm_s} if self.ep_comm_s else {}),
                "dp_comm": self.dp_comm_s, "bubble": self.bubble_s, "optimizer": self.optimizer_s}


# the zero-bubble schedules' bubble over 1F1B's (Qi et al. 2024, at F = B = W: a backward's weight-gradient half
# fills the bubbles): zb-h1's timeline takes 3 M + pp - 1 units, 1F1B's 3 M + 3 (pp - 1); zb-v's 6 M + pp - 1
# units of half a stage, the ideal (its list-scheduled orders reach it at (2, 2), (4, 4), (4, 8); under 1F1B's
# memory one unit more at (2, 4))
ZERO_BUBBLE_SHARE = {"zb-h1": 1 / 3, "zb-v": 1 / 6}

def executed_flops_per_token(model, seq_len: int, recompute, flash_attention: bool, moe=None,
                             lora: tuple[int, tuple[str, ...]] = (0, ())) -> float:
    """FLOPs a token costs forward + backward (+ what is recomputed): what the hardware executes, over
    ``model``'s vocabulary as given (``shapes.for_tp`` pads it). With ``flash_attention=False`` and full
    recomputation this is Megatron's count (Narayanan et al. 2021, eq. 3: ``96 B s l h^2 (1 + s / 6h + V /
    16 l h)`` per step for a GELU 4h MLP). An MoE block (``moe``) counts its active matmuls: attention,
    router, ``top_k`` experts, the shared ones. ``lora``: (rank, targets) of a LoRA run (lora.py: no weight
    gradients of the frozen matmuls, the adapters' own)."""
    kind = recompute_kind(recompute)
    h, layers, k = model.d_model, model.n_layers, moe_layer_count(model, moe)
    attention = 4.0 * seq_len * h * (0.5 if flash_attention else 1.0)

    def block(matmul_params: int) -> float:
        block_fwd = 2.0 * matmul_params + attention
        extra = block_fwd if kind == "full" else attention if kind == "selective" and not flash_attention else 0.0
        return 3 * block_fwd + extra
    routed = k * block(attention_matmul_parameters(model) + moe_layer_parameters(model, moe, moe.top_k)) if k else 0.0
    adapters = lora_flops_per_token(model, lora[0], lora[1], kind == "full") if lora[0] else 0.0
    return (layers - k) * block(block_matmul_params(model)) + routed + 6.0 * h * model.vocab_size + adapters


def _gemm_s(dev, peak: float, gemms) -> float:
    """Seconds of ``gemms`` ((FLOPs, dims) pairs) at the device's GEMM curve."""
    return sum(f / (peak * dev.gemm_efficiency(min(dims))) for f, dims in gemms)


def ep_placements(machine, lay) -> tuple[GroupPlacement, GroupPlacement]:
    """(the ep group, the group of the dp x cp / ep ranks holding the same experts): where they lie. An ep
    group is ep consecutive ranks of the dp x cp group, whose rank is ``dp x cp + cp`` (hpctrain/comm/grid.py;
    a rank's grid position is ``((dp pp + pp) cp + cp) tp + tp``)."""
    t, c, p, d, ep = lay.tp_size, lay.cp_size, lay.pp_size, lay.dp_size, lay.ep_size
    replicas = machine.group_placement((t * c * p, d), (t, c))
    if ep == 1:
        return GroupPlacement("intra", 1), replicas
    if c % ep == 0:  # inside the cp axis
        return machine.placement(t, ep), machine.group_placement((t * c * p, d), (t * ep, c // ep))
    if ep % c == 0:  # whole cp axes of consecutive dp ranks
        return (machine.group_placement((t * c * p, ep // c), (t, c)),
                machine.placement(t * c * p * (ep // c), d * c // ep))

    def position(replica: int, rest: int) -> int:  # rest: the (pp, tp) coordinates
        (dp, cp), (pp, tp) = divmod(replica, c), divmod(rest, t)
        return ((dp * p + pp) * c + cp) * t + tp
    outer = range(p * t)
    return (machine.groups_placement([[position(r, o) for r in range(g, g + ep)]
                                      for o in outer for g in range(0, d * c, ep)]),
            machine.groups_placement([[position(r, o) for r in range(j, d * c, ep)] for o in outer for j in range(ep)]))


def step_time(model, cand: Candidate, machine, options: Options = Options(), moe=None) -> StepTime:
    """Predicted step time of ``cand`` (layout + recompute) for ``model`` (a resolved ModelConfig; its
    vocabulary is padded for the layout's tp here; ``moe``: its resolved ``[moe]`` section, None = dense)."""
    lay, recompute = cand.layout, cand.recompute
    t, p, c, m, v = lay.tp_size, lay.pp_size, lay.cp_size, lay.microbatches, options.virtual_stages
    model = for_tp(model, t)
    b, h, vocab, sp = lay.micro_batch, model.d_model, model.vocab_size, lay.sequence_parallel
    full_seq, seq = lay.seq_len, lay.seq_len // c  # seq: the tokens of a sequence on this rank
    nb, flash = DTYPE_BYTES[options.dtype], options.flash_attention or c > 1  # the ring keeps no scores
    dev = machine.device
    peak = dev.peak(options.dtype) * 1e12
    hbm = dev.hbm_gbps * 1e9
    tp_at, cp_at, pp_at = machine.placement(1, t), machine.placement(t, c), machine.placement(t * c, p)

    def tp_op(op, nbytes):  # across nodes: one NIC's ring, each step paying the latency
        return machine.layer_collective_s(op, nbytes, t, tp_at)

    ring_f, ring_b, attention = _attention(model, lay, machine, options, cp_at, peak)
    rank, targets = options.lora_rank, options.lora_targets
    block_gemm = _gemm_s(dev, peak, block_gemms(model, b * seq, t))
    block_f = block_gemm + attention
    if rank:  # the adapters' thin matmuls and the tensors they make
        block_f += _gemm_s(dev, peak, adapter_gemms(model, b * seq, t, rank, targets))
        block_f += adapter_traffic_bytes(model, b * seq, t, rank, targets, nb) / hbm
    block_f += 2 * layer_activation_bytes(model, b, seq, t, sp, flash, nb) / hbm
    frozen_wgrad = block_gemm if rank else 0.0  # LoRA: the weight gradients the frozen base does not compute
    rematerialised = {"off": 0.0, "full": block_f,
                      "selective": 0.0 if flash else attention + 2 * score_bytes(model, b, seq, t, nb) / hbm}[recompute]
    moe_f = remat_moe = ep_f = ep_b = shared = 0.0  # an MoE block's forward, recomputation, ep, shared tp
    if moe is not None:
        moe_f = _gemm_s(dev, peak, moe_block_gemms(model, moe, b * seq, t, lay.ep_size)) + attention
        moe_f += 2 * (layer_activation_bytes(model, b, seq, t, sp, flash, nb)
                      + moe_activation_bytes(model, moe, b, seq, t, sp, nb)) / hbm
        remat_moe = moe_f if recompute == "full" else rematerialised
    head_gemm = _gemm_s(dev, peak, [(2.0 * b * seq * h * vocab / t, (b * seq, vocab // t, h))])
    head_f = head_gemm + b * seq * vocab / t * (nb + 4) / hbm
    head_wgrad = head_gemm if rank else 0.0

    act = float(b * seq * h * nb)
    one = (tp_op("reduce_scatter", act) + tp_op("allgather", act)) if sp else tp_op("allreduce", act)
    p2p = 0.0
    if p > 1:
        split = sp or options.pp_scatter_gather
        p2p = machine.collective_s("sendrecv", act / (t if split else 1), 2, pp_at)
        p2p += tp_op("allgather", act) if options.pp_scatter_gather and not sp else 0.0
    pp_slot = 2 * (2 if lay.schedule == "zb-v" else v) * p2p  # zb-v: two boundaries a micro-batch, as V = 2
    ep_at, experts_at = ep_placements(machine, lay)  # the ep group; the experts' dp x cp / ep group
    if moe is not None:
        rows = machine.collective_s("alltoall", float(b * seq * moe.top_k * h * nb), lay.ep_size, ep_at)
        counts = machine.collective_s("alltoall", 8.0 * moe.num_experts, lay.ep_size, ep_at)
        ep_f = 2 * rows + counts
        ep_b = 2 * rows + (ep_f if recompute == "full" else 0.0)
        shared = one if moe.shared_experts else 0.0

    embed_tp = (tp_op("reduce_scatter" if sp else "allreduce", act), tp_op("allgather", act) if sp else 0.0) \
        if t > 1 else (0.0, 0.0)  # (forward, backward) of the first stage's embedding
    head_tp = ((tp_op("allgather", act) if sp else 0.0) + tp_op("allreduce", 4.0 * b * seq)
               + tp_op("allreduce", 8.0 * b * seq),  # cross-entropy: max, then (target logit, sum exp)
               tp_op("reduce_scatter" if sp else "allreduce", act)) if t > 1 else (0.0, 0.0)

    def parts(st: Stage) -> tuple[float, float, float, float, float, float, float, float]:
        """(forward, backward, tp forward, tp backward, cp forward, cp backward, ep forward, ep backward)
        seconds of one micro-batch on ``st``."""
        k = st.moe_layers
        fwd = (st.layers - k) * block_f + (k * moe_f if k else 0.0) + (head_f if st.last else 0.0)
        bwd = 2 * fwd + (st.layers - k) * rematerialised + (k * remat_moe if k else 0.0)
        bwd -= (st.layers - k) * frozen_wgrad + (head_wgrad if st.last else 0.0)
        tpf = st.layers * 2 * one + k * shared
        tpb = (st.layers * 2 * one + k * shared) * (2 if recompute == "full" else 1)
        cpf, cpb = st.layers * ring_f, st.layers * (ring_b + (ring_f if recompute == "full" else 0.0))
        if st.first:
            tpf, tpb = tpf + embed_tp[0], tpb + embed_tp[1]
        if st.last:
            tpf, tpb = tpf + head_tp[0], tpb + head_tp[1]
        return fwd, bwd, tpf, tpb, cpf, cpb, k * ep_f, k * ep_b

    again = recompute == "full"  # the recomputed forward's tp and cp
    units = {"embed": embed_tp, "head": (head_f + head_tp[0], 2 * head_f - head_wgrad + head_tp[1]),  # ZeRO-3: (fwd, bwd) s
             "block": (block_f + 2 * one + ring_f,
                       2 * block_f - frozen_wgrad + rematerialised + 2 * one * (2 if again else 1) + ring_b
                       + (ring_f if again else 0.0)),
             "moe": (moe_f + 2 * one + shared + ring_f + ep_f,
                     2 * moe_f + remat_moe + (2 * one + shared) * (2 if again else 1) + ring_b
                     + (ring_f if again else 0.0) + ep_b)}

    reps: dict[tuple, list] = {}  # stages alike (Stage.kind): the first of each, and how many
    for st in stages(model, lay, moe):
        key = st.kind
        if key in reps:
            reps[key][1] += 1
        else:
            reps[key] = [st, 1, parts(st)]
    firsts = [(st, count, costs, sum(costs) + pp_slot) for st, count, costs in reps.values()]
    _, _, (fk, bk, tfk, tbk, cfk, cbk, efk, ebk), slot_k = max(firsts, key=lambda r: r[3])  # the slowest stage
    zero_bubble = ZERO_BUBBLE_SHARE.get(lay.schedule)  # its share of 1F1B's (zb-v's V = 2 counted in it)
    bubble = (sum(r[1] * r[3] for r in firsts) - slot_k) / (v if zero_bubble is None else 1 / zero_bubble)
    # (pp - 1) / v x the other stages' mean slot

    if rank:  # only the adapters have gradients, are reduced and stepped
        per_block = block_adapter_parameters(model, t, rank, targets)
        params = [(st, st.layers * per_block, costs, 0) for st, _, costs, _ in firsts]
    else:
        params = [(st, stage_parameters(model, st, t, moe, lay.ep_size), costs,
                   stage_expert_parameters(model, st, t, moe, lay.ep_size)) for st, _, costs, _ in firsts]
    dp_at = machine.group_placement((t * c * p, lay.dp_size), (t, c))  # the dp x cp group
    dp_s = _dp_exposed(model, lay, machine, options, (dp_at, experts_at), pp_at, params, p2p, units, moe)
    world_at = GroupPlacement("inter" if machine.nodes > 1 else "intra", machine.gpus_per_node)
    grad_norm = 2 * machine.collective_s("allreduce", 8.0, lay.world_size, world_at)  # loss, gradient norm
    per_param = 32 if nb == 2 else 7 * nb
    local = max(sliced(n, e, lay, 1) if lay.zero >= 1 else n / 1 for _, n, _, e in params)
    optimizer = local * (dev.optimizer_s_per_param or per_param / hbm) + grad_norm

    tokens = lay.global_batch * full_seq
    step = m * slot_k + bubble + dp_s + optimizer
    flops = executed_flops_per_token(model, full_seq, recompute, options.flash_attention, moe, (rank, targets)) * tokens
    return StepTime(step, m * (fk + bk), m * (tfk + tbk), m * pp_slot, dp_s, bubble, optimizer, flops, tokens,
                    m * (cfk + cbk), m * (efk + ebk))


def _attention(model, lay, machine, options, cp_at, peak) -> tuple[float, float, float]:
    """(exposed ring exchange forward, backward, attention compute forward) seconds of one layer and
    micro-batch on one rank (module docstring; the ring's terms: ring.py)."""
    dev, b, t, c, seq = machine.device, lay.micro_batch, lay.tp_size, lay.cp_size, lay.seq_len
    h, window, nb = model.d_model, getattr(model, "attention_window", 0), DTYPE_BYTES[options.dtype]
    if c == 1:
        square = 0.5 if options.flash_attention and not 0 < window < seq else 1.0  # a window: SDPA's mask
        return 0.0, 0.0, 4.0 * b * seq * seq * h * square / t / (peak * dev.gemm_efficiency(seq))
    math_dtype = options.dtype if options.fused_ring else ring_math_dtype(options.dtype)
    block = dev.peak(math_dtype) * 1e12 * dev.gemm_efficiency(min(RING_TILE, seq // (2 * c)))
    passes = 0 if options.fused_ring else SCORE_PASSES  # a fused kernel keeps a block's scores on chip
    score_bytes = passes * DTYPE_BYTES[math_dtype] * b * model.n_heads / t  # per computed pair
    steps = [4.0 * b * pairs * h / t / block + pairs * score_bytes / (dev.hbm_gbps * 1e9)
             for pairs in ring_pairs(seq, c, window).computed]
    kv = kv_elements(model, b, seq, c, t)
    kv_s = machine.collective_s("sendrecv", kv * nb, c, cp_at)
    dkv_s = machine.collective_s("sendrecv", kv * max(4, nb), c, cp_at)  # float32 partial dK/dV
    forward = exposed_s([kv_s] * (c - 1) + [0.0], steps)
    backward = exposed_s([kv_s * (i < c - 1) + dkv_s * (i >= 1) for i in range(c)], [2 * x for x in steps])
    return forward, backward + dkv_s, sum(steps)


def _adapters_per_block(model, lay, options) -> int:
    """A LoRA run's adapter parameters per block on one tp rank that its ZeRO-3 unit gathers (0 without LoRA)."""
    return unit_adapter_parameters(model, lay.tp_size, options.lora_rank, options.lora_targets)


def _gather_stall_s(gathers: list[float], computes: list[float], prefetch: int) -> float:
    """Seconds a pass over units waits for their ZeRO-3 all-gathers: unit ``i`` needs ``gathers[i]`` seconds
    of the dp link (one gather at a time; 0: already gathered) before it computes ``computes[i]``; its
    gather is posted when unit ``i - prefetch`` is due (the first ``prefetch + 1`` at the pass's start),
    so a prefetched gather overlaps the units before it; ``prefetch`` 0 exposes every gather."""
    dues: list[float] = []
    due = link = stall = 0.0
    for i, (gather, compute) in enumerate(zip(gathers, computes)):
        dues.append(due)
        start = due
        if gather:
            link = max(link, dues[max(0, i - prefetch)]) + gather
            start = max(due, link)
        stall += start - due
        due = start + compute
    return stall


def _zero3_gathers(model, lay, machine, options, groups, st: Stage, units,
                   moe=None) -> tuple[float, float, float, float]:
    """ZeRO-3 on one rank of ``st``: (forward gather stall, backward gather stall, forward gathers, backward
    gathers) seconds per micro-batch (module docstring; without resharding: the step's first forward).
    ``groups``: where the dp x cp group and the experts' dp x cp / ep group lie; a unit's experts are
    gathered over the latter after its dense buckets."""
    nb, d, v = DTYPE_BYTES[options.dtype], lay.replica_size, options.virtual_stages
    reshard, prefetch = options.zero_reshard_after_forward, options.zero_prefetch
    frozen = options.lora_rank > 0
    chunks = zero3_units(model, st, lay, v, moe, _adapters_per_block(model, lay, options), frozen)
    head = head_buckets(chunks)  # gathered from its forward to its backward (a tied head: with the embedding)
    held = set(head) if reshard and in_flight(lay, st, v) > 1 else set()  # still there from an earlier micro-batch

    seconds: dict[tuple[int, int], float] = {(0, 0): 0.0}  # (dense, expert) parameters -> their all-gathers

    def gather(unit, skip) -> float:
        n = sum(size for k, size in unit.items() if k not in skip and not k.startswith("experts"))
        e = sum(size for k, size in unit.items() if k not in skip and k.startswith("experts"))
        if (n, e) not in seconds:
            seconds[n, e] = (machine.collective_s("allgather", n * nb, d, groups[0])
                             + machine.collective_s("allgather", e * nb, d // lay.ep_size, groups[1]))
        return seconds[n, e]

    def kind(unit) -> str:
        experts = any(k.startswith("experts") for k in unit)
        return "head" if "head" in unit else "embed" if "embed" in unit else "moe" if experts else "block"
    stall_f = stall_b = link_f = link_b = 0.0
    for chunk in chunks:
        times = [units[kind(u)] for u in chunk]
        forward = [gather(u, held) for u in chunk]
        stall_f += _gather_stall_s(forward, [f for f, _ in times], prefetch)
        link_f += sum(forward)
        if reshard:  # backward: every unit but the head, in reverse; the head's backward posts nothing
            # (a frozen embedding's output needs no gradient: its unit is not gathered again)
            rest = [(u, t) for u, t in zip(chunk, times) if u is not head and not (frozen and "embed" in u)][::-1]
            backward = [gather(u, set(head)) for u, _ in rest]
            stall_b += _gather_stall_s(backward, [bw for _, (_, bw) in rest], prefetch)
            link_b += sum(backward)
    return stall_f, stall_b, link_f, link_b


def _dp_exposed(model, lay, machine, options, groups, pp_at, params, p2p, units, moe=None) -> float:
    """Seconds of dp communication the step waits for (module docstring: overlap assumption).
    ``groups``: where the dp x cp group and the experts' dp x cp / ep group lie; ``params``: (stage,
    parameters per rank, (fwd, bwd, tp fwd, tp bwd, cp fwd, cp bwd, ep fwd, ep bwd), expert parameters per
    rank) of the first stage of each kind; ``units``: (forward, backward) seconds of one "embed", "block",
    "moe" and "head" unit (ZeRO-3)."""
    d, nb, m, zero = lay.replica_size, DTYPE_BYTES[options.dtype], lay.microbatches, lay.zero
    dp_at, experts_at = groups
    experts_d = d // lay.ep_size
    if d <= 1:
        return 0.0
    reduce_op = "reduce_scatter" if zero >= 1 else "allreduce"
    # compression is refused at zero >= 2 (planner.engine_refusal): its wire fraction applies at zero <= 1
    fraction = options.dp_compression * (dp_wire_fraction(options.compression, zero, options.zfp_rate)
                                         if zero <= 1 else 1.0)
    frozen = options.lora_rank > 0  # LoRA: ``params`` are the adapters; the base (a tied embedding too) never changes
    tp_at = machine.placement(1, lay.tp_size)
    exposed = 0.0
    for st, n, (fwd, bwd, tpf, tpb, cpf, cpb, epf, epb), e in params:
        s, gb = st.index, max(4, nb)
        # LoRA: the adapter factors partial over tp (the deferred bucket) are reduced once, after the last backward
        deferred = st.layers * partial_adapter_parameters(model, lay.tp_size, options.lora_rank,
                                                          options.lora_targets) if frozen else 0
        grads = (n - deferred - (whole_parameters(model, st, lay) if zero >= 2 and not frozen else 0)) * gb * fraction
        expert_grads = e * gb * fraction  # reduced over the experts' group, after the rest
        bucket = options.bucket_mb * 2**20
        if zero == 3:  # the last bucket reduced is the stage's first unit (LoRA: the first with adapters)
            units0 = zero3_units(model, st, lay, options.virtual_stages, moe, _adapters_per_block(model, lay, options),
                                 frozen)[0]
            first = next((u for u in units0 if any(k.startswith("lora") for k in u)), {}) if frozen else units0[0]
            bucket = sum(size for k, size in first.items() if not frozen or k.startswith("lora")) * gb
        whole = (machine.collective_s(reduce_op, grads - expert_grads, d, dp_at)
                 + machine.collective_s(reduce_op, expert_grads, experts_d, experts_at))
        last = machine.collective_s(reduce_op, min(grads, bucket), d, dp_at)
        slot = fwd + bwd + tpf + tpb + cpf + cpb + epf + epb + p2p
        b_slot = bwd + tpb + cpb + epb + p2p
        stall_f = stall_b = link_f = link_b = 0.0
        if zero == 3:
            stall_f, stall_b, link_f, link_b = _zero3_gathers(model, lay, machine, options, groups, st, units, moe)
        b_slot = max(0.0, b_slot - link_b)  # the last backward's gathers share the dp link
        tail = max(last - s * b_slot, whole - (1 + s) * b_slot)  # the last micro-batch's reduction
        if deferred:  # summed over tp, then reduced over dp x cp; at zero 3 gathered again after the step
            tail += (machine.layer_collective_s("allreduce", deferred * gb, lay.tp_size, tp_at)
                     + machine.collective_s(reduce_op, deferred * gb * fraction, d, dp_at)
                     + (machine.collective_s("allgather", deferred * nb, d, dp_at) if zero == 3 else 0.0))
        if zero <= 1:
            stage = tail
        elif zero == 2 or not options.zero_reshard_after_forward:  # gathers (if any) in the first forward only
            stage = stall_f + (m - 1) * max(0.0, whole - slot) + tail
        else:  # every micro-batch: gathers forward and backward, its reduce-scatter behind them on the link
            stalls = stall_f + stall_b
            stage = (m - 1) * max(stalls, link_f + link_b + whole - slot) + stalls + tail
        exposed = max(exposed, stage)
    if zero in (1, 2):  # the stage with the most parameters: the rest over dp x cp, its experts over their group
        most, experts = max((row[1], row[3]) for row in params)
        exposed += (machine.collective_s("allgather", (most - experts) * nb, d, dp_at)
                    + machine.collective_s("allgather", experts * nb, experts_d, experts_at))
    if zero == 3 and not frozen:  # the parameters that stay whole (a tied embedding split over pp)
        kept = max(whole_parameters(model, st, lay) for st, _, _, _ in params)
        exposed += machine.collective_s("allgather", kept * nb, d, dp_at) if kept else 0.0
    if model.tie_embeddings and lay.pp_size > 1 and not frozen:
        emb = model.vocab_size * model.d_model / lay.tp_size * 4.0
        exposed += machine.collective_s("allreduce", emb, 2, pp_at)
        exposed += machine.collective_s(reduce_op, emb * fraction, d, dp_at)
    return exposed
