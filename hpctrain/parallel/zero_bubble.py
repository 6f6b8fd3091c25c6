"""Zero-bubble pipeline schedules as data (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the
backward of a micro-batch through a virtual stage is split into B (the input gradient, which the previous
virtual stage waits for) and W (the weight gradient, which nobody waits for), and W fills the bubbles.
Pure Python: no torch, no MPI. ``schedules.py`` serves these orders through ``schedule_actions``, proves them
deadlock-free (``simulate``) and draws them (``render_timeline``).

``parallel.schedule = zb-h1`` and ``zb-v`` run them: ``PipelineExecutor`` splits each backward (its "B" computes
the input gradient, its "W" the weight gradients queued meanwhile: ``weight_grad.py``).

Actions are ``(op, i, c)`` as in ``schedules.py``, op one of "F", "B" (input gradient only) and "W" (weight
gradient of micro-batch i through the rank's virtual stage c; no communication, it runs on the rank that
ran that B, any time after it).

- ``zb-h1`` (V = 1): rank r holds virtual stage r, as 1F1B.
- ``zb-v`` (V = 2, the V shape): rank r holds virtual stage r (c = 0) and 2 pp - 1 - r (c = 1), so rank 0
  runs the first and the last; the forward goes down the ranks through c = 0, turns on rank pp - 1 (an
  in-memory hand-over from c = 0 to c = 1, no message) and comes back up through c = 1.

ZB-H1 is 1F1B's order with rank r's Ws deferred by r backwards (``zb_h1_order``); ZB-V's order comes from
list scheduling at unit times (``list_schedule_orders``), for the common (pp, M) refined offline for real
action times, where W is cheaper than F and B (``zb_v_search.py``, ``zb_v_table.py``; ``zb_v_orders``). An
order is the schedule whatever the real times; at F = B = W = 1 ZB-H1's step takes 3 M + pp - 1 units (1F1B's
3 M + 3 (pp - 1)) and ZB-V's about 6 M + pp - 1 units of a virtual stage, the least a rank that receives its
first input after pp - 1 units can take.

Memory, counted per rank in units of one virtual stage's activations of one micro-batch: a (micro-batch, c)
is alive from its F until its W (W still reads the saved inputs of the layers; after B alone most of them,
the activation gradients' operands, could be freed, which this count ignores: it is the strict one).
1F1B's peak, on its first rank, is ``min(pp, M)`` micro-batches of a whole stage, ``V min(pp, M)`` units.
Both schedules keep every rank's alive units within it (``memory_problems``); ZB-H1 also keeps 1F1B's count
on each rank of micro-batches with F done and B not (at most ``min(pp - r, M)``). Keeping the alive count
itself within 1F1B's per-rank ``min(pp - r, M)`` is impossible at a third of the bubble: the last rank could
hold one micro-batch, so its F, B, W would run back to back and the step could not be shorter than
3 M + 2 (pp - 1) units, two thirds of 1F1B's bubble.
"""
from __future__ import annotations

import functools

from hpctrain.parallel.zb_v_table import ORDERS

ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-v")

Action = tuple[str, int, int]


def virtual_stage(stage: int, c: int, stages: int, v_shape: bool = False) -> int:
    """The virtual stage that pp rank ``stage``'s c-th holds: ``c * pp + stage`` (Megatron's round robin), or
    in the V shape (zb-v) ``stage`` for c = 0 and ``2 pp - 1 - stage`` for c = 1."""
    if v_shape:
        return stage if c == 0 else 2 * stages - 1 - stage
    return c * stages + stage


def holder(v: int, stages: int, v_shape: bool = False) -> tuple[int, int]:
    """(pp rank, its c) that holds virtual stage ``v``; the inverse of ``virtual_stage``."""
    if v_shape:
        return (v, 0) if v < stages else (2 * stages - 1 - v, 1)
    return v % stages, v // stages


