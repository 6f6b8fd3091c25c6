"""One rank's training step: batch -> pipeline forward/backward -> replica reduction -> verdict -> update.

``Trainer(cfg, grid)`` builds its parts with ``build_step`` (hpctrain/train/build.py) and runs steps on
them; the run around the steps (resume, logging, saving, stopping) is hpctrain/train/loop.py's. Each
``train_step`` takes one global batch: this dp rank's share, cut over cp into zig-zag halves
(``zigzag_split``) and over micro-batches; the pipeline executor runs forward and backward (gradients
reduced over the replica group as buckets fill); the step's outcome (loss, gradient norm, skip, float16
loss scale, stop) is decided on the device by one world all-reduce (``StepOutcomes``,
hpctrain/train/outcomes.py) and reaches the fused AdamW as tensors: no host read between the forward and
the update. An SFT corpus (hpctrain/data/packing.py) gives packed samples with a loss mask and document
ids: the loss is the sum of this rank's counted token losses over the global batch's counted tokens (known
to every rank from the sampler); the documents go to every stage (attention stays inside them).
"""
from __future__ import annotations

import time
from functools import partial

import torch

from hpctrain.config.moe_keys import resolve_moe
from hpctrain.data.sampler import rank_slice
from hpctrain.models.fp8 import Fp8Setup, setup_fp8
from hpctrain.optim.flat import lr_at
from hpctrain.parallel.context_parallel import zigzag_split
from hpctrain.train.build import StepParts, build_step
from hpctrain.train.guard import Divergence
from hpctrain.train.outcomes import StepOutcomes
from hpctrain.train.state import TrainerState
from hpctrain.train.step_metrics import StepMetrics, group_deltas


