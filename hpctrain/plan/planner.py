"""Enumerate the layouts of a model on a machine, keep those that fit, rank them by predicted tokens/s.

Feasibility has two sources, each reported with its reason: the layout rules, checked only by
``Layout(...).validate(model)`` (hpctrain/config/rules.py: the ``LayoutError``/``GridError`` message
is the reason), and memory (memory.py) against the device's capacity.

A mixture-of-experts model (``moe``: its resolved ``[moe]`` section, ``config.moe_keys.resolve_moe``) is
searched over expert parallelism too: every ep dividing both dp x cp and ``moe.num_experts``
(``expert_parallel_sizes``); a dense model has ep 1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hpctrain.errors import HpcTrainError
from hpctrain.config.layout import Layout, divisors
from hpctrain.config.rules import ZERO_BUBBLE_SCHEDULES
from hpctrain.plan.cost import Candidate, Options, StepTime, ep_placements, step_time
from hpctrain.plan.devices import PlanError
from hpctrain.plan.memory import Memory, memory
from hpctrain.plan.shapes import for_tp, model_flops_per_token


ZERO_STAGES = (0, 1, 2, 3)  # the ZeRO stages hpctrain's engine trains with (config parallel.zero)
MIN_CP_STRIPE = 512  # the search's shortest zig-zag stripe (tokens): thinner ring blocks are latency-bound


@dataclass(frozen=True)
class SearchSpace:
    """The choices enumerated for every (dp, tp, pp): ``microbatches`` empty = every divisor of the
    replica batch; ``zero``: the ZeRO stages tried with dp x cp > 1 (default all four, as the engine trains
    them; memory.py and cost.py model each; 2 and 3 not with a compressed dp reduction:
    ``engine_refusal``), sequence parallelism only with tp > 1; ``recompute``: the
    kinds tried ("selective" is skipped when others are tried too and attention is fused: it is then
    the same as "off"). ``cp``: context parallelism is searched over the sizes ``c`` with ``seq_len`` divisible
    by ``2 c`` (the zig-zag stripes; others are never proposed) and stripes ``seq_len / 2c`` of at least
    ``MIN_CP_STRIPE`` tokens. ``dp``/``tp``/``pp``/``cp``
    > 0 fix that axis and ``micro_batch`` > 0 fixes the sequences per micro-batch, per forward on each
    replica (the trainer's ``train.micro_batch_size``; a GIVEN layout: ``hpctrain plan --tp 8 --pp 16
    --micro-batch 1``, or a TOML's ``[parallel]`` section and ``train.micro_batch_size``). ``ep`` > 0 fixes
    expert parallelism (an MoE model; 0: every ep that divides dp x cp and the experts)."""

    dp: int = 0
    tp: int = 0
    pp: int = 0
    cp: int = 0
    micro_batch: int = 0
    zero: tuple[int, ...] = ZERO_STAGES
    sequence_parallel: tuple[bool, ...] = (False, True)
    recompute: tuple = ("off", "selective", "full")
    microbatches: tuple[int, ...] = ()
    schedule: str = "1f1b"
    ep: int = 0
    tp_across_nodes: bool = False  # search tp groups that span nodes (tp not dividing the ranks per node)


@dataclass(frozen=True)
class Prediction:
    """A feasible layout with its predicted step time and memory."""

    candidate: Candidate
    time: StepTime
    memory: Memory
    devices: int
    peak_tflops: float
    model_flops_per_token: float
    placement: dict
    virtual_stages: int = 1
    zero_prefetch: int = 1
    zero_reshard_after_forward: bool = True

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens / self.time.step_s

    @property
    def tflops_per_device(self) -> float:
        """Executed FLOP/s per device in TFLOP/s (recomputation included: Megatron's convention)."""
        return self.time.executed_flops / self.time.step_s / self.devices / 1e12

    @property
    def model_tflops_per_device(self) -> float:
        """Model FLOP/s per device in TFLOP/s (``flops_per_token``: the trainer's MFU count)."""
        return self.model_flops_per_token * self.tokens_per_s / self.devices / 1e12

    def to_dict(self) -> dict:
        lay = self.candidate.layout
        ideal = self.time.compute_s + self.time.tp_comm_s + self.time.cp_comm_s + self.time.pp_comm_s
        ideal += self.time.ep_comm_s
        return {
            "dp": lay.dp_size, "cp": lay.cp_size, "tp": lay.tp_size, "pp": lay.pp_size, "ep": lay.ep_size,
            "microbatches": lay.microbatches, "seq_chunk": lay.seq_chunk,
            "micro_batch": lay.micro_batch, "global_batch": lay.global_batch, "seq_len": lay.seq_len,
            "schedule": lay.schedule, "zero": lay.zero, "sequence_parallel": lay.sequence_parallel,
            "recompute": self.candidate.recompute, "virtual_stages": self.virtual_stages,
            "predicted_step_s": self.time.step_s, "predicted_tokens_per_s": self.tokens_per_s,
            "predicted_tflops_per_device": self.tflops_per_device,
            "model_tflops_per_device": self.model_tflops_per_device,
            "mfu": self.model_tflops_per_device / self.peak_tflops if self.peak_tflops else None,
            "memory_gib_per_device": self.memory.total_gib,
            "memory_gib": self.memory.breakdown(),
            "breakdown_s": self.time.breakdown(),
            "bubble_fraction": self.time.bubble_s / ideal if ideal else 0.0,
            "placement": self.placement,
            **({"zero_prefetch": self.zero_prefetch, "zero_reshard_after_forward": self.zero_reshard_after_forward}
               if lay.zero == 3 else {}),
            "warnings": self.warnings(),
        }

    def warnings(self) -> list[str]:
        """What a user should not miss about this layout (e.g. a bubble larger than the work)."""
        lay, out = self.candidate.layout, []
        if lay.pp_size > 1 and lay.microbatches < lay.pp_size:
            ideal = self.time.compute_s + self.time.tp_comm_s + self.time.cp_comm_s + self.time.pp_comm_s
            ideal += self.time.ep_comm_s
            out.append(f"{lay.microbatches} micro-batch(es) < pp={lay.pp_size}: the pipeline bubble is "
                       f"{self.time.bubble_s / ideal if ideal else 0:.0%} of the ideal step; use at least pp "
                       f"micro-batches (a larger global batch or a smaller --micro-batch)")
        return out


@dataclass(frozen=True)
class Infeasible:
    layout: dict
    reason: str

    def to_dict(self) -> dict:
        return {"layout": self.layout, "reason": self.reason}


@dataclass
class PlanResult:
    """Feasible predictions best first, and why the others are not feasible."""

    plans: list[Prediction] = field(default_factory=list)
    infeasible: list[Infeasible] = field(default_factory=list)
    evaluated: int = 0
    tp_across_nodes_skipped: int = 0  # (dp, cp, tp, pp) not searched: tp would span nodes


def engine_refusal(layout, options: Options, model, moe=None) -> str:
    """Why ``hpctrain train`` refuses ``layout`` with ``options`` beyond the layout rules ("" if it does not):
    the rules between config keys of ``config/validation.py`` (``problems``: compression at zero >= 2 or with
    ep > 1, LoRA targets, ...), applied to the run the plan describes, so the planner never proposes what
    the trainer (and ``hpctrain check``) refuses, whatever rules exist. ``model``: the resolved ModelConfig;
    ``moe``: its resolved ``[moe]`` section or None."""
    from hpctrain.config import CompressionConfig, Config, LoraConfig, ModelConfig, ParallelConfig, TrainConfig
    from hpctrain.config.moe_keys import MoeConfig
    from hpctrain.config.validation import problems

    if not isinstance(model, ModelConfig):  # a published run's Shape (shapes.py): another engine's run
        return ""
    if model.positions != "learned" and layout.seq_len > model.max_seq_len:  # planned as a context extension
        model = dataclasses.replace(model, max_seq_len=layout.seq_len)  # (commands/plan.py, _long_context)
    interleaved = layout.schedule == "interleaved"
    cfg = Config(model=model, moe=moe if moe is not None else MoeConfig(),
                 parallel=ParallelConfig(dp=layout.dp_size, pp=layout.pp_size, tp=layout.tp_size, cp=layout.cp_size,
                                         ep=layout.ep_size, zero=layout.zero, sequence_parallel=layout.sequence_parallel,
                                         microbatches=layout.microbatches, schedule=layout.schedule,
                                         virtual_stages=options.virtual_stages if interleaved else layout.virtual_stages,
                                         zero_prefetch=options.zero_prefetch,
                                         zero_reshard_after_forward=options.zero_reshard_after_forward),
                 train=TrainConfig(global_batch=layout.global_batch, seq_len=layout.seq_len, dtype=options.dtype),
                 # 1-bit Adam's warm-up length is the user's key, not the layout's: any will do here
                 compression=CompressionConfig(method=options.compression, warmup_steps=1),
                 lora=LoraConfig(rank=options.lora_rank, targets=list(options.lora_targets)) if options.lora_rank
                 else LoraConfig())
    found = problems(cfg)
    return str(found[0]).removeprefix("config: ") if found else ""


def expert_refusal(layout, moe) -> str:
    """Why ``layout.ep_size`` does not fit the model's experts ("" if it does): ep > 1 without experts, or an
    ep that does not divide ``moe.num_experts`` (hpctrain/config/validation.py; ``Layout.validate`` checks
    that it divides dp x cp)."""
    ep = layout.ep_size
    if moe is None:
        return "" if ep == 1 else f"parallel.ep={ep} splits experts, but the model has none (moe.num_experts = 0)"
    if moe.num_experts % ep:
        return f"parallel.ep={ep} does not divide moe.num_experts={moe.num_experts}"
    return ""


def expert_parallel_sizes(replica_size: int, moe, fixed: int = 0) -> list[int]:
    """The ep searched for a replica group of ``replica_size`` (dp x cp) ranks: 1 for a dense model, else each
    divisor of it that divides ``moe.num_experts`` (``fixed`` > 0: that one only; the layout rules and
    ``expert_refusal`` then say why it does not fit)."""
    if fixed:
        return [fixed]
    if moe is None:
        return [1]
    return [e for e in divisors(replica_size) if moe.num_experts % e == 0]


def predict(model, layout, machine, recompute="off", options: Options = Options(), moe=None) -> Prediction:
    """Time and memory of ``layout`` (raises its LayoutError/GridError if it is not valid, PlanError if the
    engine refuses it with ``options``: ``engine_refusal``, or its ep does not fit ``moe``: ``expert_refusal``;
    the vocabulary is padded for its tp first, as the trainer does); MFU counts the true vocabulary and the
    active parameters of an MoE model (``moe``: its resolved ``[moe]`` section, None = dense)."""
    layout.validate(for_tp(model, layout.tp_size))
    if refusal := expert_refusal(layout, moe) or engine_refusal(layout, options, model, moe):
        raise PlanError(refusal)
    return _predict(model, layout, machine, recompute, options, memory(model, layout, recompute, options, moe), moe)


def _predict(model, layout, machine, recompute, options: Options, mem: Memory, moe=None) -> Prediction:
    """``predict`` of a layout already validated, its memory ``mem`` known."""
    cand = Candidate(layout, recompute)
    t, c, p = layout.tp_size, layout.cp_size, layout.pp_size
    placement = {axis: machine.placement(stride, size).level
                 for axis, stride, size in (("tp", 1, t), ("cp", t, c), ("pp", t * c, p),
                                            ("dp", t * c * p, layout.dp_size))}
    if layout.ep_size > 1:
        placement["ep"] = ep_placements(machine, layout)[0].level
    return Prediction(cand, step_time(model, cand, machine, options, moe), mem,
                      machine.devices, machine.device.peak(options.dtype),
                      model_flops_per_token(model, layout.seq_len, options.lora_rank, options.lora_targets, moe=moe),
                      placement, options.virtual_stages,
                      options.zero_prefetch, options.zero_reshard_after_forward)


def _describe(lay: Layout, recompute: str = "off") -> dict:
    d: dict[str, object] = {"dp": lay.dp_size, "tp": lay.tp_size, "pp": lay.pp_size, "microbatches": lay.microbatches}
    if lay.cp_size > 1:
        d["cp"] = lay.cp_size
    if lay.ep_size > 1:
        d["ep"] = lay.ep_size
    if lay.sequence_parallel:
        d["sequence_parallel"] = True
    if lay.zero:
        d["zero"] = lay.zero
    if recompute != "off":
        d["recompute"] = recompute
    return d


def _searched_cp(seq_len: int, cp: int) -> bool:
    """Whether the search tries ``cp``: no cp, or 2 x cp zig-zag stripes of at least MIN_CP_STRIPE tokens."""
    return cp == 1 or (seq_len % (2 * cp) == 0 and seq_len // (2 * cp) >= MIN_CP_STRIPE)


def plan(model, machine, global_batch: int, seq_len: int, options: Options = Options(),
         space: SearchSpace = SearchSpace(), moe=None) -> PlanResult:
    """Every (dp, cp, tp, pp) of ``machine.devices`` ranks (x ep for an MoE model: ``moe``, its resolved
    ``[moe]`` section) x the choices of ``space``, ranked best first."""
    world, capacity = machine.devices, machine.memory_gib()
    result = PlanResult()
    for tp in [t for t in divisors(world) if space.tp in (0, t)]:
        for cp in [c for c in divisors(world // tp) if space.cp == c or (not space.cp and _searched_cp(seq_len, c))]:
            for pp in [p for p in divisors(world // (tp * cp)) if space.pp in (0, p)]:
                if machine.gpus_per_node % tp and not (space.tp_across_nodes or space.tp):  # a tp given is kept
                    result.tp_across_nodes_skipped += 1  # every layer's collectives would cross the network
                    continue
                dp = world // (tp * cp * pp)
                if space.dp and dp != space.dp:
                    continue
                for ep in expert_parallel_sizes(dp * cp, moe, space.ep):
                    # the sizes alone: a zero-bubble schedule's rules need the micro-batches (_search)
                    base = Layout(world, dp, pp, tp, 1, global_batch, seq_len, False, 0,
                                  "1f1b" if space.schedule in ZERO_BUBBLE_SCHEDULES else space.schedule, cp_size=cp,
                                  ep_size=ep)
                    try:
                        base.validate(for_tp(model, tp))
                        if refusal := expert_refusal(base, moe):
                            raise PlanError(refusal)
                    except HpcTrainError as exc:
                        result.infeasible.append(Infeasible(_describe(base), str(exc)))
                        continue
                    _search(model, machine, base, capacity, options, space, result, moe)
    result.plans.sort(key=lambda pr: (-pr.tokens_per_s, pr.memory.total_gib))
    return result


def _search(model, machine, base: Layout, capacity: float, options: Options, space: SearchSpace,
            result: PlanResult, moe=None) -> None:
    """The choices of one valid (dp, tp, pp): feasible ones into ``result.plans``; if none fits in memory,
    one entry (its least-memory choice) into ``result.infeasible``; rule violations once per reason."""
    local = base.global_batch // base.dp_size
    reasons: set[str] = set()
    fitted, smallest = False, None
    choices = space.microbatches or tuple(divisors(local))
    if space.micro_batch:
        if local % space.micro_batch:
            result.infeasible.append(Infeasible(_describe(base), f"micro-batch {space.micro_batch} does not divide "
                                                                 f"the replica batch {local} (global batch / dp)"))
            return
        choices = (local // space.micro_batch,)
    for mb in choices:
        if options.virtual_stages > 1 and base.pp_size > 1 and mb % base.pp_size:
            reason = (f"interleaving ({options.virtual_stages} virtual stages) needs the micro-batches ({mb}) to be "
                      f"a multiple of pp={base.pp_size}")
            if reason not in reasons:
                reasons.add(reason)
                result.infeasible.append(Infeasible({**_describe(base), "microbatches": mb}, reason))
            continue
        for sp in space.sequence_parallel if base.tp_size > 1 else (False,):
            for zero in space.zero if base.replica_size > 1 else (0,):
                lay = Layout(base.world_size, base.dp_size, base.pp_size, base.tp_size, mb, base.global_batch,
                             base.seq_len, sp, zero, space.schedule, cp_size=base.cp_size, ep_size=base.ep_size,
                             virtual_stages=2 if space.schedule == "zb-v" else 1)  # zb-v: the V shape
                try:
                    lay.validate(for_tp(model, lay.tp_size))
                    if refusal := engine_refusal(lay, options, model, moe):
                        raise PlanError(refusal)
                except HpcTrainError as exc:
                    if str(exc) not in reasons:
                        reasons.add(str(exc))
                        result.infeasible.append(Infeasible(_describe(lay), str(exc)))
                    continue
                kinds = [Candidate(lay, r).recompute for r in space.recompute]
                if options.flash_attention and len(kinds) > 1:
                    kinds = [k for k in kinds if k != "selective"]
                for recompute in kinds:
                    result.evaluated += 1
                    mem = memory(model, lay, recompute, options, moe)
                    if mem.total_gib > capacity:
                        if smallest is None or mem.total_gib < smallest[0].total_gib:
                            smallest = (mem, lay, recompute)
                        continue
                    fitted = True
                    result.plans.append(_predict(model, lay, machine, recompute, options, mem, moe))
    if not fitted and smallest is not None:
        mem, lay, recompute = smallest
        parts = ", ".join(f"{k} {v:.1f}" for k, v in mem.breakdown().items())
        result.infeasible.append(Infeasible(_describe(lay, recompute), (
            f"memory: needs {mem.total_gib:.1f} GiB per device > {capacity:.1f} GiB ({parts} GiB, stage "
            f"{mem.stage}) even with its least-memory choice")))
