"""Pipeline schedules as data: per-rank action lists (GPipe, 1F1B, interleaved 1F1B; the zero-bubble ZB-H1
and ZB-V of ``zero_bubble.py``, whose backward the executor splits: ``weight_grad.py``), their point-to-point
posts, and the strict-rendezvous deadlock check (``rendezvous_completes``) that proves them, and context
parallelism's ring (``cp_comm.ring_plan``), deadlock-free. Pure Python: no torch, no MPI.

An action is ``(op, i, c)``: "F" (forward) or "B" (backward) of micro-batch i through this rank's virtual
stage c. A pp rank r holds V virtual stages (``parallel.virtual_stages``; V > 1 only interleaved): its
c-th (c = 0..V-1) is virtual stage ``v = c * pp + r`` of a V * pp stage pipeline (Megatron's round-robin);
gpipe and 1f1b have V = 1 (c = 0, v = r). Forward of virtual stage v receives from v - 1 and sends to
v + 1, backward the reverse; on the pp ranks that is r -> r + 1 at the same c and pp - 1 -> 0 from c to
c + 1 (a ring on the PP communicator). The zero-bubble schedules add "W" (weight gradient; no message) and
zb-v the V placement (``zero_bubble.virtual_stage``, ``v_shape``).

Interleaved order (Narayanan et al. SC21 section 2.2; Megatron-LM ``forward_backward_pipelining_with_
interleaving``): the V * M (micro-batch, virtual stage) units of a rank run in groups of pp micro-batches
per virtual stage, c = 0 first for forwards, c = V - 1 first for backwards; rank r warms up with
``(pp - r - 1) * 2 + (V - 1) * pp`` forwards (all of them when M == pp), then alternates one forward and
one backward, then drains.
"""
from __future__ import annotations

from hpctrain.parallel.zero_bubble import (ZERO_BUBBLE_SCHEDULES, holder, run_orders, virtual_stage,
                                           zero_bubble_orders)

SCHEDULES = ("gpipe", "1f1b", "interleaved") + ZERO_BUBBLE_SCHEDULES  # what parallel.schedule accepts


def _unit(k: int, stages: int, virtual_stages: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, c) of a rank's k-th forward (or backward) in the interleaved order."""
    group, within = divmod(k, stages * virtual_stages)
    c, j = divmod(within, stages)
    return group * stages + j, c if forward else virtual_stages - 1 - c


def schedule_actions(kind: str, stage: int, stages: int, microbatches: int,
                     virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """The order of ("F" | "B", micro-batch, c) steps on pp rank ``stage`` of ``stages``; ``virtual_stages``
    = V per rank (interleaved, zb-v). zb-h1 and zb-v add "W" steps (``zero_bubble.py``)."""
    m = microbatches
    if kind in ZERO_BUBBLE_SCHEDULES:
        return zero_bubble_orders(kind, stages, m, virtual_stages)[stage]
    if kind == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if kind == "1f1b":
        warmup = min(stages - stage - 1, m)
        forwards = [("F", i, 0) for i in range(m)]
        backwards = [("B", i, 0) for i in range(m)]
    elif kind == "interleaved":
        if virtual_stages < 2 or m % stages:
            raise ValueError(f"interleaved needs >= 2 virtual stages per rank and micro-batches a multiple of pp, "
                             f"got V={virtual_stages}, M={m}, pp={stages}")
        total = m * virtual_stages
        warmup = total if m == stages else min((stages - stage - 1) * 2 + (virtual_stages - 1) * stages, total)
        forwards = [("F", *_unit(k, stages, virtual_stages, True)) for k in range(total)]
        backwards = [("B", *_unit(k, stages, virtual_stages, False)) for k in range(total)]
    else:
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {', '.join(SCHEDULES)}")
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):  # steady state: one forward, one backward
        actions += [f, b]
    return actions + backwards[len(forwards) - warmup:]


