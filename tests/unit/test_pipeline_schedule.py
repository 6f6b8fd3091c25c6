"""Pipeline schedules: complete, ordered, deadlock-free for every (pp, V, micro-batches)."""
import pytest
import torch

from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.parallel.pipeline_parallel import bubble_fraction, p2p_posts, schedule_actions, simulate
from hpctrain.parallel.schedules import labelled, rendezvous_completes, schedule_steps, step_posts, timeline


def posts_complete(plans, virtual_stages=1) -> bool:
    """Pipeline posts (``p2p_posts`` per pp rank) under the strict rendezvous model, as ``simulate`` runs them."""
    return rendezvous_completes(labelled(plans, virtual_stages))


def in_order(plans, virtual_stages=1) -> bool:
    """Whether, for every ordered pair of ranks, the n-th send carries the message of the n-th receive: the
    same check with every rank posting all its operations at once (then nothing can block on a rendezvous,
    only a message the receiver does not expect stays unmatched)."""
    return posts_complete([[[op for post in plan for op in post]] for plan in plans], virtual_stages)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 7, 16])
def test_schedule_is_complete_and_deadlock_free(kind, stages, microbatches):
    for stage in range(stages):
        actions = schedule_actions(kind, stage, stages, microbatches)
        assert sorted(actions) == sorted([("F", i, 0) for i in range(microbatches)] +
                                         [("B", i, 0) for i in range(microbatches)])
        # forward before backward of each micro-batch; backwards in order
        for i in range(microbatches):
            assert actions.index(("F", i, 0)) < actions.index(("B", i, 0))
        assert [i for op, i, _ in actions if op == "B"] == list(range(microbatches))
    assert simulate(kind, stages, microbatches) and simulate(kind, stages, microbatches, forward_only=True)


def test_1f1b_bounds_in_flight_activations():
    stages, m = 4, 8
    for stage in range(stages):
        live, peak = 0, 0
        for op, _, _ in schedule_actions("1f1b", stage, stages, m):
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        assert peak == min(stages - stage, m)


def test_the_strict_model_detects_a_deadlock():
    """2 stages, 1 micro-batch, stage 0 posting the receive of B0 before it sends F0 (a broken order):
    each stage waits for the other's first post, which ``posts_complete`` (what ``simulate`` runs)
    must report; the schedule's own posts for stage 0 complete."""
    stage1 = p2p_posts("gpipe", 1, 2, 1)
    assert stage1 == [[("recv", "F", 0, 0, 0)], [("send", "B", 0, 0, 0)]]
    broken_stage0 = [[("recv", "B", 0, 1, 0)], [("send", "F", 0, 1, 0)]]
    assert not posts_complete([broken_stage0, stage1])
    assert posts_complete([p2p_posts("gpipe", 0, 2, 1), stage1]) and simulate("gpipe", 2, 1)


def test_bubble_fraction():
    """Idle over ideal time, (pp - 1) / (V M), as the planner and Narayanan et al. count it."""
    assert bubble_fraction(4, 4) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 4, 2) == pytest.approx(3 / 8)
    assert bubble_fraction(1, 8) == 0


@pytest.mark.parametrize("kind,virtual_stages", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                                 ("interleaved", 3), ("interleaved", 4)])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_the_schedule_data_idles_for_bubble_fraction(kind, virtual_stages, stages, groups):
    """Timing the action lists (forward 1 unit, backward 2, per virtual stage) gives the bubble that start-up
    prints."""
    m = groups * stages
    rows = timeline(kind, stages, m, virtual_stages)
    span = max(end for row in rows for _, end, _ in row)
    ideal = 3 * m * virtual_stages
    assert all(sum(e - s for s, e, _ in row) == ideal for row in rows)
    assert (span - ideal) / ideal == pytest.approx(bubble_fraction(stages, m, virtual_stages))


def test_unknown_schedule():
    with pytest.raises(ValueError, match="gpipe, 1f1b, interleaved"):
        schedule_actions("zigzag", 0, 2, 2)
    with pytest.raises(ValueError, match="multiple of pp"):
        schedule_actions("interleaved", 0, 2, 3, 2)


def test_dynamic_loss_scaler():
    """The device rule (the only one: tests/unit/test_sync_free.py has the long sequence); the host follows."""
    scaler = DynamicLossScaler(1024.0, growth_interval=2)
    for finite, scale in ((False, 512.0), (True, 512.0), (True, 1024.0)):
        scaler.update_on_device(torch.tensor(finite))
        assert scaler.scale_tensor.item() == scale
    scaler.follow(scaler.scale_tensor.item(), int(scaler.good_tensor.item()))
    assert scaler.scale == 1024.0 and scaler.good_steps == 2
    off = DynamicLossScaler(1024.0, enabled=False)
    off.update_on_device(torch.tensor(False))
    off.follow(2.0, 5)
    assert off.scale == 1.0 and off.scale_tensor.item() == 1.0


def test_grouped_posts_avoid_the_nccl_deadlock_of_ungrouped_sends():
    """1F1B's steady state: neighbours send to each other at once. Posting each send alone (as plain
    isend/recv on one NCCL stream would) deadlocks under strict rendezvous; the grouped plan does not."""
    def ungrouped(kind, stage, stages, m):
        return [[op] for post in p2p_posts(kind, stage, stages, m) for op in post]  # sends first, as posted

    for stages, m in ((2, 2), (4, 8)):
        assert not posts_complete([ungrouped("1f1b", s, stages, m) for s in range(stages)])
        assert posts_complete([p2p_posts("1f1b", s, stages, m) for s in range(stages)])


