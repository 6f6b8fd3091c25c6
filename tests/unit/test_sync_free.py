"""The sync-free step (hpctrain/train/verdict.py): the host reading a step's verdict one step late gives
bitwise the losses, gradient norms, skips and parameters of reading it before the update, through a
skipped non-finite step, a float16 loss-scale change and a divergence stop; one process (COMM_SELF)."""
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.runtime.launcher import discover
from hpctrain.train.stop import STOP_SLOTS, decode, encode, reason_from_slots, stop_slot
from hpctrain.train.trainer import Trainer

BASE = ["data.source=builtin", "data.max_bytes=60000", "train.seq_len=16", "train.global_batch=4",
        "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
        "parallel.microbatches=2", "train.warmup_steps=1", "train.lr=1e-2"]


# when the host reads a step's verdict (hpctrain/train/outcomes.py): (read_before_update, may_defer)
READS = {"before": (True, False), "after": (False, False), "late": (False, True)}


@pytest.fixture(scope="module")
def tokens():
    return load_tokens_collective(None, "builtin", None, 60000)


def run(tokens, readback: str, steps: int, *overrides, nan_at=(), defer=True):
    """``steps`` steps with the verdict read at ``readback``; NaN gradients at the steps ``nan_at``.
    Returns ([(loss, grad_norm, skipped, loss_scale)], parameters, optimizer steps, trainer.step, diverged)."""
    cfg = load_config(None, BASE + list(overrides))
    grid = ProcessGrid.from_config(cfg, discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=60)
    try:
        trainer = Trainer(cfg, grid, tokens=tokens)
        outcomes = trainer.outcomes  # a run reads late (a dense dp reduction, no 1-bit Adam)
        assert outcomes.may_defer and not outcomes.read_before_update
        outcomes.read_before_update, outcomes.may_defer = READS[readback]
        flat = trainer.parts.params.flat
        reduce = flat.finish_reduction

        def poisoned():  # an overflow in the dp reduction: every rank's norm is NaN
            reduce()
            if trainer.step + 1 in nan_at:
                flat.parts[0].grad_buffer[3] = float("nan")
        flat.finish_reduction = poisoned
        taken = []
        for _ in range(steps):
            taken.append(trainer.train_step(defer=defer))
            if trainer.diverged:
                break
        trainer.read_pending()
        finished = trainer.finished_steps()
        assert all(m.loss is not None for m in finished) and outcomes.pending is None
        rows = [(m.loss, m.grad_norm, m.skipped, m.loss_scale) for m in finished]
        return (rows, flat.param_buffer.clone(), trainer.parts.optimizer.step_count, trainer.step,
                trainer.diverged)
    finally:
        grid.close()


def test_late_reads_equal_reads_before_the_update_through_a_skipped_step(tokens):
    before = run(tokens, "before", 5, "train.nonfinite=skip", nan_at=(3,))
    late = run(tokens, "late", 5, "train.nonfinite=skip", nan_at=(3,))
    rows = before[0]
    assert len(rows) == 5 and [r[2] for r in rows] == [False, False, True, False, False], rows
    assert rows[2][1] == float("inf") and before[2] == 4  # the skipped step: no update, no bias-correction count
    assert late[0] == rows and torch.equal(late[1], before[1]) and late[2:4] == before[2:4]
    no_nan = run(tokens, "late", 2, "train.nonfinite=skip")
    assert no_nan[0] == rows[:2]  # the poison touched step 3 alone


def test_a_divergence_stop_applies_nothing_after_the_bad_step(tokens):
    """nonfinite=stop: read late, the step after the bad one runs but its update is skipped on the device;
    the run stops reporting the bad step with the state from before it."""
    before = run(tokens, "before", 6, nan_at=(3,))
    late = run(tokens, "late", 6, nan_at=(3,))
    assert before[4].stop == late[4].stop == "non-finite gradient norm" and before[3] == late[3] == 3
    assert late[0] == before[0] and len(before[0]) == 3
    assert torch.equal(late[1], before[1])
    assert torch.equal(late[1], run(tokens, "before", 2)[1])  # the parameters after step 2
    skips = ("train.nonfinite=skip", "train.max_skipped_steps=1")  # two skips in a row stop the run too
    before, late = run(tokens, "before", 6, *skips, nan_at=(2, 3)), run(tokens, "late", 6, *skips, nan_at=(2, 3))
    assert before[4].stop == late[4].stop == "too many skipped steps" and before[3] == late[3] == 3
    assert late[0] == before[0] and torch.equal(late[1], before[1]) and late[2] == before[2] == 1


