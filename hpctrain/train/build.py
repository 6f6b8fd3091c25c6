"""The composition root of a training step: ``build_step(cfg, grid, device)`` assembles every part one rank's
step uses, in one place, asking each part what it needs (no string modes).

Parts, in the order they are built (each line: the part, what it talks on):

- the model: this pp rank's virtual stages (``build_stages``: tp layers over ``grid.comm("tp")``, ring
  attention over ``grid.comm("cp")``), compiled per block (``train.compile``), with SDPA's fastest kernels
  timed once on the device (every rank takes rank 0's choice: one allgather over the world), and at tp = 1
  the last stage's fused head + loss kernel likewise (``model.head_kernel``: hpctrain's, Liger's or CCE's);
- the parameter engine (``build_param_engine``, hpctrain/parallel/zero/engine.py): where each parameter's bytes
  live. The trainable parameters' flat buffers and gradient reducer over the replica group
  ``grid.comm(grid.replica_axis)`` (dp, or dp x cp; compressed: hpctrain/compression/), sliced by
  ``parallel.zero``, with expert parallelism the experts' over ``grid.comm("ep_replica")``; at zero 3 the
  frozen base's slices and the gatherer of each unit around its forward and backward;
- the optimizer (``build_optimizer``, hpctrain/optim/group.py): AdamW/SGD on the owned slices of each group;
  1-bit Adam's binding is made there and only there;
- ``PipelineExecutor``: the schedule over ``grid.comm("pp")``;
- ``DynamicLossScaler`` (float16) and ``StepOutcomes``: the step's one world reduction and its outcome,
  read when the reducer needs it (hpctrain/train/outcomes.py);
- the data: the corpus (rank 0 reads, broadcast over the world) and this dp rank's batch iterator; with
  context parallelism every cp rank of a replica reads the same samples.

The torchtitan "train spec" idea, without a registry: plain builder functions, one dataclass out.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hpctrain.config import resolve_model
from hpctrain.config.moe_keys import resolve_moe
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.data.packing import samplers_for
from hpctrain.data.prepared import check_corpus
from hpctrain.data.sampler import GlobalBatchIterator
from hpctrain.errors import HpcTrainError
from hpctrain.models.attention_backend import choose_sdpa, use_sdpa
from hpctrain.models.compile import compile_stages, compile_wanted, whole_stage_wanted
from hpctrain.models.gpt import GPTStage, flops_per_token, partition_layers, residual_dtype
from hpctrain.models.moe import MoeStepStats
from hpctrain.optim.group import OptimizerGroup, build_optimizer
from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.parallel.param_init import give_storage
from hpctrain.config.layout import Layout
from hpctrain.config.rules import padded_vocab
from hpctrain.parallel.head_kernels import HeadKernelChoice, HeadShape, choose_head_kernel, trial as head_trial
from hpctrain.parallel.head_loss import chunk_tokens
from hpctrain.parallel.pipeline_parallel import PipelineExecutor
from hpctrain.parallel.schedules import schedule_bubble
from hpctrain.parallel.zero.engine import ParamEngine, build_param_engine
from hpctrain.parallel.zero_bubble import virtual_stage
from hpctrain.profiling.timers import PhaseTimer
from hpctrain.runtime import env
from hpctrain.runtime.device import configure_matmul, peak_tflops
from hpctrain.runtime.host_malloc import configure_host_malloc
from hpctrain.runtime.dtypes import torch_dtype
from hpctrain.runtime.faults import FaultInjector
from hpctrain.train.outcomes import StepOutcomes


@dataclass
class DataParts:
    """The training samples (``sampler``: windows, or packed SFT examples), the held-out ones
    (``valid_sampler``) and this dp rank's global-batch iterator over the training samples (``batches``)."""
    sampler: Any
    valid_sampler: Any
    batches: GlobalBatchIterator


@dataclass
class StepParts:
    """Everything one rank's step uses (``build_step``). ``stages``: this pp rank's virtual stages, one
    ``GPTStage`` each (``local_model`` holds them all); ``sdpa``: the attention kernels chosen;
    ``head_kernel``: the last stage's head + loss kernel chosen (hpctrain/parallel/head_kernels.py);
    ``compile_since``: torch.compile's counters before compiling (``--verbose``'s report)."""
    model_cfg: Any
    layout: Layout
    dtype: torch.dtype
    timer: PhaseTimer
    faults: FaultInjector
    backends: dict
    stages: list[GPTStage]
    local_model: torch.nn.ModuleList
    compiled: bool
    compile_since: dict | None
    sdpa: Any
    head_kernel: HeadKernelChoice
    params: ParamEngine  # where every parameter's bytes live (hpctrain/parallel/zero/engine.py)
    moe_stats: MoeStepStats | None  # a model with experts: the step's routing counts and auxiliary losses
    optimizer: OptimizerGroup  # one FlatOptimizer per params.flat part (hpctrain/optim/group.py)
    executor: PipelineExecutor
    scaler: DynamicLossScaler
    outcomes: StepOutcomes
    data: DataParts
    flops_per_token: float
    peak_tflops: float
    bubble: float
    build_s: float  # seconds to build the model and create this rank's parameter bytes
    host_malloc: str = ""  # train.host_malloc's words for --verbose (hpctrain/runtime/host_malloc.py)

    @property
    def reducer(self):
        return self.params.reducer


