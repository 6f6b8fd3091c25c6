"""The fused AdamW (``torch._fused_adamw_`` over the owned slices' decayed / plain runs) against the unfused
in-place ops: several steps with a clipping coefficient, weight decay on the matrices only, float32 and
half-precision masters, ZeRO-1 slices, a device coefficient and a device skip flag."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hpctrain.config import OptimConfig
from hpctrain.optim.flat import FlatOptimizer, fused_runs
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.slab import SlabSpec

# measured: the largest relative difference after 5 steps is ~2e-7 in float32 (a lerp against mul + add)
FLOAT32_RTOL = 1e-5


def flat_of(dtype, dp_size=1, dp_rank=0, zero=False):
    ps = []
    for spec in (SlabSpec("w", (16, 8)), SlabSpec("b", (16,)), SlabSpec("v", (8, 5)), SlabSpec("g", (7,))):
        p = nn.Parameter(torch.randn(spec.local_shape, generator=torch.Generator().manual_seed(len(ps))).to(dtype))
        p.spec = spec
        ps.append(p)
    done = SimpleNamespace(wait=lambda: None)  # ZeRO-1's all-gather of the updated slices: not tested here
    dp = None if dp_size == 1 else SimpleNamespace(size=dp_size, rank=dp_rank, allgather=lambda *a, **k: done)
    return FlatParams(ps, dp, zero=zero)


def run(dtype, fused: bool, zero=False, steps=5, on_device=False, skip_at=None):
    """``steps`` updates with fresh random grads and a clip coefficient; returns (masters, exp_avg, optimizer)."""
    flat = flat_of(dtype, dp_size=2 if zero else 1, zero=zero)
    opt = FlatOptimizer(flat, OptimConfig(weight_decay=0.1), fused=fused)
    assert opt.fused == fused
    generator = torch.Generator().manual_seed(3)
    for step in range(1, steps + 1):
        grad = torch.randn(flat.grad_buffer.numel(), generator=generator)
        flat.grad_buffer.copy_(grad.to(flat.grad_buffer.dtype))
        for s in opt.owned_slices:  # ZeRO-1: the slice's reduced grad (here: the same values)
            flat.owned_grad(s.bucket, s.start, s.end).copy_(flat.grad_buffer[s.start:s.end])
        coef = 0.5 / step
        skip = torch.tensor(float(step == skip_at))
        if on_device:
            opt.step(1e-2, torch.tensor(coef, dtype=torch.float64), found_inf=skip)
        else:
            opt.step(1e-2, coef, found_inf=skip)
    masters = torch.cat([s.master for s in opt.owned_slices])
    return masters, torch.cat([s.exp_avg for s in opt.owned_slices]), opt


@pytest.mark.parametrize("dtype,zero", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_fused_equals_unfused_within_float32_rounding(dtype, zero):
    ref, ref_m, ref_opt = run(dtype, fused=False, zero=zero)
    for on_device in (False, True):
        got, got_m, opt = run(dtype, fused=True, zero=zero, on_device=on_device)
        assert torch.allclose(got, ref, rtol=FLOAT32_RTOL, atol=1e-7), (got - ref).abs().max()
        assert torch.allclose(got_m, ref_m, rtol=FLOAT32_RTOL, atol=1e-7)
        assert opt.step_count == ref_opt.step_count == 5
        params = torch.cat([s.params for s in opt.owned_slices])
        assert torch.equal(params, got.to(params.dtype))  # half precision: the params follow their masters


def test_weight_decay_only_on_matrices():
    """lr * wd = 1e-3 shrink on the matrices alone: with zero gradients AdamW's step is 0, only decay moves."""
    flat = flat_of(torch.float32)
    opt = FlatOptimizer(flat, OptimConfig(weight_decay=0.1))
    before = flat.param_buffer.clone()
    opt.step(1e-2)
    runs = opt.owned_slices[0].runs
    assert {d for *_, d in runs} == {True, False}
    for lo, hi, decayed in runs:
        expected = before[lo:hi] * (1 - 1e-3) if decayed else before[lo:hi]
        assert torch.equal(flat.param_buffer[lo:hi], expected)


def test_a_device_skip_flag_leaves_everything_unchanged():
    skipped, skipped_m, opt = run(torch.float32, fused=True, steps=3, skip_at=3)
    two, two_m, _ = run(torch.float32, fused=True, steps=2)
    assert torch.equal(skipped, two) and torch.equal(skipped_m, two_m) and opt.step_count == 2
    unfused, _, ref_opt = run(torch.float32, fused=False, steps=3, skip_at=3)
    assert torch.allclose(skipped, unfused, rtol=FLOAT32_RTOL, atol=1e-7) and ref_opt.step_count == 2


def test_float64_and_sgd_keep_the_unfused_ops():
    assert not FlatOptimizer(flat_of(torch.float64), OptimConfig()).fused
    assert not FlatOptimizer(flat_of(torch.float32), OptimConfig(name="sgd")).fused


def test_onebit_adam_s_warmup_is_the_fused_dense_adamw_bit_for_bit_then_the_variance_freezes():
    """1-bit Adam's first W updates are the fused kernel, exactly as a dense AdamW run's; update W + 1 is the
    unfused frozen-variance step (exp_avg_sq untouched), and the step count goes on from the device's."""
    dense_flat, onebit_flat = flat_of(torch.float32), flat_of(torch.float32)
    dense, onebit = FlatOptimizer(dense_flat, OptimConfig()), FlatOptimizer(onebit_flat, OptimConfig(),
                                                                           freeze_variance_after=2)
    assert dense.fused and onebit.fused
    generator = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        grad = torch.randn(dense_flat.grad_buffer.numel(), generator=generator)
        dense_flat.grad_buffer.copy_(grad)
        onebit_flat.grad_buffer.copy_(grad)
        variance = onebit.owned_slices[0].exp_avg_sq.clone()
        dense.step(1e-2, 0.5)
        onebit.step(1e-2, 0.5)
        if step <= 2:
            assert torch.equal(dense_flat.param_buffer, onebit_flat.param_buffer), step
        else:
            assert torch.equal(onebit.owned_slices[0].exp_avg_sq, variance)  # frozen
            assert not torch.equal(dense_flat.param_buffer, onebit_flat.param_buffer)
        assert onebit.step_count == dense.step_count == step


def test_fused_runs_cover_the_slice():
    assert fused_runs(10, [(2, 4), (6, 10)]) == [(0, 2, False), (2, 4, True), (4, 6, False), (6, 10, True)]
    assert fused_runs(3, []) == [(0, 3, False)]
