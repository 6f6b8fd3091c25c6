"""Pipeline parallelism: the execution of a schedule (``schedules.py``) with MPI point-to-point on the PP group.

A pp rank r holds one virtual stage (gpipe, 1f1b) or V (interleaved, ``parallel.virtual_stages``): its c-th
is virtual stage v = c * pp + r, a ``GPTStage`` module. Forward of a micro-batch through virtual stage v
receives its input from v - 1 and sends its output to v + 1; backward receives the output grad from v + 1
and sends the input grad to v - 1, all on the PP group (tags ACT_TAG / GRAD_TAG). Between two steps of the
schedule (``schedule_steps``) the executor posts ONE group: the sends of the step just run with the receives
of the next step (``step_posts``: one ``Communicator.exchange``, one NCCL group on GPUs, as Megatron's
send_forward_recv_backward); a group without receives is not waited until the end of the step. ``simulate``
proves these posts deadlock-free and in order under NCCL's strict rendezvous (``schedules.rendezvous_completes``)
for every (pp, V, M) in the tests. On MPI the sends of a post go apart, in flight until the step's end, and only
the receives are waited (``_sends_apart``): a sender never waits for its receiver to reach the message, which the
strict model assumes it may, so what completes there completes here.

The zero-bubble schedules (zb-h1, zb-v: ``zero_bubble.py``) split each backward: "B" computes the input
gradient (sent on at once) and the gradients of the parameters outside the linears, and queues the linears'
weight gradients in the executor's ``WeightGradStore`` (``weight_grad.py``); "W" computes them and accumulates
every gradient of that (micro-batch, c) where a full backward would have (``FlatParams``' hooks). zb-v holds
virtual stages r and 2 pp - 1 - r (``zero_bubble.virtual_stage``): on rank pp - 1 the forward turns from c = 0
to c = 1, and the backward back, in memory.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from hpctrain.parallel.schedules import (bubble_fraction, p2p_posts, schedule_actions,  # noqa: F401 (re-exported)
                                         schedule_steps, simulate, step_posts)
from hpctrain.parallel.schedules import peer as message_peer
from hpctrain.parallel.weight_grad import WeightGradStore, attach
from hpctrain.parallel.zero_bubble import ZERO_BUBBLE_SCHEDULES
from hpctrain.profiling.activations import ActivationMeter, tensors_in
from hpctrain.profiling.timers import NULL_TIMER

ACT_TAG, GRAD_TAG = 21, 22


class PipelineExecutor:
    """Runs one training step's micro-batches through this rank's virtual stages.

    ``stage_modules``: the GPTStage of each virtual stage held here, c = 0..V-1 (one unless interleaved);
    ``pp_comm``: the PP Communicator (None when pp == 1); ``flat``: the FlatParams whose ``last_microbatch``
    flag gates the DP bucket reduction. ``act_shape``: [S(/tp), mb, D]. ``timer``: a PhaseTimer; phases
    ``forward``, ``backward``, ``pp_wait`` (receives, send completion), ``pp_drain`` (after a training step's
    schedule, waiting for the other stages to finish theirs). ``after_backward(stage_module)``:
    called when a micro-batch's backward through that virtual stage has returned (ZeRO-3's
    ``ParamGather.backward_pass_done``), or None. A zb schedule (``kind`` zb-h1, zb-v): the executor owns a
    ``WeightGradStore`` (``weight_grads``) that it gives to its stages' linears; phases ``backward`` (B) and
    ``weight`` (W). ``meter``: an ActivationMeter (``meter_activations``) sampled after every action of a
    training step, or None.
    """

    def __init__(self, stage_modules, pp_comm, flat, kind: str, microbatches: int, act_shape, act_dtype,
                 device=None, timer=NULL_TIMER, after_backward=None):
        self.stage_modules = list(stage_modules)
        self.after_backward = after_backward
        self.pp_comm, self.flat, self.timer, self.kind = pp_comm, flat, timer, kind
        self.stages = 1 if pp_comm is None else pp_comm.size
        self.rank = 0 if pp_comm is None else pp_comm.rank
        self.microbatches = microbatches
        self.act_shape, self.act_dtype = tuple(act_shape), act_dtype
        self.device = torch.device("cpu") if device is None else device
        self.split = kind in ZERO_BUBBLE_SCHEDULES
        self.v_shape = kind == "zb-v"
        self.weight_grads = WeightGradStore() if self.split else None
        self.before_weight: Callable[[], None] | None = None  # called before each W (the trainer's fault point)
        self.meter: ActivationMeter | None = None
        self._apart: bool | None = None  # _sends_apart's answer, found at the first send
        if self.split:
            attach(self.stage_modules, self.weight_grads)

    def meter_activations(self) -> ActivationMeter:
        """Meter this rank's activation memory from the next training step on (``meter.peak``: bytes): what
        autograd saves and, after each action, what the executor holds (inputs received, outputs to send,
        the deferred Ws' tensors); the parameters and the flat buffers are not counted."""
        def state() -> list[torch.Tensor]:
            return [*(p for module in self.stage_modules for p in module.parameters()), *self.flat.state_tensors()]
        self.meter = ActivationMeter(state)
        return self.meter

    def _sample(self, *held) -> None:
        if self.meter is not None:
            store = self.weight_grads.held() if self.weight_grads is not None else []
            self.meter.sample(tensors_in(*held, store))

    def _steps(self, forward_only: bool) -> list:
        return schedule_steps(self.kind, self.rank, self.stages, self.microbatches, len(self.stage_modules),
                              forward_only)

    def _post(self, ops: list, produced: dict, received: dict, outstanding: list) -> None:
        """Post one group: sends of ``produced[(op, i, c)]``, receives into new buffers ``received[...]``; wait
        for the receives (the next step needs them). Sends not waited join ``outstanding`` (waited at the end of
        the step): a group without receives, and on MPI every send (``_sends_apart``)."""
        if not ops:
            return
        sends, recvs = [], []
        for kind_, op, i, peer, c in ops:
            tag = ACT_TAG if op == "F" else GRAD_TAG
            if kind_ == "send":
                sends.append((produced.pop((op, i, c)), peer, tag))
            else:
                buffer = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                received[(op, i, c)] = buffer
                recvs.append((buffer, peer, tag))
        if outstanding:  # drive the sends in flight; drop the finished (their buffers go)
            outstanding[:] = [handle for handle in outstanding if not handle.test()]
        if sends and recvs and self._sends_apart(sends[0][0]):
            outstanding.append(self.pp_comm.exchange(sends, []))
            sends = []
        handle = self.pp_comm.exchange(sends, recvs)
        if not recvs:
            outstanding.append(handle)
            return
        with self.timer.phase("pp_wait"):
            handle.wait()

    def _sends_apart(self, tensor: torch.Tensor) -> bool:
        """Whether a step's sends are posted apart from its receives and left in flight: on MPI (host memory,
        CUDA-aware or staged), which matches messages by tag and where a posted send needs no waiting sender
        (single-copy shared memory: the receiver pulls it), so a rank never waits for a busy receiver to reach
        the message. Not on NCCL, whose group runs in stream order: one group, as Megatron's."""
        if self._apart is None:
            self._apart = self.pp_comm.backend_for(tensor).name != "nccl"
        return self._apart

    def _execute(self, steps: list, inputs: list, targets: list, loss_scale, train: bool,
                 masks: list | None = None, docs: list | None = None):
        """Run ``steps`` (``schedule_steps``) posting ``step_posts`` between them; returns the summed scaled loss
        of this rank (a float64 0-d tensor on the device where the last virtual stage lives, else 0.0).
        ``masks``/``docs``: per micro-batch loss masks and packed document ids (every virtual stage gets
        its micro-batch's ``docs``), or None."""
        first_recvs, after = step_posts(steps, self.rank, self.stages, len(self.stage_modules), self.v_shape)
        produced: dict[tuple[str, int, int], torch.Tensor] = {}  # (op, micro-batch, c) -> to send
        received: dict[tuple[str, int, int], torch.Tensor] = {}  # (op, micro-batch, c) -> arrived
        saved, loss_total = {}, 0.0
        outstanding: list = []  # handles of sends in flight (``_post``)
        timer = self.timer
        for module in self.stage_modules:  # MoE auxiliary losses join the token loss with its factor
            module.aux_weight.value = loss_scale
        if train and self.weight_grads is not None:
            self.weight_grads.clear()  # nothing of a step an exception interrupted
        self._post(first_recvs, produced, received, outstanding)
        metering = self.meter.saving() if train and self.meter is not None else nullcontext()
        with metering:
            for step, post in zip(steps, after):
                for op, i, c in step:
                    module = self.stage_modules[c]
                    if op == "F":
                        x = inputs[i] if module.is_first else received.pop(("F", i, c))
                        if train and not module.is_first:
                            x.requires_grad_()
                        with timer.phase("forward"):
                            doc = None if docs is None else docs[i]
                            if module.is_last:  # the head and the loss (fused: no logits; models/gpt.py)
                                mask = None if masks is None else masks[i]
                                y = module.forward_loss(x, targets[i], mask, doc) * loss_scale
                                loss_total = loss_total + y.detach().double()  # on the device: no host read
                            else:
                                y = module(x, doc)
                                produced[("F", i, c)] = y.detach().contiguous()
                        if train:
                            saved[(i, c)] = (x, y)
                            self.flat.progress()
                    elif op == "W":
                        assert self.weight_grads is not None  # a zb schedule
                        if self.before_weight is not None:
                            self.before_weight()
                        self.flat.last_microbatch = i == self.microbatches - 1
                        with timer.phase("weight"):
                            self.weight_grads.run((i, c))
                        self.flat.progress()
                    else:
                        x, y = saved.pop((i, c))
                        # a parameter lives in one virtual stage: its last backward is its last micro-batch
                        self.flat.last_microbatch = i == self.microbatches - 1
                        grad = None if module.is_last else received.pop(("B", i, c))
                        with timer.phase("backward"):
                            if self.split:
                                x_grad = self._input_backward(module, (i, c), x, y, grad)
                            else:
                                torch.autograd.backward(y, grad)
                                x_grad = x.grad
                        if self.after_backward is not None:
                            self.after_backward(module)
                        if not module.is_first:
                            assert x_grad is not None  # x: the received activation, a leaf that requires grad
                            produced[("B", i, c)] = x_grad.contiguous()
                    if self.v_shape:
                        self._hand_over(op, i, c, produced, received)
                    if train:
                        self._sample(saved, received, produced)
                self._post(post, produced, received, outstanding)
        with timer.phase("pp_wait"):
            for handle in outstanding:
                handle.wait()
        if train and self.pp_comm is not None:  # the drain: the stages that finished first wait for the rest
            with timer.phase("pp_drain"):
                self.pp_comm.drain()
        if train and self.weight_grads is not None:
            self.weight_grads.check_drained()  # no weight gradient lost at the update
        return loss_total

    def _input_backward(self, module, key: tuple[int, int], x, y, grad):
        """B of a zb schedule: dL/dx (None on the first virtual stage) now; the gradients of ``module``'s
        parameters kept in ``weight_grads`` (the linears' queued) until W of ``key``. No accumulation here."""
        assert self.weight_grads is not None
        params = [p for p in module.parameters() if p.requires_grad]
        inputs = ([] if module.is_first else [x]) + params
        if not inputs:
            return None
        with self.weight_grads.deferring(key):
            grads = torch.autograd.grad(y, inputs, grad, allow_unused=True)
        self.weight_grads.keep(key, params, grads[len(inputs) - len(params):])
        return None if module.is_first else grads[0]

    def _hand_over(self, op: str, i: int, c: int, produced: dict, received: dict) -> None:
        """zb-v on rank pp - 1: what c = 0's forward (c = 1's input gradient) produced is the other's input,
        handed over in memory (no message: ``schedules.peer`` is None)."""
        if op == "W" or (op, i, c) not in produced:
            return
        if message_peer(op, self.rank, c, self.stages, len(self.stage_modules), "send", True) is None:
            received[(op, i, 1 - c)] = produced.pop((op, i, c))

    def run(self, inputs: list, targets: list, loss_scale: float, masks: list | None = None,
            docs: list | None = None) -> float:
        """Forward/backward all micro-batches. ``loss_scale`` multiplies each micro-batch's summed token
        loss (1 / global counted tokens, times the fp16 loss scale); ``masks`` [mb, S] bool per micro-batch:
        the tokens counted (None: all); ``docs`` [mb, S_global]: packed documents (None: one per row).
        Returns this rank's summed scaled loss (non-zero on the rank of the last virtual stage only),
        unscaled by the fp16 factor by the caller."""
        return self._execute(self._steps(False), inputs, targets, loss_scale, True, masks, docs)

    @torch.no_grad()
    def evaluate(self, inputs: list, targets: list, loss_scale: float, masks: list | None = None,
                 docs: list | None = None) -> float:
        """Forward only (validation): the schedule's forwards in its order. Returns this rank's summed scaled
        loss (non-zero on the rank of the last virtual stage only)."""
        return self._execute(self._steps(True), inputs, targets, loss_scale, False, masks, docs)