def build_stages(m, layout: Layout, pp_rank: int, tp_comm, dtype: torch.dtype, seed: int, recompute: bool,
                 cp_comm=None, lora=None, moe=None, ep_comm=None) -> list[GPTStage]:
    """The virtual stages of pp rank ``pp_rank``: its c-th is virtual stage v = c * pp + pp_rank (zb-v: the V
    shape, pp_rank and 2 pp - 1 - pp_rank: ``zero_bubble.virtual_stage``) of the pp x V (V =
    ``layout.virtual_stages``), whose layers ``partition_layers`` balances over them (or
    ``stage_layers`` gives, one entry per virtual stage). The embedding is on v = 0, the norm and LM head on
    the last; a tied embedding's copy lives there (its grad is summed over pp with rank 0's). ``lora``: the
    ``[lora]`` section (rank > 0: adapters, the rest frozen); ``moe``: the resolved ``[moe]`` section (None:
    dense), its experts split over ``ep_comm``."""
    pp, per_rank = layout.pp_size, layout.virtual_stages
    ranges = partition_layers(m, pp * per_rank, list(layout.stage_layers), moe=moe)  # MoE blocks weigh more
    stages = []
    for c in range(per_rank):
        v = virtual_stage(pp_rank, c, pp, v_shape=layout.schedule == "zb-v")
        stages.append(GPTStage(m, ranges[v], is_first=v == 0, is_last=v == pp * per_rank - 1, tp_comm=tp_comm,
                               sp=layout.sequence_parallel, dtype=dtype, seed=seed, recompute=recompute,
                               cp_comm=cp_comm, lora=lora, moe=moe, ep_comm=ep_comm))
    return stages


def build_data(cfg, grid, layout: Layout, model_cfg, faults: FaultInjector, tokens=None) -> DataParts:
    """Collective over the world unless ``tokens`` is given: the corpus (read by rank 0, broadcast; every rank
    opens a prepared or SFT one), checked against the model's vocabulary, and this dp rank's iterator."""
    if tokens is None:
        faults.hit("corpus", 0)  # test-only: a rank stopped here leaves the others in the broadcast
        # rank 0 reads (tokenizes) the corpus while the others wait: watched, so it counts against
        # comm.timeout_s (prepare a large corpus with `hpctrain data prepare`: every rank reads it)
        with grid.world.watched("corpus broadcast"):
            tokens = load_tokens_collective(grid.world.mpi, cfg.data.source, env.cache_dir(cfg.data.cache_dir),
                                            cfg.data.max_bytes)
    check_corpus(tokens, cfg.data.tokenizer, model_cfg.vocab_size, cfg.data.source)
    sampler, valid = samplers_for(tokens, cfg.data.valid_fraction, cfg.train.seq_len, cfg.train.seed)
    return DataParts(sampler, valid, GlobalBatchIterator(sampler, cfg.train.global_batch, layout.dp_size,
                                                         grid.coords["dp"]))


