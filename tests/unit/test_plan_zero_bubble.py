"""``hpctrain plan`` models the zero-bubble schedules (issue #53): zb-h1's bubble is a third of 1F1B's, zb-v's
a sixth; both hold min(pp, M) micro-batches of activations on every rank (alive until their W)."""
import pytest

from hpctrain.config import ModelConfig, resolve_model
from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Candidate, Options, step_time
from hpctrain.plan.devices import device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.memory import memory
from hpctrain.plan.planner import SearchSpace, plan


def custom():
    return resolve_model(ModelConfig(preset="custom", vocab_size=128, d_model=1024, n_layers=64, n_heads=8,
                                     n_kv_heads=8, d_ff=4096, max_seq_len=512))


def test_bubble_share_and_activations_against_1f1b():
    m, machine = custom(), Machine(device_preset("a100"), links_from_bandwidth(1e6, None), 1, 8)
    for pp, mb in ((4, 8), (8, 32)):
        def layout(schedule, v=1):
            return Layout(pp, 1, pp, 1, mb, mb, 512, schedule=schedule, virtual_stages=v)
        base = step_time(m, Candidate(layout("1f1b")), machine)
        h1 = step_time(m, Candidate(layout("zb-h1")), machine)
        zv = step_time(m, Candidate(layout("zb-v", 2)), machine)
        assert h1.bubble_s == pytest.approx(base.bubble_s / 3)
        assert zv.bubble_s == pytest.approx(base.bubble_s / 6, rel=0.01)  # its p2p: V = 2
        assert h1.compute_s == base.compute_s
        zv_sweep = step_time(m, Candidate(layout("zb-v", 2)), machine, Options(virtual_stages=2))  # as sweep gives it
        assert zv_sweep.bubble_s == pytest.approx(zv.bubble_s)
        one = memory(m, layout("1f1b"), "off", Options())
        for zb in (memory(m, layout("zb-h1"), "off", Options()), memory(m, layout("zb-v", 2), "off", Options())):
            assert zb.activations_gib >= one.activations_gib  # every rank holds the first rank's min(pp, M)


def test_the_planner_searches_a_zero_bubble_schedule():
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 1, 8)
    for schedule in ("zb-h1", "zb-v"):
        result = plan(custom(), machine, 32, 512, Options(), SearchSpace(pp=4, tp=1, zero=(1,),
                                                                         sequence_parallel=(False,), schedule=schedule))
        assert result.plans and all(p.candidate.layout.schedule == schedule for p in result.plans)
        assert all(p.candidate.layout.microbatches >= 4 for p in result.plans)  # M >= pp
        assert any("microbatches >= parallel.pp" in i.reason for i in result.infeasible)


def test_zb_v_rank_zero_holds_the_embedding_and_the_head():
    """The start-up memory check counts zb-v's V shape: rank 0 holds virtual stages 0 and 2 pp - 1."""
    from hpctrain.config.arithmetic import rank_parameters

    m = resolve_model(ModelConfig(preset="custom", vocab_size=256, d_model=64, n_layers=8, n_heads=4, n_kv_heads=4,
                                  d_ff=128, max_seq_len=64))
    first, last = (rank_parameters(m, 1, 2, r, (), 2, v_shape=True) for r in (0, 1))
    assert first["vocabulary"] == 2 * 256 * 64 and last["vocabulary"] == 0
    assert first["blocks"] == last["blocks"] + 64  # the final norm too


def test_plan_recommends_a_zero_bubble_schedule_for_a_pipelined_best_plan():
    from hpctrain.commands.plan import _zero_bubble_hint

    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 1, 8)
    piped = plan(custom(), machine, 32, 512, Options(), SearchSpace(pp=4, tp=1, zero=(1,), sequence_parallel=(False,)))
    hint = _zero_bubble_hint(piped, custom(), machine, Options())
    assert hint.startswith("zero-bubble schedules on plan 1's layout") and "zb-h1" in hint and "zb-v" in hint, hint
    flat = plan(custom(), machine, 32, 512, Options(), SearchSpace(pp=1, tp=1, zero=(1,), sequence_parallel=(False,)))
    assert _zero_bubble_hint(flat, custom(), machine, Options()) == ""