def dependency(op: str, i: int, v: int, last: int) -> tuple[str, int, int] | None:
    """The action ``(op, micro-batch, virtual stage)`` that ``op`` of micro-batch i through virtual stage v
    waits for: forward of v - 1 (none for v = 0), B of v + 1 (the last virtual stage's own forward), or,
    for W, its own B."""
    if op == "F":
        return ("F", i, v - 1) if v > 0 else None
    if op == "B":
        return ("B", i, v + 1) if v < last else ("F", i, v)
    return ("B", i, v)


def check_arguments(kind: str, stages: int, microbatches: int, virtual_stages: int) -> None:
    """Raises ValueError naming what ``kind`` needs: zb-h1 V = 1, zb-v V = 2, both pp >= 2 and M >= pp."""
    needed = {"zb-h1": 1, "zb-v": 2}[kind]
    if virtual_stages != needed:
        shape = "two virtual stages per rank in the V shape" if kind == "zb-v" else "one virtual stage per rank"
        raise ValueError(f"{kind} needs V={needed} ({shape}), got V={virtual_stages}")
    if stages < 2 or microbatches < stages:
        raise ValueError(f"{kind} needs pp >= 2 and micro-batches M >= pp, got pp={stages}, M={microbatches}")


def zero_bubble_orders(kind: str, stages: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Every pp rank's action list (``(op, micro-batch, c)``, op F, B or W) of ``kind``, zb-h1 or zb-v."""
    check_arguments(kind, stages, microbatches, virtual_stages)
    if kind == "zb-h1":
        return [zb_h1_order(r, stages, microbatches) for r in range(stages)]
    return zb_v_orders(stages, microbatches)


def zb_h1_order(stage: int, stages: int, microbatches: int) -> list[Action]:
    """ZB-H1 on pp rank ``stage``: 1F1B's order of F and B (``pp - r - 1`` warm-up forwards, then one F and
    one B, then the remaining Bs), the W of micro-batch k right after the B of micro-batch k + r, and the
    last r Ws at the end: rank r defers its Ws by r backwards, which fills the drain (Qi et al. section 3.1)."""
    m, warmup = microbatches, stages - stage - 1
    order = [("F", i, 0) for i in range(warmup)]
    for k in range(m):
        order += [("F", warmup + k, 0)] if warmup + k < m else []
        order += [("B", k, 0)] + ([("W", k - stage, 0)] if k >= stage else [])
    return order + [("W", k, 0) for k in range(m - stage, m)]


RESERVES = (2, 1)  # the list schedules zb_v_orders chooses from (``list_schedule_v``'s ``reserve``)
# ... and each with both priorities (``list_schedule_v``'s ``forward_first``)
PRIORITIES = (False, True)
# the tie-break between orders equally short at unit times: W a tenth cheaper than F and B (measured on CPUs:
# 6% at d_model 768, 20% at the tiny shapes; docs/benchmarks.md), where a rank that ran a W waits sooner
TIE_BREAK_COSTS = {"F": 10, "B": 10, "W": 9}


def zb_v_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-V's action list of every pp rank: the order ``zb_v_table.ORDERS`` holds for (pp, M), refined offline
    for real action times (``zb_v_search``: never idler than the list schedule at any of its cost profiles, at
    pp = 2 one forward of idle a rank, the least there is), else the list schedule (``list_schedule_orders``).
    A pure function of (pp, M): every rank, and a resumed run, gets the same order; tests/unit/
    test_zero_bubble_schedules.py proves the served orders complete under strict rendezvous
    (``schedules.orders_complete``) and keep 1F1B's activation memory."""
    return [list(order) for order in _served_zb_v_orders(stages, microbatches)]


@functools.cache
def _served_zb_v_orders(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    # cached: the executor asks for its order every step
    held = ORDERS.get((stages, microbatches))
    if held is None:
        return _list_schedule_orders(stages, microbatches)
    return tuple(tuple(decode(order)) for order in held)


def encode(order: list[Action]) -> str:
    """``[("F", 0, 1), ...]`` as ``"F0.1 ..."`` (op, micro-batch, c): how ``zb_v_table`` holds an order."""
    return " ".join(f"{op}{i}.{c}" for op, i, c in order)


def decode(text: str) -> list[Action]:
    """The inverse of ``encode``."""
    return [(word[0], int(word[1:].split(".")[0]), int(word.split(".")[1])) for word in text.split()]


def list_schedule_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """Of the list schedules ``list_schedule_v`` makes with each
    ``reserve`` of ``RESERVES`` and each priority of ``PRIORITIES``, among those that run every action in order
    and keep every rank within 1F1B's activation memory (``memory_problems``), the one with the shortest step at
    F = B = W = 1 (``unit_span``), of those the shortest at ``TIE_BREAK_COSTS`` (a tie keeps the first). All
    keep one message in flight per link. Reserving one unit for a micro-batch
    entering the V instead of two admits it sooner: at pp = 2, M = 4 the step is 25 units instead of 26, each
    rank idling one (rank 1's first input, and rank 0's wait for the V's turn) instead of two; over pp <= 16,
    M <= 64 it is the shorter in about half of the cases, the longer in an eighth. Forwards first shortens the
    step where W is cheaper (pp = 2, M = 4, at the measured costs: 176 ms of idle a rank against 194), and at
    unit times in a few cases (pp = 8, M = 16: 105 units against 107)."""
    return [list(order) for order in _list_schedule_orders(stages, microbatches)]


@functools.cache
def _list_schedule_orders(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    best: tuple[tuple[int, int], list[list[Action]]] | None = None
    for forward_first in PRIORITIES:
        for reserve in RESERVES:
            try:
                orders = list_schedule_v(stages, microbatches, reserve, forward_first)
            except RuntimeError:  # this rule stalls here: the others remain
                continue
            if order_problems(orders, microbatches, 2) or memory_problems("zb-v", orders, microbatches, 2):
                continue
            key = (unit_span(orders, stages, True), span(orders, stages, True, TIE_BREAK_COSTS))
            if best is None or key < best[0]:
                best = (key, orders)
    if best is None:
        raise RuntimeError(f"no zb-v order within 1F1B's memory for pp={stages}, M={microbatches}")
    return tuple(tuple(order) for order in best[1])


def unit_span(orders: list[list[Action]], stages: int, v_shape: bool) -> int:
    """The step's length when every F, B and W takes one unit and messages are instant (``run_orders``)."""
    return span(orders, stages, v_shape, {"F": 1, "B": 1, "W": 1})


def span(orders: list[list[Action]], stages: int, v_shape: bool, cost: dict[str, int]) -> int:
    """The step's length when op takes ``cost[op]`` time units and messages are instant (``run_orders``)."""
    rows, complete = run_orders(orders, stages, 2 if v_shape else 1, v_shape, cost)
    if not complete:
        raise ValueError("the orders wait on themselves")
    return max(end for row in rows for _, end, _ in row)


def run_orders(orders: list[list[Action]], stages: int, virtual_stages: int, v_shape: bool,
               cost: dict[str, int]) -> tuple[list[list[tuple[int, int, Action]]], bool]:
    """When each action of ``orders`` (per pp rank) runs if op takes ``cost[op]`` time units and messages are
    instant: per rank, [(start, end, action)] in order, each action after its rank's previous one and after
    what it waits for (``dependency``); and whether every action ran (False: the orders wait on themselves)."""
    last = stages * virtual_stages - 1
    done: dict[tuple[str, int, int], int] = {}  # (op, micro-batch, virtual stage) -> end time
    pos, clock = [0] * stages, [0] * stages
    out: list[list[tuple[int, int, Action]]] = [[] for _ in range(stages)]
    progressed = True
    while progressed:
        progressed = False
        for r in range(stages):
            while pos[r] < len(orders[r]):
                op, i, c = orders[r][pos[r]]
                v = virtual_stage(r, c, stages, v_shape)
                need = dependency(op, i, v, last)
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need] if need is not None else 0)
                clock[r] = done[(op, i, v)] = start + cost[op]
                out[r].append((start, clock[r], (op, i, c)))
                pos[r] += 1
                progressed = True
    return out, all(p == len(order) for p, order in zip(pos, orders))


def list_schedule_v(stages: int, microbatches: int, reserve: int = 2,
                    forward_first: bool = False) -> list[list[Action]]:
    """A ZB-V action list of every pp rank, by list scheduling at F = B = W = 1 time unit. At every tick each
    rank runs the first runnable of: its next B (older micro-batch first, then c = 1), its next F (c = 1
    first), its oldest pending W; with ``forward_first`` the F before the B (the rank keeps the V fed; the
    memory rule below still bounds the Fs). An action is runnable when its input is here: a neighbour's
    message that is the oldest not yet used on that link (NCCL matches in order), or its own earlier action;
    when a message it sends finds the link to its peer empty (one message in flight per link, so a send's receive
    is posted soon: the strict rendezvous completes); and, for an F entering c = 0, when the rank it runs
    on keeps ``load`` (alive units, one reserved for each micro-batch between its c = 0 and c = 1 forward,
    ``reserve`` for each c = 0 forward on its way there) plus ``reserve`` within 1F1B's peak ``2 min(pp, M)``:
    2 keeps room for the micro-batch's c = 1 unit too, 1 only for its c = 0 unit, trusting a W to have freed
    one by its c = 1 forward (``zb_v_orders`` checks the result). Raises RuntimeError where it stalls. The
    per-rank order is the schedule."""
    m, last, cap = microbatches, 2 * stages - 1, 2 * min(stages, microbatches)
    finished: set[tuple[str, int, int]] = set()  # (op, micro-batch, virtual stage) run in an earlier tick
    next_f = [[0, 0] for _ in range(stages)]  # per rank, per c: the next micro-batch to run F (or B) for
    next_b = [[0, 0] for _ in range(stages)]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(stages)]  # (micro-batch, c) in B order
    links: dict[tuple[int, int], list[tuple[str, int, int]]] = {}  # (sender, receiver) -> messages not yet used
    entering = [0] * stages  # c = 0 forwards sent to the rank, not yet run there
    orders: list[list[Action]] = [[] for _ in range(stages)]

    def load(r: int) -> int:
        alive = sum(next_f[r]) - sum(next_b[r]) + len(pending_w[r])
        return alive + next_f[r][0] - next_f[r][1] + reserve * entering[r]

    def source(op: str, i: int, r: int, c: int) -> tuple[int | None, tuple[str, int, int] | None]:
        need = dependency(op, i, virtual_stage(r, c, stages, True), last)
        sender = None if need is None else holder(need[2], stages, True)[0]
        return (None if sender == r else sender), need

    def target(op: str, r: int, c: int) -> int | None:
        v = virtual_stage(r, c, stages, True) + (1 if op == "F" else -1)
        receiver = holder(v, stages, True)[0] if 0 <= v <= last else r
        return None if receiver == r else receiver

    def runnable(r: int, op: str, i: int, c: int) -> bool:
        if i >= (m if op == "F" else next_f[r][c]):
            return False
        sender, need = source(op, i, r, c)
        receiver = target(op, r, c)
        waiting = links.get((sender, r), []) if sender is not None else []
        arrived = need is None or need in finished if sender is None else bool(waiting) and waiting[0] == need
        room = not (op == "F" and c == 0 and sender is None and load(r) + reserve > cap)
        if receiver is not None:
            room = room and not links.get((r, receiver)) and not (op == "F" and c == 0
                                                                  and load(receiver) + reserve > cap)
        return arrived and room

    def pick(r: int) -> Action | None:
        backwards = [("B", next_b[r][c], c) for c in (1, 0) if runnable(r, "B", next_b[r][c], c)]
        forwards = [("F", next_f[r][c], c) for c in (1, 0) if runnable(r, "F", next_f[r][c], c)]
        if forward_first and forwards:
            return forwards[0]
        if backwards:
            return min(backwards, key=lambda action: action[1])
        if forwards:
            return forwards[0]
        return ("W", *pending_w[r][0]) if pending_w[r] else None

    def run(r: int, action: Action, sent: list[tuple[tuple[int, int], tuple[str, int, int]]]) -> None:
        op, i, c = action
        if op != "W":
            sender, _ = source(op, i, r, c)
            if sender is not None:
                links[(sender, r)].pop(0)
                entering[r] -= op == "F" and c == 0
            receiver = target(op, r, c)
            if receiver is not None:
                sent.append(((r, receiver), (op, i, virtual_stage(r, c, stages, True))))
                entering[receiver] += op == "F" and c == 0
        if op == "F":
            next_f[r][c] += 1
        elif op == "B":
            next_b[r][c] += 1
            pending_w[r].append((i, c))
        else:
            pending_w[r].pop(0)
        orders[r].append(action)

    tick = 0
    while any(len(order) < 6 * m for order in orders):
        ran: list[tuple[str, int, int]] = []
        # ranks decide in turn, each seeing the loads its predecessors this tick left
        sent: list[tuple[tuple[int, int], tuple[str, int, int]]] = []
        for r in range(stages):
            action = pick(r)
            if action is not None:
                run(r, action, sent)
                ran.append((action[0], action[1], virtual_stage(r, action[2], stages, True)))
        if not ran:
            raise RuntimeError(f"zb-v list scheduling stalled at tick {tick} (pp={stages}, M={m})")
        finished.update(ran)  # what ran and was sent this tick is there for the next one
        for link, message in sent:
            links.setdefault(link, []).append(message)
        tick += 1
    return orders


