"""1-bit Adam without MPI: its bad input, and the optimizer's frozen-variance step against a float64
reference (the reducer on real ranks: tests/mpi/scripts/check_onebit_adam.py)."""
import io
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hpctrain.compression.methods import ADAMW_GAPS, warn_adamw_gap
from hpctrain.compression.quantize import ONEBIT_BLOCK, BlockOneBit
from hpctrain.config import Config, ConfigError, OptimConfig, apply_overrides, validate
from hpctrain.optim.flat import FlatOptimizer
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.slab import SlabSpec


def configured(*overrides):
    cfg = apply_overrides(Config(), list(overrides))
    validate(cfg)
    return cfg


def test_onebit_adam_validates_with_adamw_and_a_warmup():
    cfg = configured("compression.method=onebit-adam", "compression.warmup_steps=5")
    assert cfg.compression.method == "onebit-adam" and cfg.optim.name == "adamw"


@pytest.mark.parametrize("overrides,key,rule", [
    (["optim.name=sgd", "compression.warmup_steps=5"], "compression.method", "needs optim.name='adamw'"),
    (["compression.warmup_steps=0"], "compression.warmup_steps", "must be > 0"),
])
def test_onebit_adam_bad_input_is_one_line_naming_the_key(overrides, key, rule):
    with pytest.raises(ConfigError) as info:
        configured("compression.method=onebit-adam", *overrides)
    message = str(info.value)
    assert f"config: {key}:" in message and rule in message and "\n" not in message


def flat_of(dp_size=1, dp_rank=0, zero=False, dtype=torch.float64):
    ps = []
    for spec in (SlabSpec("w", (6, 4)), SlabSpec("b", (6,))):
        p = nn.Parameter(torch.randn(spec.local_shape, dtype=dtype, generator=torch.Generator().manual_seed(len(ps))))
        p.spec = spec
        ps.append(p)
    dp = None if dp_size == 1 else SimpleNamespace(size=dp_size, rank=dp_rank)
    return FlatParams(ps, dp, zero=zero)


def test_variance_freezes_after_the_warmup_and_the_step_matches_a_reference():
    """Steps 1..W are AdamW; later steps keep exp_avg_sq and its bias correction (1 - beta2^W), floor its
    root at the bias-corrected |momentum|, and update the momentum from the gradient (a single replica: no
    reducer averages it)."""
    warmup, c = 3, OptimConfig(weight_decay=0.0)
    flat = flat_of()
    opt = FlatOptimizer(flat, c, freeze_variance_after=warmup)
    x = flat.param_buffer.clone()
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    generator = torch.Generator().manual_seed(7)
    for step in range(1, 7):
        grad = torch.randn(x.numel(), dtype=x.dtype, generator=generator)
        flat.grad_buffer.copy_(grad)
        opt.step(lr=1e-2)
        m = c.beta1 * m + (1 - c.beta1) * grad
        if step <= warmup:
            v = c.beta2 * v + (1 - c.beta2) * grad * grad
        bias1, bias2 = 1 - c.beta1 ** step, 1 - c.beta2 ** min(step, warmup)
        root = v.sqrt() / math.sqrt(bias2)
        if step > warmup:  # the frozen variance is floored at the squared momentum: no coordinate moves > lr
            root = torch.maximum(root, m.abs() / bias1)
        x = x - 1e-2 / bias1 * m / (root + c.eps)
        (part,) = opt.owned_slices
        assert torch.allclose(part.exp_avg_sq, v, rtol=1e-14, atol=0)
        assert torch.allclose(flat.param_buffer, x, rtol=1e-12, atol=1e-15), step
        if step == warmup:
            frozen = part.exp_avg_sq.clone()
        elif step > warmup:
            assert torch.equal(part.exp_avg_sq, frozen)  # untouched since step W, bit for bit


def test_zero1_keeps_the_whole_momentum_with_the_owned_block_as_exp_avg():
    flat = flat_of(dp_size=2, dp_rank=1, zero=True)
    opt = FlatOptimizer(flat, OptimConfig(), freeze_variance_after=2)
    (part,) = opt.owned_slices
    whole = opt.full_momentum[part.bucket.index]
    assert whole.numel() == part.bucket.size and part.exp_avg.numel() == part.bucket.size // 2
    assert part.exp_avg.data_ptr() == whole[part.start - part.bucket.start:].data_ptr()
    assert FlatOptimizer(flat, OptimConfig()).full_momentum == {}  # plain AdamW: no extra buffer


def test_block_onebit_is_sign_times_each_blocks_mean_magnitude():
    n = 2 * ONEBIT_BLOCK + 100  # a short last block
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[:ONEBIT_BLOCK] *= 1e-4  # blocks of very different magnitudes keep their own scale
    c = BlockOneBit(None)
    payload = c.compress(x)
    assert payload.numel() == c.payload_nbytes(n, x.dtype) == -(-(4 * 3 + -(-n // 8)) // 8) * 8
    y = c.decompress(payload, n, x.dtype)
    for lo in range(0, n, ONEBIT_BLOCK):
        xb = x[lo:lo + ONEBIT_BLOCK]
        want = torch.where(xb >= 0, 1.0, -1.0).double() * xb.abs().mean().float().double()
        assert torch.equal(y[lo:lo + ONEBIT_BLOCK], want)


@pytest.mark.parametrize("method,optimizer,rank,warned", [
    ("topk", "adamw", 0, True), ("randomk", "adamw", 0, True), ("onebit", "adamw", 0, True),
    ("topk", "adamw", 1, False), ("topk", "sgd", 0, False), ("powersgd", "adamw", 0, False),
    ("onebit-adam", "adamw", 0, False)])
def test_methods_that_do_not_come_near_dense_adamw_warn_on_rank_0(method, optimizer, rank, warned):
    stream = io.StringIO()
    warn_adamw_gap(SimpleNamespace(method=method), optimizer, rank, stream)
    lines = stream.getvalue().splitlines()
    assert len(lines) == int(warned)
    assert not warned or (f"compression.method={method!r}" in lines[0] and ADAMW_GAPS[method] in lines[0])


@pytest.mark.parametrize("warmup,steps,warned", [(20, 120, True), (39, 120, True), (40, 120, False),
                                                 (333, 1000, True), (334, 1000, False), (20, 0, False)])
def test_onebit_adam_with_a_short_warm_up_warns_with_the_measured_range(warmup, steps, warned):
    stream = io.StringIO()
    warn_adamw_gap(SimpleNamespace(method="onebit-adam", warmup_steps=warmup), "adamw", 0, stream, steps)
    lines = stream.getvalue().splitlines()
    assert len(lines) == int(warned)
    if warned:
        assert f"compression.warmup_steps={warmup}" in lines[0] and "+8.7%" in lines[0]
        assert f"compression.warmup_steps >= {-(-steps // 3)}" in lines[0]
    other_rank = io.StringIO()
    warn_adamw_gap(SimpleNamespace(method="onebit-adam", warmup_steps=warmup), "adamw", 1, other_rank, steps)
    assert other_rank.getvalue() == ""
