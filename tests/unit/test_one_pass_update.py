"""AdamW in one compiled pass (optim/one_pass.py, issue #52 item 3) against ``torch._fused_adamw_`` + the copy
into half-precision parameters: float32 and bfloat16 masters, a slice mixing decayed and plain runs (the mask),
ZeRO-1 slices, a device coefficient, a device skip flag, a changing lr with no recompile, gradients untouched."""
import pytest
import torch

from hpctrain.config import OptimConfig
from hpctrain.optim.flat import FlatOptimizer
from hpctrain.optim.one_pass import adamw_one_pass
from test_fused_adamw import FLOAT32_RTOL, flat_of


def run(dtype, one_pass: bool, *, compiled=False, zero=False, steps=4, skip_at=None, on_device=True):
    flat = flat_of(dtype, dp_size=2 if zero else 1, zero=zero)
    opt = FlatOptimizer(flat, OptimConfig(weight_decay=0.1), one_pass=one_pass)
    assert (opt.one_pass is not None) == one_pass
    if one_pass and not compiled:
        opt.one_pass.update = adamw_one_pass  # the same function, eager: the arithmetic alone
    generator = torch.Generator().manual_seed(5)
    grads = []
    for step in range(1, steps + 1):
        grad = torch.randn(flat.grad_buffer.numel(), generator=generator)
        flat.grad_buffer.copy_(grad.to(flat.grad_buffer.dtype))
        for s in opt.owned_slices:
            flat.owned_grad(s.bucket, s.start, s.end).copy_(flat.grad_buffer[s.start:s.end])
        before = [flat.owned_grad(s.bucket, s.start, s.end).clone() for s in opt.owned_slices]
        coef = torch.tensor(0.5 / step, dtype=torch.float64) if on_device else 0.5 / step
        opt.step(1e-2 * step, coef, found_inf=torch.tensor(float(step == skip_at)))
        grads.append([torch.equal(b, flat.owned_grad(s.bucket, s.start, s.end))
                      for b, s in zip(before, opt.owned_slices)])
    masters = torch.cat([s.master for s in opt.owned_slices])
    moments = torch.cat([torch.cat([s.exp_avg, s.exp_avg_sq]) for s in opt.owned_slices])
    return masters, moments, opt, grads


@pytest.mark.parametrize("dtype,zero,on_device", [(torch.float32, False, True), (torch.float32, True, False),
                                                  (torch.bfloat16, False, True), (torch.bfloat16, True, True)])
def test_one_pass_equals_the_fused_kernel_within_float32_rounding(dtype, zero, on_device):
    ref, ref_moments, ref_opt, _ = run(dtype, False, zero=zero, on_device=on_device)
    got, moments, opt, grads = run(dtype, True, zero=zero, on_device=on_device)
    assert any(mask is not None for mask in opt.one_pass.masks)  # a slice mixing matrices and vectors
    assert torch.allclose(got, ref, rtol=FLOAT32_RTOL, atol=1e-7), (got - ref).abs().max()
    assert torch.allclose(moments, ref_moments, rtol=FLOAT32_RTOL, atol=1e-9)
    assert opt.step_count == ref_opt.step_count == 4
    params = torch.cat([s.params for s in opt.owned_slices])
    assert torch.equal(params, got.to(params.dtype))  # the low-precision parameters written by the same pass
    assert all(all(step) for step in grads)  # the gradients are read, never written


def test_a_device_skip_flag_leaves_everything_unchanged():
    skipped, skipped_moments, opt, _ = run(torch.bfloat16, True, steps=3, skip_at=3)
    two, two_moments, _, _ = run(torch.bfloat16, True, steps=2)
    assert torch.equal(skipped, two) and torch.equal(skipped_moments, two_moments) and opt.step_count == 2


def test_compiled_equals_eager_and_a_changing_lr_never_recompiles():
    """The real torch.compile (inductor, C++ on the CPU): one graph on the first step, none after, while lr,
    the coefficient and the skip flag change every step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager, eager_moments, _, _ = run(torch.bfloat16, True, steps=4, skip_at=3)
    frames = counters["stats"]["unique_graphs"]
    got, moments, opt, grads = run(torch.bfloat16, True, compiled=True, steps=4, skip_at=3)
    assert counters["stats"]["unique_graphs"] - frames == 1
    assert torch.allclose(got, eager, rtol=1e-6, atol=1e-8) and torch.allclose(moments, eager_moments, rtol=1e-6,
                                                                                atol=1e-10)
    assert opt.step_count == 3 and all(all(step) for step in grads)


def test_compiled_update_needs_adamw_and_float32_masters():
    from hpctrain.config import ConfigError, load_config

    for overrides, says in ((["optim.name=sgd", "optim.update=compiled"], "needs optim.name='adamw'"),
                            (["train.dtype=float64", "optim.update=compiled"], "train.dtype='float64'")):
        with pytest.raises(ConfigError, match="optim.update") as info:
            load_config(None, overrides)
        assert says in str(info.value)
    assert FlatOptimizer(flat_of(torch.float64), OptimConfig(), one_pass=True).one_pass is None
    assert FlatOptimizer(flat_of(torch.float32), OptimConfig(name="sgd"), one_pass=True).one_pass is None