def forward_actions(kind: str, stage: int, stages: int, microbatches: int, virtual_stages: int = 1) -> list:
    """Forward-only (validation): the schedule's forwards in its order."""
    return [a for a in schedule_actions(kind, stage, stages, microbatches, virtual_stages) if a[0] == "F"]


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time over the ideal (bubble-free) step with equal stages: (pp - 1) / (V M), as Narayanan et al.
    and ``hpctrain plan`` count it (gpipe and 1f1b: V = 1). 0 without a pipeline."""
    return (stages - 1) / (virtual_stages * microbatches)


def schedule_bubble(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time over the ideal (bubble-free) step of ``kind`` with equal stages: ``bubble_fraction`` for
    gpipe, 1f1b and interleaved; for zb-h1 and zb-v read off ``timeline`` at F = B = W = 1 unit (a full
    backward = B + W = 2 F, as 1F1B's count): zb-h1's is (pp - 1) / (3 M). 0 without a pipeline."""
    if stages == 1:
        return 0.0
    if kind not in ZERO_BUBBLE_SCHEDULES:
        return bubble_fraction(stages, microbatches, virtual_stages)
    rows = timeline(kind, stages, microbatches, virtual_stages, 1, 1, 1)
    span, busy = max(end for row in rows for _, end, _ in row), 3 * virtual_stages * microbatches
    return (span - busy) / busy


def bubble_formula(kind: str) -> str:
    """How ``schedule_bubble`` counts ``kind``'s bubble, for the reports (info, train's start-up line)."""
    if kind == "interleaved":
        return "(pp-1)/(V M)"
    return "(pp-1)/(3 M)" if kind == "zb-h1" else "(its timeline at F = B = W)" if kind == "zb-v" else "(pp-1)/M"


def peer(op: str, stage: int, c: int, stages: int, virtual_stages: int, direction: str,
         v_shape: bool = False) -> tuple[int, int] | None:
    """(pp rank, its c) that action ``op`` on pp rank ``stage``'s virtual stage c receives from (``direction``
    "recv") or sends to ("send"); None when there is no message: the first virtual stage's forward input, the
    last one's output, a W, or a neighbour on the same rank (zb-v's turn on rank pp - 1: handed over in
    memory). ``v_shape``: zb-v's placement."""
    if op == "W":
        return None
    v = virtual_stage(stage, c, stages, v_shape)
    upstream = (op == "F") == (direction == "recv")  # forward receives from v-1; backward sends to v-1
    other = v - 1 if upstream else v + 1
    if not 0 <= other < stages * virtual_stages:
        return None
    rank, its_c = holder(other, stages, v_shape)
    return None if rank == stage else (rank, its_c)


def schedule_steps(kind: str, stage: int, stages: int, microbatches: int, virtual_stages: int = 1,
                   forward_only: bool = False) -> list[list[tuple[str, int, int]]]:
    """The schedule of ``stage`` cut into steps: communication happens between steps only. Each action is a
    step, except interleaved's steady state, where a step is one forward and one backward (Megatron's)."""
    if forward_only:
        return [[a] for a in forward_actions(kind, stage, stages, microbatches, virtual_stages)]
    actions = schedule_actions(kind, stage, stages, microbatches, virtual_stages)
    if kind != "interleaved":
        return [[a] for a in actions]
    total = microbatches * virtual_stages
    warmup = (total if microbatches == stages
              else min((stages - stage - 1) * 2 + (virtual_stages - 1) * stages, total))
    steady = total - warmup
    paired = warmup + 2 * steady
    return ([[a] for a in actions[:warmup]] + [actions[k:k + 2] for k in range(warmup, paired, 2)]
            + [[a] for a in actions[paired:]])


def step_posts(steps: list, stage: int, stages: int, virtual_stages: int = 1,
               v_shape: bool = False) -> tuple[list, list[list]]:
    """(receives before the first step, [the post after step j]) for ``schedule_steps``' steps. The post after
    step j holds the sends of step j's actions, then the receives of step j + 1's, in action order, as one
    group (Megatron's send_forward_recv_backward and its kin). An operation is ("send" | "recv", "F" | "B",
    micro-batch, peer rank, this rank's c)."""
    def ops(step, direction):
        found = []
        for op, i, c in step:
            other = peer(op, stage, c, stages, virtual_stages, direction, v_shape)
            if other is not None:
                found.append((direction, op, i, other[0], c))
        return found

    after = [ops(step, "send") + (ops(steps[j + 1], "recv") if j + 1 < len(steps) else [])
             for j, step in enumerate(steps)]
    return ops(steps[0], "recv") if steps else [], after


def p2p_posts(kind: str, stage: int, stages: int, microbatches: int, virtual_stages: int = 1,
              forward_only: bool = False) -> list[list[tuple]]:
    """The point-to-point posts of ``stage`` in the order the executor issues them (``step_posts``, empty
    posts dropped); one list per NCCL group / set of MPI requests waited together."""
    first, after = step_posts(schedule_steps(kind, stage, stages, microbatches, virtual_stages, forward_only),
                              stage, stages, virtual_stages, kind == "zb-v")
    return [post for post in [first] + after if post]


