"""The divergence rules, decided once on the device (hpctrain/train/verdict.py ``StepVerdict.decide``) and
worded by hpctrain/train/guard.py: what is skipped, what stops the run, what the user reads. One process
(the world's all-reduce of one rank is the identity)."""
import math
from types import SimpleNamespace

import torch

from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.train.guard import divergence
from hpctrain.train.verdict import StepVerdict

INF, NAN = math.inf, math.nan
WORLD = SimpleNamespace(recurring_allreduce=lambda vector: lambda: None)


class Steps:
    """Steps fed (loss, gradient norm) through the device verdict; each returns (skipped, Divergence or None)."""

    def __init__(self, nonfinite: str, max_skipped_steps: int = 20, scaler=None):
        self.scaler = scaler or DynamicLossScaler(enabled=False)
        self.max_skipped_steps, self.step = max_skipped_steps, 0
        self.verdict = StepVerdict(WORLD, torch.device("cpu"), clip=1.0, nonfinite=nonfinite,
                                   max_skipped_steps=max_skipped_steps, scaler_enabled=self.scaler.enabled)

    def __call__(self, loss: float, grad_norm: float):
        self.step += 1
        self.verdict.reduce(loss, grad_norm * grad_norm, "", False)
        self.verdict.decide(self.scaler)
        self.verdict.start_read()
        reading = self.verdict.read()
        self.scaler.follow(reading.scale, reading.good_steps)
        self.reading = reading
        return reading.skipped, divergence(self.step, reading, self.max_skipped_steps, self.scaler.enabled)


def test_without_loss_scaling_a_non_finite_gradient_norm_stops_or_skips():
    skipped, stop = Steps("stop")(2.5, INF)
    assert skipped and stop.stop == "non-finite gradient norm" and stop.detail == \
        "step 1: non-finite gradient norm (gradient norm = inf)"
    steps = Steps("skip", max_skipped_steps=2)
    assert [steps(2.5, INF)[1] for _ in range(3)][:2] == [None, None] and steps.reading.stop_code == 3
    assert steps(2.5, 1.0) == (True, None)  # after the stop every update is skipped, and no second stop
    steps = Steps("skip", max_skipped_steps=2)  # a good step resets the count
    results = [steps(2.5, norm) for norm in (INF, INF, 1.0, INF, INF)]
    assert [r[0] for r in results] == [True, True, False, True, True] and all(r[1] is None for r in results)
    assert steps.reading.skips == 2


def test_a_non_finite_loss_is_divergence_in_every_dtype():
    for scaler in (DynamicLossScaler(enabled=False), DynamicLossScaler(enabled=True)):
        skipped, stop = Steps("stop", scaler=scaler)(NAN, 1.0)
        assert skipped and stop.stop == "non-finite loss" and stop.detail == "step 1: non-finite loss (loss = nan)"


def test_float16_overflow_is_the_scalers_business_until_the_scale_runs_out():
    scaler = DynamicLossScaler(initial=4.0, enabled=True, min_scale=1.0)
    steps = Steps("stop", max_skipped_steps=4, scaler=scaler)
    results = [steps(2.5, INF) for _ in range(7)]
    # steps 1 and 2 run at 4 and 2 (halving: not counted); steps 3..7 at the minimum 1: the fifth stops
    assert all(r[0] for r in results) and [r[1] for r in results[:6]] == [None] * 6
    stop = results[6][1]
    assert scaler.scale == 1.0 and stop.stop == "too many skipped steps" and stop.step == 7
    assert stop.detail == ("step 7: 5 consecutive steps skipped, more than train.max_skipped_steps = 4 (the last: "
                           "float16 loss scale 1 (its minimum) and the gradients still overflow)")


def test_any_initial_float16_scale_recovers_however_many_halvings_it_takes():
    """1e12 overflows until the scale is below ~6e4 (40 halvings here, far more than max_skipped_steps)."""
    scaler = DynamicLossScaler(initial=1e12, enabled=True, min_scale=1.0)
    steps = Steps("stop", max_skipped_steps=2, scaler=scaler)
    results = [steps(2.5, INF if scaler.scale > 1e-3 * 2 ** 26 else 1.0) for _ in range(59)]
    assert not any(r[1] for r in results) and sum(r[0] for r in results) > 20
    assert not results[-1][0] and steps.reading.skips == 0


def test_non_finite_losses_count_at_any_scale_and_halving_overflows_do_not_break_the_run_of_them():
    scaler = DynamicLossScaler(initial=1e12, enabled=True, min_scale=1.0)
    steps = Steps("skip", max_skipped_steps=2, scaler=scaler)
    stops = [steps(NAN, 1.0)[1], steps(2.5, INF)[1], steps(NAN, 1.0)[1], steps(NAN, 1.0)[1]]
    assert stops[:3] == [None, None, None] and stops[3].stop == "too many skipped steps"
    assert steps.reading.skips == 3 and "(the last: loss = nan)" in stops[3].detail
