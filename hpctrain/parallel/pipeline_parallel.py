"""Pipeline parallelism: schedules (GPipe, 1F1B) and their execution with MPI point-to-point on the PP group.

A schedule is a per-stage list of actions ("F", i) / ("B", i) over micro-batches i = 0..M-1.
Execution: forward of micro-batch i on stage s receives its input from s-1 (blocking wait), sends
its output to s+1 (non-blocking); backward receives the output grad from s+1 and sends the input
grad to s-1. Sends are non-blocking and waited at the end of the step, receives block, so any
schedule whose actions respect the data dependencies is deadlock-free (``simulate`` checks this
for every (pp, M) in the tests, micro-batches < stages included).

Bubble: with equal stage times both schedules idle a fraction (pp-1)/(M+pp-1) of the step; 1F1B
holds at most pp-s activations on stage s instead of M.
"""
from __future__ import annotations

import torch

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


def simulate(kind: str, stages: int, microbatches: int) -> bool:
    """True if every stage can run its actions with blocking receives (no deadlock)."""
    plans = [schedule_actions(kind, s, stages, microbatches) for s in range(stages)]
    pos, done = [0] * stages, set()
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while pos[s] < len(plans[s]):
                op, i = plans[s][pos[s]]
                need = (("F", s - 1, i) if s > 0 else None) if op == "F" else \
                       (("B", s + 1, i) if s < stages - 1 else ("F", s, i))
                if need is not None and need not in done:
                    break
                done.add((op, s, i))
                pos[s] += 1
                progressed = True
    return all(pos[s] == len(plans[s]) for s in range(stages))


class PipelineExecutor:
    """Runs one training step's micro-batches through this rank's stage.

    ``stage``: a GPTStage; ``pp_comm``: the PP Communicator (None when pp == 1); ``flat``: the FlatParams
    whose ``last_microbatch`` flag gates the DP bucket reduction. ``act_shape``: [S(/tp), mb, D].
    """

    def __init__(self, stage, pp_comm, flat, kind: str, microbatches: int, act_shape, act_dtype):
        self.stage, self.pp_comm, self.flat = stage, pp_comm, flat
        self.stages = 1 if pp_comm is None else pp_comm.size
        self.rank = 0 if pp_comm is None else pp_comm.rank
        self.microbatches = microbatches
        self.actions = schedule_actions(kind, self.rank, self.stages, microbatches)
        self.act_shape, self.act_dtype = tuple(act_shape), act_dtype

    def run(self, inputs: list, targets: list, loss_scale: float) -> float:
        """Forward/backward all micro-batches. ``loss_scale`` multiplies each micro-batch's summed
        token loss (1 / global tokens, times the fp16 loss scale). Returns this stage's summed scaled
        loss (non-zero on the last stage only), unscaled by the fp16 factor by the caller."""
        saved, sends, loss_total = {}, [], 0.0
        first, last = self.rank == 0, self.rank == self.stages - 1
        for op, i in self.actions:
            if op == "F":
                if first:
                    x = inputs[i]
                else:
                    x = torch.empty(self.act_shape, dtype=self.act_dtype)
                    self.pp_comm.recv(x, self.rank - 1, tag=ACT_TAG)
                    x.requires_grad_()
                y = self.stage(x)
                if last:
                    y = self.stage.loss_sum(y, targets[i]) * loss_scale
                    loss_total += float(y.detach())
                else:
                    sends.append(self.pp_comm.isend(y.detach().contiguous(), self.rank + 1, tag=ACT_TAG))
                saved[i] = (x, y)
                self.flat.progress()
            else:
                x, y = saved.pop(i)
                self.flat.last_microbatch = i == self.microbatches - 1
                if last:
                    y.backward()
                else:
                    grad = torch.empty(self.act_shape, dtype=self.act_dtype)
                    self.pp_comm.recv(grad, self.rank + 1, tag=GRAD_TAG)
                    torch.autograd.backward(y, grad)
                if not first:
                    sends.append(self.pp_comm.isend(x.grad.contiguous(), self.rank - 1, tag=GRAD_TAG))
        for handle in sends:
            handle.wait()
        return loss_total
