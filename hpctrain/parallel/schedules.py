"""Pipeline schedules as data: per-rank action lists (GPipe, 1F1B, interleaved 1F1B), their point-to-point
posts, and a strict-rendezvous simulator that proves them deadlock-free. Pure Python: no torch, no MPI.

An action is ``(op, i, c)``: "F" (forward) or "B" (backward) of micro-batch i through this rank's model
chunk c. With ``chunks = V`` (interleaved, ``parallel.virtual_stages``), rank r holds chunks c = 0..V-1,
which are the virtual stages ``v = c * pp + r`` of a V * pp stage pipeline (Megatron's round-robin); gpipe
and 1f1b have V = 1 (chunk 0, v = r). Forward of virtual stage v receives from v - 1 and sends to v + 1,
backward the reverse; on the pp ranks that is r -> r + 1 within a chunk and pp - 1 -> 0 from chunk c to
c + 1 (a ring on the PP communicator).

Interleaved order (Narayanan et al. SC21 section 2.2; Megatron-LM ``forward_backward_pipelining_with_
interleaving``): the V * M micro-batch-chunks of a rank run in groups of pp micro-batches per chunk, chunk
0 first for forwards, chunk V - 1 first for backwards; rank r warms up with ``(pp - r - 1) * 2 + (V - 1) *
pp`` forwards (all of them when M == pp), then alternates one forward and one backward, then drains.
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _unit(k: int, stages: int, chunks: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th forward (or backward) in the interleaved order."""
    group, within = divmod(k, stages * chunks)
    chunk, j = divmod(within, stages)
    return group * stages + j, chunk if forward else chunks - 1 - chunk


def schedule_actions(kind: str, stage: int, stages: int, microbatches: int,
                     chunks: int = 1) -> list[tuple[str, int, int]]:
    """The order of ("F" | "B", micro-batch, chunk) steps on pp rank ``stage``; ``chunks`` = V (interleaved)."""
    m = microbatches
    if kind == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if kind == "1f1b":
        warmup = min(stages - stage - 1, m)
        forwards = [("F", i, 0) for i in range(m)]
        backwards = [("B", i, 0) for i in range(m)]
    elif kind == "interleaved":
        if chunks < 2 or m % stages:
            raise ValueError(f"interleaved needs >= 2 chunks and micro-batches a multiple of pp, got V={chunks}, "
                             f"M={m}, pp={stages}")
        total = m * chunks
        warmup = total if m == stages else min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
        forwards = [("F", *_unit(k, stages, chunks, True)) for k in range(total)]
        backwards = [("B", *_unit(k, stages, chunks, False)) for k in range(total)]
    else:
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {', '.join(SCHEDULES)}")
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):  # steady state: one forward, one backward
        actions += [f, b]
    return actions + backwards[len(forwards) - warmup:]


