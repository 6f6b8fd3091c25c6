"""Zero-bubble schedules (ZB-H1, ZB-V; hpctrain/parallel/zero_bubble.py): for every pp in 2..16 and M from pp
to 64, complete (one F, B, W per micro-batch and virtual stage, in that order), within 1F1B's activation
memory, deadlock-free under strict rendezvous; ZB-H1 idles a third of 1F1B at F = B = W."""
import pytest

from hpctrain.parallel.schedules import idle_per_rank as schedules_idle_per_rank
from hpctrain.parallel.schedules import main, orders_complete, p2p_posts, schedule_actions, simulate, timeline
from hpctrain.parallel.zero_bubble import memory_problems, order_problems, peak_alive, zero_bubble_orders

KINDS = [("zb-h1", 1), ("zb-v", 2)]


def microbatch_counts(stages: int) -> list[int]:
    """M = pp, pp + 1 (fill and drain overlap), 2 pp - 1, 2 pp (ZB-V's full warm-up), 3 pp + 1 and 64."""
    return sorted({m for m in (stages, stages + 1, 2 * stages - 1, 2 * stages, 3 * stages + 1, 64) if m <= 64})


@pytest.mark.parametrize("kind,virtual_stages", KINDS)
@pytest.mark.parametrize("stages", range(2, 17))
def test_complete_within_1f1b_memory_and_deadlock_free(kind, virtual_stages, stages):
    for m in microbatch_counts(stages):
        orders = zero_bubble_orders(kind, stages, m, virtual_stages)
        assert order_problems(orders, m, virtual_stages) == [], (stages, m)
        assert memory_problems(kind, orders, m, virtual_stages) == [], (stages, m)
        if m in (stages, stages + 1, 2 * stages - 1, 64):  # the strict check costs most: these M
            assert orders_complete(kind, orders, virtual_stages), (stages, m)
        if m in (stages, 64):
            assert orders_complete(kind, orders, virtual_stages, forward_only=True), (stages, m)


@pytest.mark.parametrize("kind,virtual_stages", KINDS)
def test_schedule_actions_and_simulate_serve_them(kind, virtual_stages):
    orders = zero_bubble_orders(kind, 4, 8, virtual_stages)
    assert [schedule_actions(kind, s, 4, 8, virtual_stages) for s in range(4)] == orders
    assert simulate(kind, 4, 8, virtual_stages) and simulate(kind, 4, 8, virtual_stages, forward_only=True)
    assert all(op != "W" for post in p2p_posts(kind, 1, 4, 8, virtual_stages) for _, op, *_ in post)


def test_zb_h1_keeps_1f1bs_order_and_memory():
    """The F/B order of 1F1B; the most alive (F run, W not) on any rank is 1F1B's peak pp (its first rank);
    micro-batches between F and B on rank r at most 1F1B's pp - r."""
    stages, m = 4, 8
    for r in range(stages):
        order = schedule_actions("zb-h1", r, stages, m)
        assert [a for a in order if a[0] != "W"] == schedule_actions("1f1b", r, stages, m)
        assert peak_alive(order) == stages and peak_alive(order, "B") == stages - r


def test_zb_v_places_chunks_in_a_v():
    """Rank pp - 1 hands c = 0's forward to its c = 1 in memory: no message; rank 0 runs the loss (c = 1)."""
    posts = p2p_posts("zb-v", 1, 2, 2, 2)  # pp = 2: rank 1 holds virtual stages 1 and 2
    assert all(op[3] == 0 for post in posts for op in post)
    assert ("recv", "F", 0, 0, 0) in posts[0] and not any(op[1] == "F" and op[0] == "send" and op[4] == 0
                                                          for post in posts for op in post)


def idle_units(kind, stages, m, virtual_stages, **times) -> int:
    rows = timeline(kind, stages, m, virtual_stages, **times)
    span = max(end for row in rows for _, end, _ in row)
    return span - sum(end - start for start, end, _ in rows[0])


@pytest.mark.parametrize("stages,m", [(2, 4), (4, 8), (8, 32), (16, 64)])
def test_zb_h1_idles_a_third_of_1f1b(stages, m):
    """F = B = W = 1 (1F1B's backward is B + W = 2): 1F1B idles 3 (pp - 1) units a rank, ZB-H1 pp - 1."""
    assert idle_units("1f1b", stages, m, 1) == 3 * (stages - 1)
    assert idle_units("zb-h1", stages, m, 1) == stages - 1
    assert idle_units("1f1b", stages, m, 1, backward=1, weight=1) == 3 * (stages - 1)
    assert idle_units("zb-h1", stages, m, 1, backward=1, weight=1) == stages - 1


