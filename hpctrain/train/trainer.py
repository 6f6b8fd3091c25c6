"""The training loop: batch -> pipeline forward/backward -> DP reduction -> clip -> optimizer step -> metrics.

``Trainer(cfg, grid)`` builds this rank's pipeline model chunks of the GPT (one, or ``parallel.virtual_stages``
with the interleaved schedule: ``build_chunks``; tensor-parallel layers over ``grid.comm("tp")``, ring
attention over ``grid.comm("cp")``), their flat buffers and gradient reducer (over the replica group
``grid.comm(grid.replica_axis)``: dp, or dp x cp), the optimizer and the data iterator. With context
parallelism every cp rank of a dp replica reads the same samples and keeps its two zig-zag chunks.
An SFT corpus (hpctrain/data/packing.py) gives packed samples with a loss mask and document ids: the
loss is the sum of this rank's counted token losses over the global batch's counted tokens (known to
every rank from the sampler), the documents go to every model chunk (attention stays inside them).
``train_step`` runs one global batch; every rank returns the same metrics (loss and grad norm are
agreed by one collective on the device, hpctrain/train/verdict.py; the clip coefficient and the skip
decision stay on the device and reach the fused AdamW as tensors: no host read between the forward and
the optimizer; the host reads the verdict after the update is queued, or one step later).
"""
from __future__ import annotations

import time
from functools import partial

import torch

from hpctrain.config import resolve_model
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.data.packing import samplers_for
from hpctrain.data.prepared import check_corpus
from hpctrain.data.sampler import GlobalBatchIterator, rank_slice
from hpctrain.errors import HpcTrainError
from hpctrain.models.attention_backend import choose_sdpa, use_sdpa
from hpctrain.models.compile import compile_stages, compile_wanted
from hpctrain.models.gpt import flops_per_token, residual_dtype
from hpctrain.compression import build_reducer
from hpctrain.compression.reducer import DenseReducer
from hpctrain.optim.flat import FlatOptimizer, lr_at
from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.train.guard import DivergenceGuard
from hpctrain.parallel.context_parallel import zigzag_split
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.layout import Layout
from hpctrain.parallel.pipeline_parallel import PipelineExecutor, bubble_fraction
from hpctrain.profiling.timers import PhaseTimer
from hpctrain.runtime import env
from hpctrain.runtime.device import configure_matmul, peak_tflops
from hpctrain.runtime.dtypes import torch_dtype
from hpctrain.runtime.faults import FaultInjector
from hpctrain.train.state import TrainerState
from hpctrain.train.chunks import build_chunks
from hpctrain.train.step_metrics import StepMetrics, group_deltas
from hpctrain.train.verdict import StepVerdict


