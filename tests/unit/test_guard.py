"""The divergence guard's verdicts (hpctrain/train/guard.py): what is skipped, what stops the run."""
import math

from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.train.guard import DivergenceGuard

INF, NAN = math.inf, math.nan


def test_without_loss_scaling_a_non_finite_gradient_norm_stops_or_skips():
    off = DynamicLossScaler(enabled=False)
    verdict = DivergenceGuard("stop").judge(3, 2.5, INF, off)
    assert verdict.skip and verdict.stop == "non-finite gradient norm" and verdict.detail.startswith("step 3:")
    skip = DivergenceGuard("skip", max_skipped_steps=2)
    assert [skip.judge(s, 2.5, INF, off).stop for s in (1, 2, 3)] == [None, None, "too many skipped steps"]
    assert skip.judge(4, 2.5, 1.0, off).skip is False and skip.consecutive_skips == 0  # a good step resets


def test_a_non_finite_loss_is_divergence_in_every_dtype():
    for scaler in (DynamicLossScaler(enabled=False), DynamicLossScaler(enabled=True)):
        verdict = DivergenceGuard("stop").judge(1, NAN, 1.0, scaler)
        assert verdict.skip and verdict.stop == "non-finite loss" and "nan" in verdict.detail


def test_float16_overflow_is_the_scalers_business_until_the_scale_runs_out():
    scaler = DynamicLossScaler(initial=4.0, enabled=True, min_scale=1.0)
    guard = DivergenceGuard("stop", max_skipped_steps=4)
    verdicts = [guard.judge(s, 2.5, INF, scaler) for s in range(1, 8)]
    # steps 1 and 2 run at 4 and 2 (halving: not counted); steps 3..7 at the minimum 1: the fifth stops
    assert all(v.skip for v in verdicts) and [v.stop for v in verdicts[:6]] == [None] * 6
    assert scaler.scale == 1.0 and verdicts[6].stop == "too many skipped steps"
    assert "(its minimum)" in verdicts[6].detail and "overflow" in verdicts[6].detail
    assert "5 consecutive steps skipped" in verdicts[6].detail


def test_any_initial_float16_scale_recovers_however_many_halvings_it_takes():
    """1e12 overflows until the scale is below ~6e4 (40 halvings here, far more than max_skipped_steps)."""
    scaler = DynamicLossScaler(initial=1e12, enabled=True, min_scale=1.0)
    guard = DivergenceGuard("stop", max_skipped_steps=2)
    verdicts = [guard.judge(s, 2.5, INF if scaler.scale > 1e-3 * 2 ** 26 else 1.0, scaler) for s in range(1, 60)]
    assert not any(v.stop for v in verdicts) and sum(v.skip for v in verdicts) > 20
    assert not verdicts[-1].skip and guard.consecutive_skips == 0


def test_non_finite_losses_count_at_any_scale_and_halving_overflows_do_not_break_the_run_of_them():
    scaler = DynamicLossScaler(initial=1e12, enabled=True, min_scale=1.0)
    guard = DivergenceGuard("skip", max_skipped_steps=2)
    stops = [guard.judge(1, NAN, 1.0, scaler).stop, guard.judge(2, 2.5, INF, scaler).stop,
             guard.judge(3, NAN, 1.0, scaler).stop, guard.judge(4, NAN, 1.0, scaler).stop]
    assert stops == [None, None, None, "too many skipped steps"] and guard.consecutive_skips == 3