def test_zb_v_idles_less_than_zb_h1():
    """Units of a virtual stage (half a stage): ZB-V's idle at pp = 4, M = 8 is the least possible, pp - 1
    (the last rank's wait for its first input), half of ZB-H1's in stage time."""
    assert idle_units("zb-v", 4, 8, 2) == 3


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="zb-v needs V=2"):
        schedule_actions("zb-v", 0, 4, 8)
    with pytest.raises(ValueError, match="zb-h1 needs V=1"):
        schedule_actions("zb-h1", 0, 4, 8, 2)
    for kind, virtual_stages in KINDS:
        with pytest.raises(ValueError, match=f"{kind} needs pp >= 2 and micro-batches M >= pp, got pp=4, M=3"):
            schedule_actions(kind, 0, 4, 3, virtual_stages)
    with pytest.raises(ValueError, match="zb-h1, zb-v"):
        schedule_actions("zb-h2", 0, 4, 8)


def test_the_printer_takes_w():
    """KIND PP M [V [F B [W]]]: W given, B is the input gradient alone; the other kinds keep their 7th number as
    the cell width (docs/parallelism.md)."""
    assert main(["zb-h1", "2", "4"]) == main(["zb-h1", "2", "4", "1", "1", "1", "1"])
    assert "W3" in main(["zb-h1", "2", "4"]) and "idle 8% of the step" in main(["zb-h1", "2", "4"])
    assert "W3.1" in main(["zb-v", "2", "4", "2"])
    assert main(["1f1b", "2", "4", "1", "2", "4", "5"]).startswith("rank 0 | F0 ------ F1 ------ .    .")


def test_schedule_bubble_at_unit_times():
    """The bubble ``hpctrain info`` and train's start-up line report: 1F1B's (pp - 1) / M, zb-h1's a third of it
    ((pp - 1) / (3 M)), zb-v's a third of interleaved (V = 2)'s at pp = 2 (M = 4: 1/24 against 3/24)."""
    from hpctrain.parallel.schedules import schedule_bubble

    for pp, m in ((2, 2), (2, 4), (4, 4), (4, 8), (8, 16)):
        assert schedule_bubble("1f1b", pp, m) == (pp - 1) / m
        assert abs(schedule_bubble("zb-h1", pp, m) - (pp - 1) / (3 * m)) < 1e-12
        assert schedule_bubble("zb-v", pp, m, 2) <= schedule_bubble("interleaved", pp, m, 2)
    assert schedule_bubble("zb-v", 2, 4, 2) == 1 / 24
    assert schedule_bubble("zb-h1", 1, 4) == 0.0


def idle_per_rank(kind: str, stages: int, m: int, virtual_stages: int) -> list[int]:
    """Per rank, the units it idles in the step: waiting for input (``pp_wait``) and, after its last action,
    for the other ranks to finish (``pp_drain``): what issue #53's bubble measure counts."""
    return schedules_idle_per_rank(timeline(kind, stages, m, virtual_stages, backward=2))


@pytest.mark.parametrize("m", [2, 4, 8])
def test_at_pp_2_zero_bubble_schedules_idle_only_for_the_fill(m):
    """pp = 2 at unit times: 1F1B idles 3 units on each rank (rank 0 waits for backwards, rank 1 for its first
    input and then for rank 0's last backward: the drain), interleaved (V = 2) 3 units of half a stage; zb-h1
    and zb-v one each, the fill, the least any schedule can: a third, issue #53's bubble target at 0.5x. zb-v's
    order is the shortest of four list schedules (``zero_bubble.zb_v_orders``); those reserving two idle 2 a rank."""
    assert idle_per_rank("1f1b", 2, m, 1) == [3, 3] and idle_per_rank("zb-h1", 2, m, 1) == [1, 1]
    assert idle_per_rank("interleaved", 2, m, 2) == [3, 3] and idle_per_rank("zb-v", 2, m, 2) == [1, 1]


def test_zb_v_list_schedule_keeps_the_shorter_rule():
    """Every rule of ``list_schedule_v`` (reservation x priority) gives complete, memory-bound, deadlock-free orders
    at pp = 2, M = 4; ``list_schedule_orders`` (what ``zb_v_orders`` serves beyond its table) keeps the one with
    the shorter step at unit times (25 units, not 26), of those the shorter where W is a tenth cheaper
    (``TIE_BREAK_COSTS``): forwards first, whose rank 0 idles 176 ms at the measured costs (F 133, B 134, W 125
    ms) against 194 for B first."""
    from hpctrain.parallel.zero_bubble import (PRIORITIES, RESERVES, TIE_BREAK_COSTS, list_schedule_orders,
                                               list_schedule_v, span, unit_span)

    spans = {}
    for forward_first in PRIORITIES:
        for reserve in RESERVES:
            orders = list_schedule_v(2, 4, reserve, forward_first)
            assert order_problems(orders, 4, 2) == [] and memory_problems("zb-v", orders, 4, 2) == []
            assert orders_complete("zb-v", orders, 2)
            spans[reserve, forward_first] = unit_span(orders, 2, True)
    assert spans == {(2, False): 26, (1, False): 25, (2, True): 26, (1, True): 25}
    served = list_schedule_orders(2, 4)
    assert served == list_schedule_v(2, 4, 1, True) and unit_span(served, 2, True) == 25
    measured = {"F": 133, "B": 134, "W": 125}
    assert span(served, 2, True, measured) == 3312 < span(list_schedule_v(2, 4, 1), 2, True, measured) == 3330
    assert span(served, 2, True, TIE_BREAK_COSTS) < span(list_schedule_v(2, 4, 1), 2, True, TIE_BREAK_COSTS)
    for pp, m in ((3, 6), (4, 8), (8, 16)):  # where reserving one is the longer (3, 6), equal, or shorter
        best = min(unit_span(list_schedule_v(pp, m, r, f), pp, True) for r in RESERVES for f in PRIORITIES)
        assert unit_span(list_schedule_orders(pp, m), pp, True) == best
    # forwards first is shorter at unit times here: 105 units against B first's 107
    assert unit_span(list_schedule_orders(8, 16), 8, True) == 105 < min(
        unit_span(list_schedule_v(8, 16, r), 8, True) for r in RESERVES)