class Trainer:
    """One rank's share of the training step. ``device``: where parameters, gradients, optimizer state,
    batches and pipeline buffers live (default CPU); collective over the world (``grid.use_device``).
    ``state``: what checkpoints and ``model.init_from`` see of it (``TrainState``, hpctrain/train/state.py)."""

    def __init__(self, cfg, grid, tokens=None, device=None):
        self.cfg, self.grid = cfg, grid
        self.layout = grid.layout or Layout.from_config(cfg, grid.info.size)  # validated before anything runs
        if self.layout.sizes != grid.sizes:
            raise HpcTrainError(f"the grid {grid.sizes} does not match the configured layout {self.layout.sizes}")
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.timer = PhaseTimer()  # where the step's time goes; a TraceRecorder may be attached (train.trace)
        self.faults = FaultInjector.from_env(grid.info.rank)  # test-only (HPCTRAIN_FAULT)
        self.backends = grid.use_device(self.device)
        configure_matmul(self.device, cfg.train.allow_tf32)
        self.model_cfg = resolve_model(cfg.model)
        self.dtype = torch_dtype(cfg.train.dtype)
        torch.manual_seed(cfg.train.seed * 100_003 + grid.info.rank)  # derived per rank, never shared by accident
        self.local_batch, self.micro_batch = self.layout.local_batch, self.layout.micro_batch
        self._build_model()
        self._build_data(tokens)
        m = self.model_cfg  # SDPA's fastest kernels, timed once on this device (masked: a window or packed documents)
        masked = m.attention_window > 0 or hasattr(self.sampler, "describe")
        self.sdpa = use_sdpa(self.local_model, choose_sdpa(
            self.device, self.dtype, m.d_model // m.n_heads, masked,
            seq=cfg.train.seq_len, heads=max(1, m.n_heads // self.layout.tp_size), batch=self.micro_batch,
            gather=grid.world.allgather_object))  # every rank takes the same kernels
        self.step = 0
        self.flops_per_token = flops_per_token(self.model_cfg, cfg.train.seq_len, cfg.lora.rank, cfg.lora.targets)
        # idle over ideal time with equal stages, (pp - 1) / (V M) (``bubble_fraction``; printed at start-up)
        self.bubble = bubble_fraction(self.layout.pp_size, self.layout.microbatches, self.layout.virtual_stages)
        self.peak_tflops = cfg.train.peak_tflops or peak_tflops(self.device, self.dtype, cfg.train.allow_tf32)
        self.state = TrainerState(self)  # what checkpoints save and restore (hpctrain/checkpoint/contract.py)
        self._build_agreements()

    def _build_model(self) -> None:
        """This rank's model chunks (TP layers over tp), their flat buffers and DP reducer, optimizer, executor."""
        m, p, t, grid, layout = self.model_cfg, self.cfg.parallel, self.cfg.train, self.grid, self.layout
        tp_comm, pp_comm, cp_comm = grid.comm("tp"), grid.comm("pp"), grid.comm("cp")
        self.chunks = build_chunks(m, layout, grid.coords["pp"], tp_comm, self.dtype, t.seed, t.recompute,
                                   cp_comm=cp_comm, lora=self.cfg.lora)
        self.local_model = torch.nn.ModuleList(self.chunks)  # train()/eval()/parameters() of every chunk
        self.local_model.to(self.device)  # initialised on the host from the global generator, then moved
        self.compiled = compile_wanted(t.compile, self.device)  # every block compiled in place (models/compile.py)
        self.compile_since = compile_stages(self.chunks) if self.compiled else None  # for --verbose's report
        # the trainable parameters (a LoRA run's adapters; the frozen base stays plain tensors on the device)
        self.flat = FlatParams([p for p in self.local_model.parameters() if p.requires_grad],
                               grid.comm(grid.replica_axis),
                               tp_comm=tp_comm, pp_comm=pp_comm,
                               bucket_mb=p.bucket_mb, zero=layout.zero == 1, timer=self.timer,
                               check_finite=self.dtype == torch.float16,
                               make_reducer=partial(build_reducer, self.cfg.compression, grid=grid, seed=t.seed,
                                                    optimizer=self.cfg.optim.name, steps=t.steps))
        comp = self.cfg.compression  # 1-bit Adam: AdamW's variance frozen after the dense warm-up
        freeze = comp.warmup_steps if comp.method == "onebit-adam" else None
        self.optimizer = FlatOptimizer(self.flat, self.cfg.optim, tp_rank=grid.coords["tp"], freeze_variance_after=freeze)
        self.flat.reducer.bind_optimizer(self.optimizer)
        self.executor = PipelineExecutor(self.chunks, pp_comm if layout.pp_size > 1 else None, self.flat,
                                         layout.schedule, layout.microbatches,
                                         (layout.seq_chunk, self.micro_batch, m.d_model),
                                         residual_dtype(m, self.dtype), device=self.device, timer=self.timer)
        self.scaler = DynamicLossScaler(t.loss_scale, enabled=self.dtype == torch.float16, device=self.device)
        self.guard = DivergenceGuard(t.nonfinite, t.max_skipped_steps)
        self.diverged = None  # the last step's Verdict when the run must stop (non-finite, too many skips)

    def _build_agreements(self) -> None:
        """Collective, in this order on every rank: the step's one reduction (``StepVerdict``: loss, squared
        grad norm and stop request summed over the world, on the training device) and, for ``evaluate``, the
        loss agreement on a host float64 [1] (broadcast from the last stage over pp, summed over the replicas
        dp x cp). ``readback``: when the host reads a step's verdict: "before" the update (1-bit Adam commits
        the reducer's momentum first), "after" it is queued (compressors: their error memory learns of skips
        and scale changes before the next step), or "late" (one step later with ``train_step(defer=True)``;
        otherwise right after)."""
        grid, t = self.grid, self.cfg.train
        pp_comm = grid.comm("pp")
        self._loss_value = torch.zeros(1, dtype=torch.float64)
        self._loss_ops = [pp_comm.recurring_broadcast(self._loss_value, root=pp_comm.size - 1)] \
            if pp_comm.size > 1 else []
        self._loss_ops.append(grid.comm(grid.replica_axis).recurring_allreduce(self._loss_value))
        self.verdict = StepVerdict(grid.world, self.device, clip=self.cfg.optim.grad_clip, nonfinite=t.nonfinite,
                                   max_skipped_steps=t.max_skipped_steps, scaler_enabled=self.scaler.enabled)
        self.readback = "before" if self.optimizer.freeze_variance_after is not None else \
            "late" if isinstance(self.flat.reducer, DenseReducer) else "after"
        self.pending: StepMetrics | None = None  # a deferred step whose verdict the host has not read
        self.resolved: list[StepMetrics] = []  # metrics read so far (the loop logs and empties it)
        self.agreed_stop = ""  # the agreed stop request, once read

    def _build_data(self, tokens) -> None:
        """The corpus (read by rank 0, broadcast; every rank opens a prepared or SFT one) and this dp rank's
        (seed, index) batch iterator."""
        cfg, grid = self.cfg, self.grid
        if tokens is None:
            self.faults.hit("corpus", 0)  # test-only: a rank stopped here leaves the others in the broadcast
            # rank 0 reads (tokenizes) the corpus while the others wait: watched, so it counts against
            # comm.timeout_s (prepare a large corpus with `hpctrain data prepare`: every rank reads it)
            with grid.world.watched("corpus broadcast"):
                tokens = load_tokens_collective(grid.world.mpi, cfg.data.source, env.cache_dir(cfg.data.cache_dir),
                                                cfg.data.max_bytes)
        check_corpus(tokens, cfg.data.tokenizer, self.model_cfg.vocab_size, cfg.data.source)
        self.sampler, self.valid_sampler = samplers_for(tokens, cfg.data.valid_fraction, cfg.train.seq_len,
                                                        cfg.train.seed)  # windows, or packed SFT examples
        self.batches = GlobalBatchIterator(self.sampler, cfg.train.global_batch, self.layout.dp_size,
                                           grid.coords["dp"])

    # ------------------------------------------------------------------ one step
    def train_step(self, stop_request: str = "", defer: bool = False) -> StepMetrics:
        """One global batch. ``stop_request``: this rank's wish to stop after this step (hpctrain/train/stop.py),
        agreed in the step's reduction: ``agreed_stop`` once read. ``defer`` (with ``readback == "late"``):
        read this step's verdict at the end of the next step, so the host never waits on the device inside
        a step; the returned metrics' loss, grad_norm, skipped and loss_scale are None until then. Every
        metrics read is appended to ``resolved``; ``read_pending()`` reads a deferred one now."""
        t, grid, timer = self.cfg.train, self.grid, self.timer
        if timer.trace is not None:
            timer.trace.begin_step(self.step + 1)
        start, groups_before = time.perf_counter(), grid.stats.by_group()
        with timer.phase("data"):
            counted = self.sampler.counted(self.batches.consumed, t.global_batch)  # the loss's denominator
            inputs, targets, packing = self._feed(self.batches.next_batch())
        global_tokens = t.global_batch * t.seq_len

        self.local_model.train()
        self.flat.start_step()
        reducer = self.flat.reducer
        reducer.begin_step(self.step, self.scaler.scale)  # the host's scale: current where a reducer needs it
        scale = self.scaler.scale_tensor if self.scaler.enabled else 1.0  # float16: moved on the device
        self.faults.hit("forward", self.step + 1)
        # no counted token (impossible with `data prepare` output): loss 0, zero gradients
        scaled_loss = self.executor.run(inputs, targets, scale / max(counted, 1), **packing)
        self.faults.hit("backward", self.step + 1)
        with timer.phase("dp_wait"):
            self.flat.finish_reduction()
        with timer.phase("loss"):  # counted once: tp rank 0 of the last stage (0.0 elsewhere)
            loss_share = scaled_loss / scale if grid.coords["tp"] == 0 else 0.0
        with timer.phase("grad_norm"):  # the loss, the norm and the stop request: one all-reduce, on the device
            inv = 1.0 / scale
            self.verdict.reduce(loss_share, self.optimizer.grad_norm_sq_tensor() * inv * inv, stop_request,
                                reducer.overflow)
            coef, found_inf = self.verdict.decide(self.scaler)
        lr = lr_at(self.step, t)
        metrics = StepMetrics(self.step + 1, None, lr, None, 0.0, 0.0, 0.0, None, None, None)
        if self.readback == "before":  # 1-bit Adam: the reducer commits its momentum before the update
            self.verdict.start_read()
            self._resolve(metrics)
        self.faults.hit("optimizer", self.step + 1, self.flat.param_buffer)
        if self.readback != "before" or not metrics.skipped:
            with timer.phase("optimizer"):
                self.optimizer.step(lr, coef, found_inf if self.readback != "before" else None)
        self.step = metrics.step
        if self.readback != "before":
            if self.pending is not None:  # the previous step's copy: long done, no wait in steady state
                self._resolve(self.pending)
            if self.diverged is None:  # else this step is dropped: its update was skipped on the device
                self.verdict.start_read()
                self.pending = metrics
                if not (defer and self.readback == "late"):
                    self.read_pending()
        elapsed, peak = time.perf_counter() - start, self.peak_tflops
        groups = group_deltas(groups_before, grid.stats.by_group())
        metrics.__dict__.update(step_time_s=elapsed, tokens_per_s=global_tokens / elapsed, groups=groups,
                                comm_time_s=sum(g["comm_s"] for g in groups.values()),
                                bytes_sent=sum(g["bytes_sent"] for g in groups.values()), **reducer.step_stats(),
                                time_s={k: round(v, 6) for k, v in timer.collect(elapsed).items()})
        metrics.mfu = self.flops_per_token * metrics.tokens_per_s / (peak * 1e12 * grid.info.size) if peak > 0 else None
        return metrics

    def read_pending(self) -> None:
        """Read the deferred step's verdict now (waits for the device); nothing once the run diverged."""
        if self.pending is not None and self.diverged is None:
            self._resolve(self.pending)

    def _resolve(self, metrics: StepMetrics) -> None:
        """The host's view of ``metrics.step``'s verdict (its last ``start_read``): the guard judges the agreed
        loss and norm as the device did (and moves the float16 scale), the reducer learns the outcome."""
        if metrics is self.pending:
            self.pending = None
        verdict, request = self.verdict.judge(metrics, self.guard, self.scaler, self.flat.reducer)
        self.agreed_stop = self.agreed_stop or request
        if verdict.stop:  # later updates were skipped on the device: the state is that before this step
            self.diverged, self.step = verdict, metrics.step
        self.resolved.append(metrics)

    def evaluate(self) -> float:
        """Collective: the mean token loss over the validation batches (``train.eval_steps`` global batches
        of held-out samples 0, 1, ...: the same every time and in every layout); forward only. SFT data:
        each batch's loss is over its counted tokens, as in training."""
        t, sampler = self.cfg.train, self.valid_sampler
        offset, count = rank_slice(t.global_batch, self.layout.dp_size, self.grid.coords["dp"])
        self.local_model.eval()
        total = 0.0
        with self.timer.phase("eval"):
            for k in range(t.eval_steps):
                inputs, targets, packing = self._feed(sampler.batch(k * t.global_batch + offset, count))
                scale = 1.0 / max(sampler.counted(k * t.global_batch, t.global_batch), 1)
                total += self._agree_loss(self.executor.evaluate(inputs, targets, scale, **packing))
        self.local_model.train()
        return total / t.eval_steps

    def _feed(self, batch) -> tuple[list, list, dict]:
        """This rank's batch (inputs, targets[, loss_mask, docs]) -> per micro-batch lists on the device: inputs,
        targets and the executor's {"masks", "docs"} (empty for pretraining). Tokens and mask are cut over cp
        (``_cp_part``); docs stay whole (ring attention masks by global position)."""
        inputs, targets, *packed = batch
        parts = self._to_device(*self._cp_part(inputs, targets, *packed[:1]), *packed[1:])
        mb, n = self.micro_batch, self.layout.microbatches
        micro = [[part[i * mb:(i + 1) * mb] for i in range(n)] for part in parts]
        return micro[0], micro[1], dict(zip(("masks", "docs"), micro[2:]))

    def _cp_part(self, *batch: torch.Tensor) -> list[torch.Tensor]:
        """This cp rank's zig-zag chunks of each [B, S] batch tensor -> [B, S/cp] (unchanged when cp = 1)."""
        cp = self.layout.cp_size
        if cp == 1:
            return list(batch)
        return [zigzag_split(b, self.grid.coords["cp"], cp) for b in batch]

    def _to_device(self, *batch: torch.Tensor) -> list[torch.Tensor]:
        """Host batches to the device: pinned memory, non-blocking copies ordered on the current stream."""
        if self.device.type != "cuda":
            return list(batch)
        return [b.pin_memory().to(self.device, non_blocking=True) for b in batch]

    def _agree_loss(self, stage_loss: float) -> float:
        """The global mean token loss on every rank: from the last stage over pp, summed over dp x cp."""
        value = self._loss_value
        value[0] = stage_loss
        for op in self._loss_ops:
            op()
        return value.item()

    # ------------------------------------------------------------------ global view
    def global_parameters(self) -> dict | None:
        """Collective: every parameter at its GLOBAL shape on world rank 0 (None elsewhere).

        Built from the slab specs: TP slabs (their real rows) are placed at their slices; each dp x cp replica holds
        the same values, so only replica rank 0 contributes; the tied copy is skipped.
        """
        pieces = []
        if self.grid.coords["dp"] == 0 and self.grid.coords["cp"] == 0:
            for p in self.local_model.parameters():
                spec = p.spec  # type: ignore[attr-defined]  # the SlabSpec hpctrain attaches (parallel/slab.py)
                if not spec.tied_copy:
                    index = [(s.start, s.stop) for s in spec.local_slices()]
                    real = p.detach()[spec.valid_local()]  # without vocabulary padding rows
                    pieces.append((spec.name, spec.global_shape, index,
                                   real.to("cpu", torch.float64).numpy().copy()))
        gathered = self.grid.world.gather_object(pieces, root=0)
        if gathered is None:
            return None
        result: dict[str, torch.Tensor] = {}
        for rank_pieces in gathered:
            for name, shape, index, array in rank_pieces:
                full = result.setdefault(name, torch.full(shape, float("nan"), dtype=torch.float64))
                full[tuple(slice(a, b) for a, b in index)] = torch.from_numpy(array)
        return result