def test_every_send_has_one_matching_receive():
    for kind, virtual_stages in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
        for stages in (2, 3, 4):
            for m in (1, 2, 5) if virtual_stages == 1 else (stages, 2 * stages):
                ops = {s: [op for post in p2p_posts(kind, s, stages, m, virtual_stages) for op in post]
                       for s in range(stages)}
                sends = sorted((s, peer, a, i) for s in ops for k, a, i, peer, _ in ops[s] if k == "send")
                recvs = sorted((peer, s, a, i) for s in ops for k, a, i, peer, _ in ops[s] if k == "recv")
                assert sends == recvs and len(sends) == 2 * m * (stages * virtual_stages - 1)


@pytest.mark.parametrize("stages", range(2, 9))
@pytest.mark.parametrize("virtual_stages", [2, 3, 4])
def test_interleaved_is_complete_ordered_and_deadlock_free(stages, virtual_stages):
    """Every (pp, V, M) with M a multiple of pp up to 4 pp: each rank runs every (micro-batch, virtual stage)
    forward and backward once, a forward after its input exists, and the posts complete in order under strict
    rendezvous (training and forward-only)."""
    for m in range(stages, 4 * stages + 1, stages):
        for stage in range(stages):
            actions = schedule_actions("interleaved", stage, stages, m, virtual_stages)
            units = [(i, c) for i in range(m) for c in range(virtual_stages)]
            assert sorted(actions) == sorted([("F", *u) for u in units] + [("B", *u) for u in units])
            for u in units:
                assert actions.index(("F", *u)) < actions.index(("B", *u))
            # Megatron's order: forwards by virtual stage in groups of pp micro-batches, backwards from the last
            forwards = [(i, c) for op, i, c in actions if op == "F"]
            assert forwards[:stages] == [(i, 0) for i in range(stages)]
            assert forwards[stages] == (0, 1)
            assert [c for op, _, c in actions if op == "B"][0] == virtual_stages - 1
        assert simulate("interleaved", stages, m, virtual_stages), (stages, virtual_stages, m)
        assert simulate("interleaved", stages, m, virtual_stages, forward_only=True), (stages, virtual_stages, m)


def test_interleaved_warmup_is_megatrons():
    """(pp - r - 1) * 2 + (V - 1) * pp forwards before the first backward, all of them when M == pp."""
    for stages, virtual_stages, m in ((4, 2, 8), (4, 3, 12), (2, 2, 6)):
        for r in range(stages):
            actions = schedule_actions("interleaved", r, stages, m, virtual_stages)
            first_b = next(k for k, a in enumerate(actions) if a[0] == "B")
            assert first_b == min((stages - r - 1) * 2 + (virtual_stages - 1) * stages, m * virtual_stages) + 1
    assert [a[0] for a in schedule_actions("interleaved", 3, 4, 4, 2)] == ["F"] * 8 + ["B"] * 8


def test_interleaved_steady_steps_pair_a_forward_with_a_backward():
    """Communication only between steps; a steady step posts both sends and both receives as one group."""
    steps = schedule_steps("interleaved", 1, 2, 4, 2)
    assert [len(s) for s in steps] == [1, 1] + [2] * 6 + [1, 1]  # warm-up (pp - r - 1) * 2 + (V - 1) * pp = 2
    first, after = step_posts(steps, 1, 2, 2)
    assert first == [("recv", "F", 0, 0, 0)]
    assert sorted(op[0] for op in after[4]) == ["recv", "recv", "send", "send"]


def test_the_strict_model_rejects_per_action_posts_for_interleaved_and_out_of_order_pairs():
    """Posting each action's send with the next action's receive (the 1f1b plan) deadlocks interleaved
    schedules; and two messages between the same ranks received in the other order (NCCL matches in order,
    whatever the tag) are rejected by ``in_order``."""
    per_action_plans = []
    for s in range(2):
        steps = [[a] for a in schedule_actions("interleaved", s, 2, 4, 2)]
        first, after = step_posts(steps, s, 2, 2)
        per_action_plans.append([p for p in [first] + after if p])
    assert in_order(per_action_plans, 2) and not posts_complete(per_action_plans, 2)
    good = [p2p_posts("interleaved", s, 2, 4, 2) for s in range(2)]  # Megatron's steps
    assert posts_complete(good, 2) and in_order(good, 2)
    swapped = [list(post) for post in good[0]]
    k = next(k for k, post in enumerate(swapped) if sum(op[0] == "recv" for op in post) == 2)
    swapped[k] = [op for op in swapped[k] if op[0] == "send"] + [op for op in swapped[k] if op[0] == "recv"][::-1]
    assert not in_order([swapped, good[1]], 2)


def test_the_diagrams_in_the_docs_are_the_schedules_output():
    """docs/parallelism.md shows ``render_timeline`` of the action lists; regenerate with the command named
    there when a schedule changes."""
    import re
    from pathlib import Path

    from hpctrain.parallel.schedules import main

    text = (Path(__file__).resolve().parents[2] / "docs" / "parallelism.md").read_text()
    blocks = re.findall(r"<!-- render_timeline: ([\w -]+) -->\n```text\n(.*?)\n```", text, re.S)
    assert len(blocks) == 4 and {b[0].split()[0] for b in blocks} == {"1f1b", "interleaved", "zb-h1", "zb-v"}
    for args, diagram in blocks:  # the command line of ``python -m hpctrain.parallel.schedules``
        assert diagram == main(args.split()), args