def forward_actions(kind: str, stage: int, stages: int, microbatches: int, chunks: int = 1) -> list:
    """Forward-only (validation): the schedule's forwards in its order."""
    return [a for a in schedule_actions(kind, stage, stages, microbatches, chunks) if a[0] == "F"]


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle time over the ideal (bubble-free) step with equal stages: (pp - 1) / (V M), as Narayanan et al.
    and ``hpctrain plan`` count it (gpipe and 1f1b: V = 1). 0 without a pipeline."""
    return (stages - 1) / (chunks * microbatches)


def peer(op: str, stage: int, chunk: int, stages: int, chunks: int, direction: str) -> tuple[int, int] | None:
    """(pp rank, chunk) that action ``op`` on (stage, chunk) receives from (``direction`` "recv") or sends to
    ("send"); None when there is none (the first virtual stage's forward input, the last one's output)."""
    v = chunk * stages + stage
    upstream = (op == "F") == (direction == "recv")  # forward receives from v-1; backward sends to v-1
    other = v - 1 if upstream else v + 1
    if not 0 <= other < stages * chunks:
        return None
    return other % stages, other // stages


def schedule_steps(kind: str, stage: int, stages: int, microbatches: int, chunks: int = 1,
                   forward_only: bool = False) -> list[list[tuple[str, int, int]]]:
    """The schedule of ``stage`` cut into steps: communication happens between steps only. Each action is a
    step, except interleaved's steady state, where a step is one forward and one backward (Megatron's)."""
    if forward_only:
        return [[a] for a in forward_actions(kind, stage, stages, microbatches, chunks)]
    actions = schedule_actions(kind, stage, stages, microbatches, chunks)
    if kind != "interleaved":
        return [[a] for a in actions]
    total = microbatches * chunks
    warmup = total if microbatches == stages else min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    steady = total - warmup
    paired = warmup + 2 * steady
    return ([[a] for a in actions[:warmup]] + [actions[k:k + 2] for k in range(warmup, paired, 2)]
            + [[a] for a in actions[paired:]])


def step_posts(steps: list, stage: int, stages: int, chunks: int = 1) -> tuple[list, list[list]]:
    """(receives before the first step, [the post after step j]) for ``schedule_steps``' steps. The post after
    step j holds the sends of step j's actions, then the receives of step j + 1's, in action order, as one
    group (Megatron's send_forward_recv_backward and its kin). An operation is ("send" | "recv", "F" | "B",
    micro-batch, peer rank, this rank's chunk)."""
    def ops(step, direction):
        found = []
        for op, i, c in step:
            other = peer(op, stage, c, stages, chunks, direction)
            if other is not None:
                found.append((direction, op, i, other[0], c))
        return found

    after = [ops(step, "send") + (ops(steps[j + 1], "recv") if j + 1 < len(steps) else [])
             for j, step in enumerate(steps)]
    return ops(steps[0], "recv") if steps else [], after


def p2p_posts(kind: str, stage: int, stages: int, microbatches: int, chunks: int = 1,
              forward_only: bool = False) -> list[list[tuple]]:
    """The point-to-point posts of ``stage`` in the order the executor issues them (``step_posts``, empty
    posts dropped); one list per NCCL group / set of MPI requests waited together."""
    first, after = step_posts(schedule_steps(kind, stage, stages, microbatches, chunks, forward_only),
                              stage, stages, chunks)
    return [post for post in [first] + after if post]


def message(op_tuple: tuple, rank: int, stages: int, chunks: int) -> tuple:
    """The message a post operation carries: (F | B, micro-batch, sender virtual stage, receiver's)."""
    kind_, action, i, other, chunk = op_tuple
    mine = chunk * stages + rank
    theirs = mine + ((1 if action == "F" else -1) * (1 if kind_ == "send" else -1))
    return (action, i, mine, theirs) if kind_ == "send" else (action, i, theirs, mine)


def simulate(kind: str, stages: int, microbatches: int, chunks: int = 1, forward_only: bool = False) -> bool:
    """True if the plan is in order and no rank deadlocks when every post blocks until all of it has matched.

    The strictest model: NCCL runs a rank's posts in stream order, a send completes only when the peer's
    receive is posted (MPI may buffer small sends, which can only help), and messages between two ranks
    match in the order posted whatever their tag (NCCL has none): ``in_order`` must hold too.
    """
    plans = [p2p_posts(kind, s, stages, microbatches, chunks, forward_only) for s in range(stages)]
    return in_order(plans, chunks) and posts_complete(plans, chunks)


def in_order(plans: list[list[list[tuple]]], chunks: int = 1) -> bool:
    """Whether, for every ordered pair of ranks, the n-th send carries the message of the n-th receive."""
    stages = len(plans)
    flows: dict[tuple, list] = {}  # (src, dst, "send"/"recv") -> the messages in posting order
    for rank, plan in enumerate(plans):
        for post in plan:
            for op in post:
                src, dst = (rank, op[3]) if op[0] == "send" else (op[3], rank)
                flows.setdefault((src, dst, op[0]), []).append(message(op, rank, stages, chunks))
    return all(flows.get((src, dst, "recv")) == sent for (src, dst, kind_), sent in flows.items()
               if kind_ == "send") and all((s, d, "send") in flows for s, d, k in flows if k == "recv")


def posts_complete(plans: list[list[list[tuple]]], chunks: int = 1) -> bool:
    """Run per-rank post lists (as ``p2p_posts`` makes them) under the strict model of ``simulate``."""
    stages, pos = len(plans), [0] * len(plans)
    posted = [[{message(op, s, stages, chunks) + (op[0],) for op in post} for post in plan]
              for s, plan in enumerate(plans)]

    def matched(s: int, op: tuple) -> bool:
        twin = message(op, s, stages, chunks) + ("recv" if op[0] == "send" else "send",)
        return any(twin in post for post in posted[op[3]][:pos[op[3]] + 1])

    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            if pos[s] < len(plans[s]) and all(matched(s, op) for op in plans[s][pos[s]]):
                pos[s] += 1
                progressed = True
    return all(pos[s] == len(plans[s]) for s in range(stages))


def timeline(kind: str, stages: int, microbatches: int, chunks: int = 1, forward: int = 1,
             backward: int = 2) -> list[list[tuple[int, int, tuple]]]:
    """When each action runs if a chunk's forward takes ``forward`` time units, its backward ``backward``,
    and messages are instant: per rank, [(start, end, action)] in its schedule's order (each action waits for
    its rank's previous one and for its input: forward of virtual stage v - 1, backward of v + 1, or the
    last virtual stage's own forward)."""
    plans = [schedule_actions(kind, s, stages, microbatches, chunks) for s in range(stages)]
    done: dict[tuple, int] = {}  # (op, micro-batch, rank, chunk) -> end time
    pos, clock = [0] * stages, [0] * stages
    out: list[list[tuple[int, int, tuple]]] = [[] for _ in range(stages)]
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while pos[s] < len(plans[s]):
                op, i, c = plans[s][pos[s]]
                source = peer(op, s, c, stages, chunks, "recv")
                need = (op, i, *source) if source else (("F", i, s, c) if op == "B" else None)
                if need is not None and need not in done:
                    break
                start = max(clock[s], done.get(need, 0) if need is not None else 0)
                clock[s] = done[(op, i, s, c)] = start + (forward if op == "F" else backward)
                out[s].append((start, clock[s], (op, i, c)))
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(plans[s]) for s in range(stages)):
        raise ValueError(f"{kind} schedule (pp={stages}, M={microbatches}, V={chunks}) waits on itself")
    return out