def test_zb_v_serves_its_refined_table():
    """``zb_v_orders`` serves ``zb_v_table.ORDERS`` where it has (pp, M): each entry complete, within 1F1B's
    memory, deadlock-free under strict rendezvous, each op of each virtual stage in micro-batch order, and at
    none of ``zb_v_search.ROBUST_COSTS`` idler than the list schedule it was refined from; at pp = 2 every entry
    of even M idles what the least does at each profile (rank 1's wait for its first input: one forward), where the list
    schedule idles up to 9.7 forwards (M = 16, W 30% cheaper). At the measured costs of docs/benchmarks.md (F 133,
    B 134, W 125 ms), pp = 2, M = 4: 134 ms a rank, against the list schedule's 176."""
    from hpctrain.parallel.zb_v_search import ROBUST_COSTS, idles, rank_ok
    from hpctrain.parallel.zb_v_table import ORDERS
    from hpctrain.parallel.zero_bubble import list_schedule_orders, run_orders, zb_v_orders

    assert {(2, m) for m in range(2, 17)} | {(4, 4), (4, 8)} <= set(ORDERS)
    floor = idles(zb_v_orders(2, 2), 2)
    assert floor == [100, 100, 107, 110, 100]  # one forward, or one B where B is dearer
    for (pp, m), held in ORDERS.items():
        orders = zb_v_orders(pp, m)
        assert len(orders) == len(held) == pp and order_problems(orders, m, 2) == []
        assert memory_problems("zb-v", orders, m, 2) == [] and orders_complete("zb-v", orders, 2), (pp, m)
        assert all(rank_ok(order, 2 * min(pp, m)) for order in orders), (pp, m)
        refined, listed = idles(orders, pp), idles(list_schedule_orders(pp, m), pp)
        assert refined is not None and listed is not None and len(refined) == len(ROBUST_COSTS)
        assert all(r <= s for r, s in zip(refined, listed)), (pp, m, refined, listed)
        if pp == 2 and m % 2 == 0:
            assert refined == floor, (m, refined)
    rows, _ = run_orders(zb_v_orders(2, 4), 2, 2, True, {"F": 133, "B": 134, "W": 125})
    assert schedules_idle_per_rank(rows) == [134, 134]  # one B: rank 0 waits for rank 1's last
    assert zb_v_orders(3, 6) == list_schedule_orders(3, 6)  # no entry: the list schedule


def test_zb_v_search_is_deterministic_and_rejects_what_breaks_a_rule():
    """The table is what ``zb_v_search`` makes: refining (pp, M) = (2, 2) again with the table's moves and seed
    gives its entry; ``rank_ok`` refuses an order with a W before its B, with two Ws of a virtual stage out of
    micro-batch order (the executor reduces a stage's gradients after its last micro-batch's W), or over
    the memory cap."""
    from hpctrain.parallel.zb_v_search import MOVES, rank_ok, refine
    from hpctrain.parallel.zero_bubble import list_schedule_orders, zb_v_orders

    assert refine(list_schedule_orders(2, 2), 2, 2, MOVES) == zb_v_orders(2, 2)
    good = [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0), ("W", 0, 0), ("W", 1, 0)]
    assert rank_ok(good, 2) and not rank_ok(good, 1)
    assert not rank_ok([("F", 0, 0), ("W", 0, 0), ("B", 0, 0)], 2)
    assert not rank_ok(good[:4] + [("W", 1, 0), ("W", 0, 0)], 2)


@pytest.mark.parametrize("argv", [["2", "1"], ["1", "4"], ["2"]])
def test_zb_v_search_refuses_a_shape_zb_v_cannot_run(argv, capsys):
    from hpctrain.parallel.zb_v_search import main as search_main

    with pytest.raises(SystemExit) as exit_info:
        search_main(argv)
    assert exit_info.value.code == 2
    assert "M >= pp" in capsys.readouterr().err or argv == ["2"]
