"""Pipeline parallelism: schedules (GPipe, 1F1B) and their execution with MPI point-to-point on the PP group.

A schedule is a per-stage list of actions ("F", i) / ("B", i) over micro-batches i = 0..M-1.
Execution: forward of micro-batch i on stage s receives its input from s-1, sends its output to s+1;
backward receives the output grad from s+1 and sends the input grad to s-1, all on the PP group.
Each receive is posted together with the send deferred from the action before it (one
``Communicator.exchange``: one NCCL group on GPUs, as Megatron's send_forward_recv_backward), other
sends go out at once; ``p2p_posts`` is that plan and ``simulate`` proves it deadlock-free under
NCCL's strict rendezvous for every (pp, M) in the tests, micro-batches < stages included.

Bubble: with equal stage times both schedules idle a fraction (pp-1)/(M+pp-1) of the step; 1F1B
holds at most pp-s activations on stage s instead of M.
"""
from __future__ import annotations

import torch

from hpctrain.profiling.timers import NULL_TIMER

ACT_TAG, GRAD_TAG = 21, 22


def schedule_actions(kind: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of forward/backward micro-batch steps on ``stage``."""
    m = microbatches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected gpipe or 1f1b")
    warmup = min(stages - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    next_f, next_b = warmup, 0
    while next_f < m:  # steady state: one forward, one backward
        actions.append(("F", next_f))
        next_f += 1
        actions.append(("B", next_b))
        next_b += 1
    actions += [("B", i) for i in range(next_b, m)]
    return actions


def bubble_fraction(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def receives(op: str, stage: int, stages: int) -> bool:
    """Whether action ``op`` on ``stage`` first receives (an activation from s-1, or a grad from s+1)."""
    return stage > 0 if op == "F" else stage < stages - 1


def sends(op: str, stage: int, stages: int) -> bool:
    """Whether action ``op`` on ``stage`` ends by sending (an activation to s+1, or a grad to s-1)."""
    return stage < stages - 1 if op == "F" else stage > 0


def p2p_posts(kind: str, stage: int, stages: int, microbatches: int) -> list[list[tuple]]:
    """The point-to-point posts of ``stage`` in the order the executor issues them.

    Each post is a list of ("send" | "recv", "F" | "B", micro-batch, peer stage) issued together (one
    NCCL group). The rule: an action's send is deferred and posted WITH the next action's receive when
    that action receives (Megatron's send_forward_recv_backward), else posted at once.
    """
    actions = schedule_actions(kind, stage, stages, microbatches)
    posts, pending = [], []
    for k, (op, i) in enumerate(actions):
        if receives(op, stage, stages):
            peer = stage - 1 if op == "F" else stage + 1
            posts.append(pending + [("recv", op, i, peer)])
            pending = []
        if sends(op, stage, stages):
            send = ("send", op, i, stage + 1 if op == "F" else stage - 1)
            if k + 1 < len(actions) and receives(actions[k + 1][0], stage, stages):
                pending = [send]
            else:
                posts.append([send])
    return posts


def simulate(kind: str, stages: int, microbatches: int) -> bool:
    """True if no stage deadlocks when every post blocks until all its operations have matched.

    The strictest model: NCCL runs a stage's posts in stream order and a send completes only when
    the peer's receive is posted (MPI may buffer small sends, which can only help). A post completes
    once the counterpart of each of its operations is in the peer's current or an earlier post.
    """
    return posts_complete([p2p_posts(kind, s, stages, microbatches) for s in range(stages)])


def posts_complete(plans: list[list[list[tuple]]]) -> bool:
    """Run per-stage post lists (as ``p2p_posts`` makes them) under the strict model of ``simulate``."""
    stages, pos = len(plans), [0] * len(plans)

    def matched(s: int, op: tuple) -> bool:
        kind_, action, i, peer = op
        twin = ("recv" if kind_ == "send" else "send", action, i, s)
        return any(twin in post for post in plans[peer][:pos[peer] + 1])

    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            if pos[s] < len(plans[s]) and all(matched(s, op) for op in plans[s][pos[s]]):
                pos[s] += 1
                progressed = True
    return all(pos[s] == len(plans[s]) for s in range(stages))


class PipelineExecutor:
    """Runs one training step's micro-batches through this rank's stage.

    ``stage``: a GPTStage; ``pp_comm``: the PP Communicator (None when pp == 1); ``flat``: the FlatParams
    whose ``last_microbatch`` flag gates the DP bucket reduction. ``act_shape``: [S(/tp), mb, D].
    ``timer``: a PhaseTimer; phases ``forward``, ``backward``, ``pp_wait`` (receives, send completion).
    """

    def __init__(self, stage, pp_comm, flat, kind: str, microbatches: int, act_shape, act_dtype,
                 device=None, timer=NULL_TIMER):
        self.stage, self.pp_comm, self.flat, self.timer = stage, pp_comm, flat, timer
        self.stages = 1 if pp_comm is None else pp_comm.size
        self.rank = 0 if pp_comm is None else pp_comm.rank
        self.microbatches = microbatches
        self.actions = schedule_actions(kind, self.rank, self.stages, microbatches)
        self.act_shape, self.act_dtype = tuple(act_shape), act_dtype
        self.device = torch.device("cpu") if device is None else device

    def _receive(self, op: str, pending: list) -> torch.Tensor:
        """Post the deferred sends with this action's receive (one group) and wait; returns the tensor."""
        buffer = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
        peer, tag = (self.rank - 1, ACT_TAG) if op == "F" else (self.rank + 1, GRAD_TAG)
        with self.timer.phase("pp_wait"):
            self.pp_comm.exchange(pending, [(buffer, peer, tag)]).wait()
        pending.clear()
        return buffer

    def run(self, inputs: list, targets: list, loss_scale: float) -> float:
        """Forward/backward all micro-batches. ``loss_scale`` multiplies each micro-batch's summed
        token loss (1 / global tokens, times the fp16 loss scale). Returns this stage's summed scaled
        loss (non-zero on the last stage only), unscaled by the fp16 factor by the caller.
        Communication follows ``p2p_posts`` (the order ``simulate`` proves deadlock-free)."""
        saved, outstanding, pending, loss_total = {}, [], [], 0.0
        first, last, timer = self.rank == 0, self.rank == self.stages - 1, self.timer
        for k, (op, i) in enumerate(self.actions):
            if op == "F":
                x = inputs[i] if first else self._receive("F", pending).requires_grad_()
                with timer.phase("forward"):
                    y = self.stage(x)
                    if last:
                        y = self.stage.loss_sum(y, targets[i]) * loss_scale
                        loss_total += float(y.detach())
                        send = None
                    else:
                        send = (y.detach().contiguous(), self.rank + 1, ACT_TAG)
                saved[i] = (x, y)
                self.flat.progress()
            else:
                x, y = saved.pop(i)
                self.flat.last_microbatch = i == self.microbatches - 1
                grad = None if last else self._receive("B", pending)
                with timer.phase("backward"):
                    torch.autograd.backward(y, grad)
                send = None if first else (x.grad.contiguous(), self.rank - 1, GRAD_TAG)
            if send is not None:
                nxt = self.actions[k + 1][0] if k + 1 < len(self.actions) else None
                if nxt is not None and receives(nxt, self.rank, self.stages):
                    pending.append(send)  # posted with the next receive, as p2p_posts plans it
                else:
                    outstanding.append(self.pp_comm.exchange([send]))
        with timer.phase("pp_wait"):
            for handle in outstanding:
                handle.wait()
        return loss_total

    @torch.no_grad()
    def evaluate(self, inputs: list, targets: list, loss_scale: float) -> float:
        """Forward only (validation): every micro-batch through the pipeline in order, activations sent on
        as they are made. Returns this stage's summed scaled loss (non-zero on the last stage only)."""
        first, last, outstanding, loss_total = self.rank == 0, self.rank == self.stages - 1, [], 0.0
        for i in range(self.microbatches):
            x = inputs[i] if first else self._receive("F", [])
            y = self.stage(x)
            if last:
                loss_total += float(self.stage.loss_sum(y, targets[i]) * loss_scale)
            else:
                outstanding.append(self.pp_comm.exchange([(y.contiguous(), self.rank + 1, ACT_TAG)]))
        for handle in outstanding:
            handle.wait()
        return loss_total