def render_timeline(kind: str, stages: int, microbatches: int, chunks: int = 1, forward: int = 1,
                    backward: int = 2, cell: int = 0) -> str:
    """A text Gantt chart of ``timeline`` (a chunk's forward ``forward`` units, its backward ``backward``), one
    line per pp rank: ``F3`` is the forward of micro-batch 3 (``F3.1``: through chunk 1), ``B3 --`` a
    backward over several units, ``.`` an idle unit, then the rank's idle share of the step; ``cell``
    characters a unit (0: the longest label's + 1). To compare schedules at one time scale give 1f1b V times
    the units of interleaved and both one ``cell``. docs/parallelism.md shows these
    (tests/unit/test_pipeline_schedule.py keeps them equal)."""
    rows = timeline(kind, stages, microbatches, chunks, forward, backward)
    width = cell or 1 + max(len(_label(a, chunks)) for row in rows for _, _, a in row)
    span = max(end for row in rows for _, end, _ in row)
    lines = []
    for s, row in enumerate(rows):
        text, clock = [], 0
        for start, end, action in row:
            text.append(".".ljust(width) * (start - clock))
            label = _label(action, chunks)
            text.append(label.ljust(width) if end - start == 1 else
                        (label + " ").ljust(width * (end - start) - 1, "-") + " ")
            clock = end
        text.append(".".ljust(width) * (span - clock))
        busy = sum(end - start for start, end, _ in row)
        lines.append(f"rank {s} | {''.join(text).rstrip()} | idle {(span - busy) / span:.0%} of the step")
    return "\n".join(lines)


def _label(action: tuple, chunks: int) -> str:
    op, i, c = action
    return f"{op}{i}" + (f".{c}" if chunks > 1 else "")


if __name__ == "__main__":  # python -m hpctrain.parallel.schedules KIND PP M [V [FORWARD BACKWARD]]
    import sys

    print(render_timeline(sys.argv[1], *map(int, sys.argv[2:])))