def build_step(cfg, grid, device: torch.device, tokens=None) -> StepParts:
    """Collective over the world (the grid's device backends, the attention trial's allgather, the corpus
    broadcast, the outcome's persistent all-reduce): this rank's ``StepParts``."""
    layout = grid.layout or Layout.from_config(cfg, grid.info.size)  # validated before anything runs
    if layout.sizes != grid.sizes:
        raise HpcTrainError(f"the grid {grid.sizes} does not match the configured layout {layout.sizes}")
    t, m = cfg.train, resolve_model(cfg.model)
    timer = PhaseTimer()  # where the step's time goes; a TraceRecorder may be attached (train.trace)
    faults = FaultInjector.from_env(grid.info.rank)  # test-only (HPCTRAIN_FAULT)
    backends = grid.use_device(device)
    configure_matmul(device, t.allow_tf32)
    host_malloc = configure_host_malloc(t.host_malloc, device)  # before the model's and the step's allocations
    dtype = torch_dtype(t.dtype)
    torch.manual_seed(t.seed * 100_003 + grid.info.rank)  # derived per rank, never shared by accident
    tp_comm, pp_comm = grid.comm("tp"), grid.comm("pp")
    moe = resolve_moe(cfg.moe, m)
    built = time.perf_counter()
    with torch.device("meta"):  # shapes only: each rank's bytes are created where they live, below
        stages = build_stages(m, layout, grid.coords["pp"], tp_comm, dtype, t.seed, t.recompute,
                              cp_comm=grid.comm("cp"), lora=cfg.lora, moe=moe,
                              ep_comm=grid.comm("ep") if layout.ep_size > 1 else None)
    local_model = torch.nn.ModuleList(stages)  # train()/eval()/parameters() of every stage
    give_storage(local_model, device)  # the same parameters, on the device, still without storage
    compiled = compile_wanted(t.compile, device)  # every block compiled in place (models/compile.py)
    whole = t.compile_regions == "auto" and whole_stage_wanted(layout, cfg.lora.rank, moe, t.fp8)  # one region
    compile_since = compile_stages(stages, whole, grid.info.local_size) if compiled else None
    # where each parameter's bytes live (hpctrain/parallel/zero/engine.py): the flat buffers and reducers, the
    # frozen base's slices and ZeRO-3's gatherer; then the optimizer over the owned slices
    params = build_param_engine(stages, local_model, grid, layout, cfg, device=device, dtype=dtype, timer=timer)
    one_pass = cfg.optim.update == "compiled" or (cfg.optim.update == "auto" and compiled)  # optim/one_pass.py
    optimizer = build_optimizer(params.flat, cfg, tp_rank=grid.coords["tp"], one_pass=one_pass)
    build_s = time.perf_counter() - built  # the model built and this rank's bytes created (drawn or placed)
    executor = PipelineExecutor(stages, pp_comm if layout.pp_size > 1 else None, params.flat, layout.schedule,
                                layout.microbatches, (layout.seq_chunk, layout.micro_batch, m.d_model),
                                residual_dtype(m, dtype), device=device, timer=timer,
                                after_backward=params.after_backward)
    scaler = DynamicLossScaler(t.loss_scale, enabled=dtype == torch.float16, device=device)
    reducer = params.reducer
    outcomes = StepOutcomes(grid.world, device, scaler, reducer,
                            read_before_update=reducer.outcome_before_update or optimizer.outcome_before_update,
                            may_defer=not reducer.outcome_before_next_step,
                            clip=cfg.optim.grad_clip, nonfinite=t.nonfinite, max_skipped_steps=t.max_skipped_steps)
    data = build_data(cfg, grid, layout, m, faults, tokens)
    masked = m.attention_window > 0 or hasattr(data.sampler, "describe")  # a window or packed documents
    sdpa = use_sdpa(local_model, choose_sdpa(
        device, dtype, m.d_model // m.n_heads, masked, seq=t.seq_len, heads=max(1, m.n_heads // layout.tp_size),
        batch=layout.micro_batch, gather=grid.world.allgather_object))  # every rank takes the same kernels
    head_kernel = choose_head_kernel(  # collective over the world, as SDPA's; ranks without the last stage wait
        m.head_kernel, device, dtype, layout.tp_size, m.fused_head_loss,
        HeadShape(layout.micro_batch * t.seq_len // layout.cp_size, m.d_model, m.vocab_size,
                  padded_vocab(m, layout.tp_size) // layout.tp_size, m.loss_chunk_tokens),
        probe=head_probe(stages), gather=grid.world.allgather_object, probe_here=any(s.is_last for s in stages))
    for stage in stages:
        if stage.is_last:
            setattr(stage, "head_kernel", head_kernel.fn)  # GPTStage.forward_loss calls it (None: hpctrain's)
    return StepParts(
        model_cfg=m, layout=layout, dtype=dtype, timer=timer, faults=faults, backends=backends, stages=stages,
        local_model=local_model, compiled=compiled, compile_since=compile_since, sdpa=sdpa,
        head_kernel=head_kernel, params=params, host_malloc=host_malloc,
        moe_stats=MoeStepStats(stages, moe, grid.world, t.global_batch) if moe else None,
        optimizer=optimizer, executor=executor, scaler=scaler, outcomes=outcomes, data=data,
        flops_per_token=flops_per_token(m, t.seq_len, cfg.lora.rank, cfg.lora.targets, moe=moe),  # active params
        peak_tflops=t.peak_tflops or peak_tflops(device, dtype, t.allow_tf32),
        # idle over ideal time with equal stages, (pp - 1) / (V M) (zero-bubble: their timeline's): printed at start-up
        bubble=schedule_bubble(layout.schedule, layout.pp_size, layout.microbatches, layout.virtual_stages),
        build_s=build_s)


def head_probe(stages: list[GPTStage]) -> Callable:
    """The head kernels' trial with hpctrain's own timed as this rank's last stage runs it: its compiled chunks
    when ``train.compile`` made them (``head_chunks``), else the eager ``fused_head_cross_entropy``."""
    last = next((s for s in stages if s.is_last), None)
    kernels = getattr(last, "head_chunks", None)
    if last is None or kernels is None:
        return head_trial
    from hpctrain.parallel.head_chunks import compiled_head_cross_entropy

    def own(h, w, targets):  # h [N, D], w [rows, D] (padded), targets [N], -100 = not counted
        chunk = chunk_tokens(last.loss_chunk, h.shape[0], w.shape[0])
        return compiled_head_cross_entropy(h, w, targets, last.tp_comm, last.vocab_start, last.vocab_valid, chunk,
                                           kernels, targets != -100)
    return partial(head_trial, own=own)