def message(op_tuple: tuple, rank: int, stages: int, virtual_stages: int, v_shape: bool = False) -> tuple:
    """The message a post operation carries: (F | B, micro-batch, sender virtual stage, receiver's)."""
    kind_, action, i, other, c = op_tuple
    mine = virtual_stage(rank, c, stages, v_shape)
    theirs = mine + ((1 if action == "F" else -1) * (1 if kind_ == "send" else -1))
    return (action, i, mine, theirs) if kind_ == "send" else (action, i, theirs, mine)


def labelled(plans: list[list[list[tuple]]], virtual_stages: int = 1,
             v_shape: bool = False) -> list[list[list[tuple]]]:
    """Pipeline posts (``p2p_posts`` of every pp rank, in rank order) as ``rendezvous_completes`` reads them:
    each operation ``("send" | "recv", peer rank, the message it carries)``."""
    stages = len(plans)
    return [[[(op[0], op[3], message(op, rank, stages, virtual_stages, v_shape)) for op in post] for post in plan]
            for rank, plan in enumerate(plans)]


def rendezvous_completes(plans: list[list[list[tuple]]]) -> bool:
    """Whether every rank's posts complete under the strict rendezvous model (True: the plan cannot deadlock).

    ``plans``: per rank, the posts it issues in order, each a list of ``("send" | "recv", peer rank, label)``
    operations that the rank posts together and waits for before it issues the next post. The model is the
    strictest a library may apply: a send completes only once its receive is posted (MPI may buffer small
    sends, which can only help), and the messages between two ranks match in the order posted whatever
    their label (NCCL's model: it has no tags), so the n-th send from a to b must carry the label of b's
    n-th receive from a (an MPI tag, or a pipeline's message: ``labelled``), else neither ever completes.
    """
    keyed = []  # per rank, per post: {(src, dst, n-th message between them, "send" | "recv"): label}
    for rank, plan in enumerate(plans):
        count: dict[tuple, int] = {}
        posts = []
        for post in plan:
            ops = {}
            for kind_, other, label in post:
                key = ((rank, other) if kind_ == "send" else (other, rank)) + (kind_,)
                n = count.get(key, 0)
                ops[key[:2] + (n, kind_)] = label
                count[key] = n + 1
            posts.append(ops)
        keyed.append(posts)
    pos = [0] * len(plans)

    def matched(op: tuple, label) -> bool:
        src, dst, n, kind_ = op
        other, twin = (dst, "recv") if kind_ == "send" else (src, "send")
        return any(post.get((src, dst, n, twin)) == label for post in keyed[other][:pos[other] + 1])

    progressed = True
    while progressed:
        progressed = False
        for rank, posts in enumerate(keyed):
            if pos[rank] < len(posts) and all(matched(op, label) for op, label in posts[pos[rank]].items()):
                pos[rank] += 1
                progressed = True
    return all(p == len(posts) for p, posts in zip(pos, keyed))


def orders_complete(kind: str, orders: list[list[tuple]], virtual_stages: int = 1, forward_only: bool = False) -> bool:
    """``simulate``'s check on given per-rank action lists (each action a step, as zb-h1 and zb-v run them):
    ``step_posts`` between them, empty posts dropped, under ``rendezvous_completes``."""
    v_shape, plans = kind == "zb-v", []
    for stage, order in enumerate(orders):
        steps = [[a] for a in order if not forward_only or a[0] == "F"]
        first, after = step_posts(steps, stage, len(orders), virtual_stages, v_shape)
        plans.append([post for post in [first] + after if post])
    return rendezvous_completes(labelled(plans, virtual_stages, v_shape))


def simulate(kind: str, stages: int, microbatches: int, virtual_stages: int = 1,
             forward_only: bool = False) -> bool:
    """True if the schedule's posts (``p2p_posts`` of every pp rank) complete under ``rendezvous_completes``:
    NCCL runs a rank's posts in stream order, each post blocks until all of it has matched, and the n-th
    message between two ranks must be the one the receiver expects (NCCL matches in order, not by tag)."""
    plans = [p2p_posts(kind, s, stages, microbatches, virtual_stages, forward_only) for s in range(stages)]
    return rendezvous_completes(labelled(plans, virtual_stages, kind == "zb-v"))


