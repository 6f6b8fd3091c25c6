"""Pipeline schedules: complete, ordered, deadlock-free for every (pp, micro-batches)."""
import pytest

from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.parallel.pipeline_parallel import (bubble_fraction, p2p_posts, posts_complete, schedule_actions,
                                                 simulate)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 7, 16])
def test_schedule_is_complete_and_deadlock_free(kind, stages, microbatches):
    for stage in range(stages):
        actions = schedule_actions(kind, stage, stages, microbatches)
        assert sorted(actions) == sorted([("F", i) for i in range(microbatches)] +
                                         [("B", i) for i in range(microbatches)])
        # forward before backward of each micro-batch; backwards in order
        for i in range(microbatches):
            assert actions.index(("F", i)) < actions.index(("B", i))
        assert [i for op, i in actions if op == "B"] == list(range(microbatches))
    assert simulate(kind, stages, microbatches)


def test_1f1b_bounds_in_flight_activations():
    stages, m = 4, 8
    for stage in range(stages):
        live, peak = 0, 0
        for op, _ in schedule_actions("1f1b", stage, stages, m):
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        assert peak == min(stages - stage, m)


def test_the_strict_model_detects_a_deadlock():
    """2 stages, 1 micro-batch, stage 0 posting the receive of B0 before it sends F0 (a broken order):
    each stage waits for the other's first post, which ``posts_complete`` (what ``simulate`` runs)
    must report; the schedule's own posts for stage 0 complete."""
    stage1 = p2p_posts("gpipe", 1, 2, 1)
    assert stage1 == [[("recv", "F", 0, 0)], [("send", "B", 0, 0)]]
    broken_stage0 = [[("recv", "B", 0, 1)], [("send", "F", 0, 1)]]
    assert not posts_complete([broken_stage0, stage1])
    assert posts_complete([p2p_posts("gpipe", 0, 2, 1), stage1]) and simulate("gpipe", 2, 1)


def test_bubble_fraction():
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(1, 8) == 0


def test_unknown_schedule():
    with pytest.raises(ValueError, match="gpipe or 1f1b"):
        schedule_actions("interleaved", 0, 2, 2)


def test_dynamic_loss_scaler():
    scaler = DynamicLossScaler(1024.0, growth_interval=2)
    assert scaler.update(float("inf")) and scaler.scale == 512.0
    assert not scaler.update(1.0) and scaler.scale == 512.0
    assert not scaler.update(1.0) and scaler.scale == 1024.0
    off = DynamicLossScaler(1024.0, enabled=False)
    assert off.scale == 1.0 and not off.update(float("nan"))


def test_grouped_posts_avoid_the_nccl_deadlock_of_ungrouped_sends():
    """1F1B's steady state: neighbours send to each other at once. Posting each send alone (as plain
    isend/recv on one NCCL stream would) deadlocks under strict rendezvous; the grouped plan does not."""
    def ungrouped(kind, stage, stages, m):
        return [[op] for post in p2p_posts(kind, stage, stages, m) for op in post]  # sends first, as posted

    for stages, m in ((2, 2), (4, 8)):
        assert not posts_complete([ungrouped("1f1b", s, stages, m) for s in range(stages)])
        assert posts_complete([p2p_posts("1f1b", s, stages, m) for s in range(stages)])


def test_every_send_has_one_matching_receive():
    for kind in ("gpipe", "1f1b"):
        for stages in (2, 3, 4):
            for m in (1, 2, 5):
                ops = {s: [op for post in p2p_posts(kind, s, stages, m) for op in post] for s in range(stages)}
                sends = sorted((s, peer, a, i) for s in ops for k, a, i, peer in ops[s] if k == "send")
                recvs = sorted((peer, s, a, i) for s in ops for k, a, i, peer in ops[s] if k == "recv")
                assert sends == recvs and len(sends) == 2 * m * (stages - 1)