def test_float16_scale_changes_on_the_device_equal_the_host_decisions(tokens):
    """A loss scale large enough to overflow: skipped steps halve it, on the device (the next step's scale,
    read late) and on the host (checked equal at each read); late, after and before reads agree bitwise."""
    fp16 = ("train.dtype=float16", f"train.loss_scale={2 ** 19}")
    before = run(tokens, "before", 5, *fp16)
    scales = [r[3] for r in before[0]]
    skipped = [r[2] for r in before[0]]
    assert any(skipped) and not all(skipped) and scales[-1] < 2 ** 19, before[0]
    for readback in ("after", "late"):
        other = run(tokens, readback, 5, *fp16)
        assert other[0] == before[0] and torch.equal(other[1], before[1]) and other[2] == before[2], readback



def test_a_huge_initial_float16_scale_halves_until_it_trains_and_only_minimum_scale_overflows_count(tokens):
    """train.loss_scale=1e12 overflows ~20 steps in a row while halving: not divergence (the scaler's search),
    so even max_skipped_steps=2 lets it recover; the host follows the device's scale at each read."""
    big = ("train.dtype=float16", "train.loss_scale=1e12", "train.max_skipped_steps=2")
    before, late = run(tokens, "before", 28, *big), run(tokens, "late", 28, *big)
    skipped = [r[2] for r in before[0]]
    assert before[4] is None and len(before[0]) == 28 and sum(skipped) > 2 and not any(skipped[-3:]), before[0]
    assert late[0] == before[0] and torch.equal(late[1], before[1]) and late[4] is None
    # overflows AT the minimum scale (1) count: two in a row are more than max_skipped_steps=1
    at_minimum = ("train.dtype=float16", "train.loss_scale=1", "train.max_skipped_steps=1")
    before, late = run(tokens, "before", 5, *at_minimum, nan_at=(2, 3)), run(tokens, "late", 5, *at_minimum,
                                                                             nan_at=(2, 3))
    assert before[4].stop == late[4].stop == "too many skipped steps" and before[3] == late[3] == 3
    assert "(its minimum)" in before[4].detail and late[0] == before[0]
    above = ("train.dtype=float16", "train.loss_scale=1024", "train.max_skipped_steps=1")  # halving: not counted
    before, late = run(tokens, "before", 5, *above, nan_at=(2, 3)), run(tokens, "late", 5, *above, nan_at=(2, 3))
    assert before[4] is None and late[4] is None and [r[2] for r in before[0]] == [False, True, True, False, False]
    assert late[0] == before[0] and torch.equal(late[1], before[1])


def test_the_device_scale_rule_and_the_host_following_it():
    """Halving (down to the minimum), growth every ``growth_interval`` good steps, a reset on overflow, load;
    the host's copy follows the device's."""
    device = DynamicLossScaler(8.0, growth_interval=2, min_scale=2.0)
    scales = []
    for finite in (True, True, True, False, False, False, False, True, True, True, True):
        device.update_on_device(torch.tensor(finite))
        scales.append(device.scale_tensor.item())
    # 8 -> 16 (2 good) -> 8 -> 4 -> 2 -> 2 (the minimum) -> 4 (2 good) -> 8 (4 good)
    assert scales == [8.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0] and device.good_tensor.item() == 4
    device.follow(device.scale_tensor.item(), int(device.good_tensor.item()))
    assert device.state_dict() == {"scale": 8.0, "good_steps": 4}
    device.load_state_dict({"scale": 64.0, "good_steps": 1})
    device.update_on_device(torch.tensor(True))
    assert device.scale_tensor.item() == 128.0


def test_stop_requests_summed_as_one_hot_slots_agree_on_the_highest():
    """What the step's world sum of the ranks' stop slots decodes to: the reason a max all-reduce would pick."""
    for requests in (["", ""], ["", "time limit"], ["time limit", "signal USR1", "", "signal USR1"],
                     ["signal TERM", "signal USR1"], ["max steps", ""]):
        summed = [0.0] * STOP_SLOTS
        for request in requests:
            if (slot := stop_slot(request)) is not None:
                summed[slot] += 1.0
        assert reason_from_slots(summed) == decode(max(encode(r) for r in requests)), requests