def timeline(kind: str, stages: int, microbatches: int, virtual_stages: int = 1, forward: int = 1,
             backward: int = 2, weight: int | None = None) -> list[list[tuple[int, int, tuple]]]:
    """When each action runs if a virtual stage's forward takes ``forward`` time units and messages are
    instant: per rank, [(start, end, action)] in its schedule's order (each action waits for its rank's
    previous one and for its input: ``zero_bubble.dependency``). ``weight`` None: a full backward takes
    ``backward``, which zb-h1 and zb-v split into B = ``backward - backward // 2`` and W = ``backward // 2``;
    else B takes ``backward`` and W ``weight`` (a full backward ``backward + weight``)."""
    split, v_shape = kind in ZERO_BUBBLE_SCHEDULES, kind == "zb-v"
    w = backward // 2 if weight is None else weight
    cost = {"F": forward, "B": backward - (w if weight is None else 0) if split else backward + (weight or 0),
            "W": w}
    if min(cost[op] for op in ("FBW" if split else "FB")) < 1:
        raise ValueError(f"every action of {kind} needs at least one time unit, got F={cost['F']}, B={cost['B']}"
                         + (f", W={cost['W']}" if split else ""))
    plans = [schedule_actions(kind, s, stages, microbatches, virtual_stages) for s in range(stages)] if not split \
        else zero_bubble_orders(kind, stages, microbatches, virtual_stages)
    out, complete = run_orders(plans, stages, virtual_stages, v_shape, cost)
    if not complete:
        raise ValueError(f"{kind} schedule (pp={stages}, M={microbatches}, V={virtual_stages}) waits on itself")
    return out


def idle_per_rank(rows: list[list[tuple[int, int, tuple]]]) -> list[int]:
    """Per rank of a ``timeline``, the time units it idles in the step: the span less its actions' time."""
    span = max(end for row in rows for _, end, _ in row)
    return [span - sum(end - start for start, end, _ in row) for row in rows]


def render_timeline(kind: str, stages: int, microbatches: int, virtual_stages: int = 1, forward: int = 1,
                    backward: int = 2, cell: int = 0, weight: int | None = None) -> str:
    """A text Gantt chart of ``timeline`` (a virtual stage's forward ``forward`` units, its backward
    ``backward``, W ``weight``: see ``timeline``), one line per pp rank: ``F3`` is the forward of micro-batch 3
    (``F3.1``: through the rank's virtual stage c = 1), ``B3 --`` a backward over several units, ``W3`` a
    weight gradient, ``.`` an idle unit, then the rank's idle share of the step; ``cell`` characters a unit
    (0: the longest label's + 1). To compare schedules at one time scale give 1f1b V times the units of
    interleaved and both one ``cell``. docs/parallelism.md shows these (tests/unit/test_pipeline_schedule.py
    keeps them equal)."""
    rows = timeline(kind, stages, microbatches, virtual_stages, forward, backward, weight)
    width = cell or 1 + max(len(_label(a, virtual_stages)) for row in rows for _, _, a in row)
    span = max(end for row in rows for _, end, _ in row)
    lines = []
    for s, (row, idle) in enumerate(zip(rows, idle_per_rank(rows))):
        text, clock = [], 0
        for start, end, action in row:
            text.append(".".ljust(width) * (start - clock))
            label = _label(action, virtual_stages)
            text.append(label.ljust(width) if end - start == 1 else
                        (label + " ").ljust(width * (end - start) - 1, "-") + " ")
            clock = end
        text.append(".".ljust(width) * (span - clock))
        lines.append(f"rank {s} | {''.join(text).rstrip()} | idle {idle / span:.0%} of the step")
    return "\n".join(lines)


def _label(action: tuple, virtual_stages: int) -> str:
    op, i, c = action
    return f"{op}{i}" + (f".{c}" if virtual_stages > 1 else "")


def main(argv: list[str]) -> str:
    """The chart ``python -m hpctrain.parallel.schedules`` prints for ``argv``: KIND PP M [V [F B [W]]] for zb-h1
    and zb-v (then an optional cell width), KIND PP M [V [F B [CELL]]] for the others (docs/parallelism.md's
    commands). Defaults F = 1, B = 2, W: B split in halves, so F = B = W = 1 for zb-h1 and zb-v."""
    kind, numbers = argv[0], [int(a) for a in argv[1:]]
    names = ["stages", "microbatches", "virtual_stages", "forward", "backward"]
    names += ["weight", "cell"] if kind in ZERO_BUBBLE_SCHEDULES else ["cell"]
    return render_timeline(kind, **dict(zip(names, numbers)))


if __name__ == "__main__":  # python -m hpctrain.parallel.schedules KIND PP M [V [F B [W]]]
    import sys

    try:
        print(main(sys.argv[1:]))
    except ValueError as error:
        sys.exit(f"error: {error}")
