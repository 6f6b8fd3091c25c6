"""Refining ZB-V's orders for real action times, offline: a seeded local search that starts from the list
schedule (``zero_bubble.list_schedule_v``, made at F = B = W = 1) and moves one action of one rank at a time,
keeping a move when the step idles no more over a set of cost profiles (``ROBUST_COSTS``) and every check
still holds. Pure Python, deterministic: the same (pp, M) and seed give the same orders.

Why: list scheduling at unit times packs the orders tight at F = B = W, and where W is cheaper (on CPUs 6-20%
at the shapes measured in docs/benchmarks.md) a rank that ran a W reaches its next receive early and waits. At
pp = 2, M = 4, at the costs measured at d_model 768 (F 133, B 134, W 125 ms) the list schedule idles 176 ms a
rank, the refined order 134: the least possible (rank pp - 1 waits pp - 1 forwards for its first input, and
every rank waits for the slowest at the step's end); at pp = 2 and even M the least at every profile below.

The search runs here, not in a training run: ``python -m hpctrain.parallel.zb_v_search --write`` rewrites
``zb_v_table.py``, which ``zero_bubble.zb_v_orders`` serves for the (pp, M) it holds.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from hpctrain.parallel.schedules import idle_per_rank, orders_complete
from hpctrain.parallel.zero_bubble import (Action, check_arguments, encode, list_schedule_orders, order_problems,
                                          peak_alive, run_orders)

# cost profiles (per virtual stage of one micro-batch, F = 100), each a shape the orders must not idle in:
# F = B = W (the unit-time schedule); W 6% cheaper (CPU, d_model 768); B 7% dearer and W 18% cheaper (CPU,
# the tiny shapes); B 10% dearer (attention's backward is twice its forward); W 30% cheaper (long sequences,
# where attention, which has no weights, dominates)
ROBUST_COSTS = ({"F": 100, "B": 100, "W": 100}, {"F": 100, "B": 100, "W": 94}, {"F": 100, "B": 107, "W": 82},
                {"F": 100, "B": 110, "W": 100}, {"F": 100, "B": 100, "W": 70})
# the (pp, M) that ``--write`` refines, and its moves for each
TABLE_SHAPES = (tuple((2, m) for m in range(2, 17)) + tuple((4, m) for m in (4, 5, 6, 7, 8, 12, 16))
                + ((8, 8), (8, 16)))
MOVES = 20000


def idles(orders: list[list[Action]], stages: int) -> list[float] | None:
    """Mean idle per rank (time units, F = 100) at each of ``ROBUST_COSTS``, messages instant; None if the
    orders wait on themselves."""
    found = []
    for cost in ROBUST_COSTS:
        rows, complete = run_orders(orders, stages, 2, True, cost)
        if not complete:
            return None
        found.append(sum(idle_per_rank(rows)) / stages)
    return found


def rank_ok(order: list[Action], cap: int) -> bool:
    """In this rank's ``order``: F before B before W for each (micro-batch, c); each op of each c in micro-batch
    order (the executor reduces a virtual stage's gradients after the W of its last micro-batch, and a link's
    messages match in order); at most ``cap`` alive."""
    position = {action: k for k, action in enumerate(order)}
    last: dict[tuple[str, int], int] = {}
    for op, i, c in order:
        if last.get((op, c), -1) > i:
            return False
        last[(op, c)] = i
    return (all(position[("F", i, c)] < position[("B", i, c)] < position[("W", i, c)]
                for op, i, c in order if op == "F") and peak_alive(order) <= cap)


def refine(orders: list[list[Action]], stages: int, microbatches: int, moves: int = MOVES,
           seed: int = 0) -> list[list[Action]]:
    """``orders`` improved by ``moves`` tries: each swaps two neighbouring actions of one rank or shifts one by up
    to 6 places, and is kept if the rank's order stays valid (``rank_ok``), the orders complete under strict
    rendezvous (``schedules.orders_complete``), the mean of ``idles`` does not grow and no profile idles more
    than in the starting orders."""
    rng, cap = random.Random(seed), 2 * min(stages, microbatches)
    start = idles(orders, stages)
    if start is None:
        raise ValueError("the starting orders wait on themselves")
    current, score = [list(order) for order in orders], sum(start)
    for _ in range(moves):
        r = rng.randrange(stages)
        order = list(current[r])
        if rng.random() < 0.5:
            k = rng.randrange(len(order) - 1)
            order[k], order[k + 1] = order[k + 1], order[k]
        else:
            k = rng.randrange(len(order))
            order.insert(max(0, min(len(order) - 1, k + rng.randint(-6, 6))), order.pop(k))
        if order == current[r] or not rank_ok(order, cap):
            continue
        candidate = current[:r] + [order] + current[r + 1:]
        found = idles(candidate, stages)
        if (found is None or sum(found) > score or any(f > s for f, s in zip(found, start))
                or not orders_complete("zb-v", candidate, 2)):
            continue
        current, score = candidate, sum(found)
    if order_problems(current, microbatches, 2):
        raise AssertionError("refine broke the split-backward rules")  # rank_ok keeps them: a bug here
    return current


def write_table(path: Path, shapes: tuple[tuple[int, int], ...], moves: int) -> None:
    """Refines the list schedule of every (pp, M) of ``shapes`` and writes them as ``zb_v_table.py``."""
    lines = ['"""ZB-V orders refined for real action times, written by ``python -m hpctrain.parallel.zb_v_search',
             f'--write`` (moves={moves}, seed 0; see zb_v_search.py). (pp, M) -> one order per pp rank, each action',
             '"F|B|W<micro-batch>.<c>". Do not edit: regenerate."""', "", "ORDERS = {"]
    for stages, m in shapes:
        began = time.time()
        start = list_schedule_orders(stages, m)
        orders = refine(start, stages, m, moves)
        before, after = idles(start, stages), idles(orders, stages)
        print(f"pp={stages} M={m}: idle per rank {fmt(before)} -> {fmt(after)} ({time.time() - began:.0f} s)",
              flush=True)
        lines.append(f"    ({stages}, {m}): (")
        lines += [f'        "{encode(order)}",' for order in orders]
        lines.append("    ),")
    path.write_text("\n".join(lines + ["}", ""]))


def fmt(values: list[float] | None) -> str:
    return "-" if values is None else "/".join(f"{v:.0f}" for v in values)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.parallel.zb_v_search",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite zb_v_table.py for TABLE_SHAPES")
    parser.add_argument("--moves", type=int, default=MOVES)
    parser.add_argument("shape", nargs="*", type=int, help="PP M: refine one shape and print its orders")
    args = parser.parse_args(argv)
    if args.write:
        write_table(Path(__file__).with_name("zb_v_table.py"), TABLE_SHAPES, args.moves)
        return
    if len(args.shape) != 2:
        parser.error("give PP M, or --write")
    stages, m = args.shape
    try:
        check_arguments("zb-v", stages, m, 2)
    except ValueError as e:
        parser.error(str(e))
    start = list_schedule_orders(stages, m)
    orders = refine(start, stages, m, args.moves)
    print(f"idle per rank at {len(ROBUST_COSTS)} profiles: {fmt(idles(start, stages))} -> "
          f"{fmt(idles(orders, stages))}")
    print("\n".join(encode(order) for order in orders))


if __name__ == "__main__":
    main(sys.argv[1:])