def order_problems(orders: list[list[Action]], microbatches: int, virtual_stages: int) -> list[str]:
    """What breaks the split-backward rules, one line each (empty: none): every (micro-batch, c) of every
    rank runs exactly one F, one B and one W, B after F and W after B."""
    found = []
    units = [(i, c) for i in range(microbatches) for c in range(virtual_stages)]
    for r, order in enumerate(orders):
        if sorted(order) != sorted((op, i, c) for op in "FBW" for i, c in units):
            found.append(f"rank {r}: not exactly one F, B and W per (micro-batch, c)")
            continue
        position = {action: k for k, action in enumerate(order)}
        found += [f"rank {r}: micro-batch {i}, c={c}: F, B, W out of order" for i, c in units
                  if not position[("F", i, c)] < position[("B", i, c)] < position[("W", i, c)]]
    return found


def peak_alive(order: list[Action], until: str = "W") -> int:
    """The most (micro-batch, c) whose F has run and whose ``until`` ("W", or "B" for the whole activations)
    has not, at any point of ``order``."""
    alive = peak = 0
    for op, _, _ in order:
        alive += 1 if op == "F" else -1 if op == until else 0
        peak = max(peak, alive)
    return peak


def memory_problems(kind: str, orders: list[list[Action]], microbatches: int, virtual_stages: int) -> list[str]:
    """Where ``orders`` exceed 1F1B's activation memory, one line each (empty: nowhere): on any rank more
    alive units (F run, W not) than 1F1B's peak ``V min(pp, M)``; for zb-h1 also, on rank r, more micro-batches
    with F run and B not than 1F1B's ``min(pp - r, M)`` there."""
    stages, found = len(orders), []
    for r, order in enumerate(orders):
        alive, cap = peak_alive(order), virtual_stages * min(stages, microbatches)
        if alive > cap:
            found.append(f"rank {r}: {alive} alive (micro-batch, c) > 1F1B's peak {cap}")
        whole, own = peak_alive(order, "B"), min(stages - r, microbatches)
        if kind == "zb-h1" and whole > own:
            found.append(f"rank {r}: {whole} micro-batches between F and B > 1F1B's {own}")
    return found