class Trainer:
    """One rank's share of the training step. ``device``: where parameters, gradients, optimizer state,
    batches and pipeline buffers live (default CPU); collective over the world (``grid.use_device``).
    ``parts``: what ``build_step`` assembled; ``state``: what checkpoints and ``model.init_from`` see of
    it (the ``TrainState`` contract of hpctrain/checkpoint/contract.py; hpctrain/train/state.py)."""

    def __init__(self, cfg, grid, tokens=None, device=None):
        self.cfg, self.grid = cfg, grid
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.parts: StepParts = build_step(cfg, grid, self.device, tokens)
        # train.fp8: the block linears in float8 (hpctrain/models/fp8.py), their amaxes max-reduced over tp
        m = self.parts.model_cfg
        self.fp8: Fp8Setup | None = setup_fp8(cfg.train, self.parts.stages, grid.comm("tp"), self.device,
                                              cfg.train.dtype, m, resolve_moe(cfg.moe, m), grid.comm("cp"))
        self._step = 0  # steps run (the last one's verdict may still be in flight)
        # the evaluation loss's agreement, a host float64 [1]: from the last stage over pp, summed over dp x cp
        pp_comm = grid.comm("pp")
        self._loss_value = torch.zeros(1, dtype=torch.float64)
        last = 0 if cfg.parallel.schedule == "zb-v" else pp_comm.size - 1  # the pp rank of the last virtual stage
        self._loss_ops = [pp_comm.recurring_broadcast(self._loss_value, root=last)] if pp_comm.size > 1 else []
        self._loss_ops.append(grid.comm(grid.replica_axis).recurring_allreduce(self._loss_value))
        self.before_update: list = []  # one-shot callables run before the next update (TrainState.before_next_update)
        self.state = TrainerState(self)  # what checkpoints save and restore

    @property
    def outcomes(self) -> StepOutcomes:
        """The owner of each step's outcome (``parts.outcomes``)."""
        return self.parts.outcomes

    @property
    def step(self) -> int:
        """The last step whose update stands: the steps run, or the step at which the run diverged (its
        update and every later one were skipped on the device)."""
        return self.outcomes.diverged.step if self.outcomes.diverged else self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value

    @property
    def diverged(self) -> Divergence | None:
        """The run's stop, once its step's verdict is read (the same on every rank)."""
        return self.outcomes.diverged

    @property
    def agreed_stop(self) -> str:
        """The agreed stop request, once a step carrying one is read ("" until then)."""
        return self.outcomes.agreed_stop

    def read_pending(self) -> None:
        """Read the deferred step's verdict now (waits for the device); nothing once the run diverged."""
        self.outcomes.read_pending()

    def finished_steps(self) -> list[StepMetrics]:
        """The steps whose verdict was read since the last call, in step order (the same on every rank)."""
        return self.outcomes.take_finished()

    # ------------------------------------------------------------------ one step
    def train_step(self, stop_request: str = "", defer: bool = False) -> StepMetrics:
        """One global batch. ``stop_request``: this rank's wish to stop after this step (hpctrain/train/stop.py),
        agreed in the step's reduction (``agreed_stop`` once read). ``defer``: read this step's verdict at the
        end of the next step where the parts allow (``StepOutcomes.may_defer``), so the host never waits on
        the device inside a step; the returned metrics' loss, grad_norm, skipped and loss_scale are None
        until then."""
        parts, t, grid, timer = self.parts, self.cfg.train, self.grid, self.parts.timer
        flat, reducer, outcomes, scaler = parts.params.flat, parts.reducer, self.outcomes, parts.scaler
        if timer.trace is not None:
            timer.trace.begin_step(self._step + 1)
        start, groups_before = time.perf_counter(), grid.stats.by_group()
        with timer.phase("data"):
            counted = parts.data.sampler.counted(parts.data.batches.consumed, t.global_batch)  # the loss's denominator
            inputs, targets, packing = self._feed(parts.data.batches.next_batch())

        parts.local_model.train()
        flat.start_step()
        reducer.begin_step(self._step, scaler.scale)  # the host's scale: current where a reducer needs it
        scale = scaler.scale_tensor if scaler.enabled else 1.0  # float16: moved on the device
        parts.faults.hit("forward", self._step + 1)
        if parts.faults:  # test-only: a fault inside a zero-bubble schedule's deferred W
            parts.executor.before_weight = partial(parts.faults.hit, "weight", self._step + 1)
        # no counted token (impossible with `data prepare` output): loss 0, zero gradients
        scaled_loss = parts.executor.run(inputs, targets, scale / max(counted, 1), **packing)
        parts.faults.hit("backward", self._step + 1)
        with timer.phase("dp_wait"):
            flat.finish_reduction()
        parts.params.release()  # ZeRO-3: the optimizer updates the slices; nothing stays gathered
        with timer.phase("loss"):  # counted once: tp rank 0 of the last stage (0.0 elsewhere)
            loss_share = scaled_loss / scale if grid.coords["tp"] == 0 else 0.0
        with timer.phase("grad_norm"):  # the loss, the norm and the stop request: one all-reduce, on the device
            inv = 1.0 / scale
            coef, found_inf = outcomes.decide(loss_share, parts.optimizer.grad_norm_sq_tensor() * inv * inv,
                                              stop_request, reducer.overflow)
        lr = lr_at(self._step, t)
        metrics = StepMetrics(self._step + 1, None, lr, None, 0.0, 0.0, 0.0, None, None, None)
        if parts.moe_stats is not None:  # collective over the world: the experts' load, the auxiliary losses
            metrics.__dict__.update(parts.moe_stats.collect())
        if self.fp8 is not None and metrics.step % t.log_interval == 0:  # collective over the world: the casts seen
            metrics.__dict__.update(self.fp8.stats.collect(grid.world))
        while self.before_update:  # a save still copying the parameters and optimizer state: before anything of
            self.before_update.pop(0)()  # the update, 1-bit Adam's momentum commit in before_update included
        skip_on_host = outcomes.before_update(metrics)
        parts.faults.hit("optimizer", self._step + 1, flat.param_buffer)
        if not skip_on_host:
            with timer.phase("optimizer"):
                parts.optimizer.step(lr, coef, None if outcomes.read_before_update else found_inf)
        self._step = metrics.step
        outcomes.after_update(metrics, defer)
        elapsed = time.perf_counter() - start
        groups = group_deltas(groups_before, grid.stats.by_group())
        metrics.__dict__.update(step_time_s=elapsed, tokens_per_s=t.global_batch * t.seq_len / elapsed,
                                groups=groups, comm_time_s=sum(g["comm_s"] for g in groups.values()),
                                bytes_sent=sum(g["bytes_sent"] for g in groups.values()), **reducer.step_stats(),
                                time_s={k: round(v, 6) for k, v in timer.collect(elapsed).items()})
        peak = parts.peak_tflops
        metrics.mfu = (parts.flops_per_token * metrics.tokens_per_s / (peak * 1e12 * grid.info.size)
                       if peak > 0 else None)
        return metrics

    def evaluate(self) -> float:
        """Collective: the mean token loss over the validation batches (``train.eval_steps`` global batches
        of held-out samples 0, 1, ...: the same every time and in every layout); forward only. SFT data:
        each batch's loss is over its counted tokens, as in training."""
        parts, t = self.parts, self.cfg.train
        sampler = parts.data.valid_sampler
        offset, count = rank_slice(t.global_batch, parts.layout.dp_size, self.grid.coords["dp"])
        parts.local_model.eval()
        total = 0.0
        with parts.timer.phase("eval"):
            for k in range(t.eval_steps):
                inputs, targets, packing = self._feed(sampler.batch(k * t.global_batch + offset, count))
                scale = 1.0 / max(sampler.counted(k * t.global_batch, t.global_batch), 1)
                total += self._agree_loss(parts.executor.evaluate(inputs, targets, scale, **packing))
        parts.params.release()
        parts.local_model.train()
        return total / t.eval_steps

    def _feed(self, batch) -> tuple[list, list, dict]:
        """This rank's batch (inputs, targets[, loss_mask, docs]) [B, S] each -> per micro-batch lists on the
        device: inputs, targets and the executor's {"masks", "docs"} (empty for pretraining). Tokens and mask
        are cut over cp into this rank's zig-zag halves [B, S/cp]; docs stay whole (ring attention masks by
        global position)."""
        inputs, targets, *packed = batch
        layout = self.parts.layout
        cut = [inputs, targets, *packed[:1]]
        if layout.cp_size > 1:
            cut = [zigzag_split(b, self.grid.coords["cp"], layout.cp_size) for b in cut]
        parts = self._to_device(*cut, *packed[1:])
        mb, n = layout.micro_batch, layout.microbatches
        micro = [[part[i * mb:(i + 1) * mb] for i in range(n)] for part in parts]
        return micro[0], micro[1], dict(zip(("masks", "docs"), micro[2:]))

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
