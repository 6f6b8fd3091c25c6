"""``silu_mul`` (hpctrain/models/swiglu.py): autograd's ``F.silu(gate) * up`` in value and gradient bit for bit
in float64, float32 and bfloat16, saving two [..., f] tensors for the backward where autograd saves three."""
import pytest
import torch
import torch.nn.functional as F

from hpctrain.models.swiglu import silu_mul
from hpctrain.profiling.activations import ActivationMeter


def grads(fn, gate, up, dy):
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = fn(g, u)
    out.backward(dy)
    return out.detach(), g.grad, u.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_value_and_gradients_are_autograds_bit_for_bit(dtype):
    torch.manual_seed(0)
    gate, up, dy = (torch.randn(16, 48, dtype=torch.float64).mul(3).to(dtype) for _ in range(3))
    for ours, ref in zip(grads(silu_mul, gate, up, dy), grads(lambda g, u: F.silu(g) * u, gate, up, dy)):
        assert ours.dtype == dtype
        assert torch.equal(ours, ref)


def test_saves_gate_and_up_only():
    gate = torch.randn(32, 64, requires_grad=True)
    up = torch.randn(32, 64, requires_grad=True)
    saved = {}
    for name, fn in (("ours", silu_mul), ("autograd", lambda g, u: F.silu(g) * u)):
        meter = ActivationMeter()
        with meter.saving():
            out = fn(gate * 1, up * 1)  # non-leaf inputs, as a linear's outputs are
            saved[name] = meter.sample()
        del out
    assert saved["ours"] == 2 * 32 * 64 * 4 and saved["autograd"] == 3 * 32 * 64 * 4


def test_without_grad_it_is_the_plain_expression():
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
    with torch.no_grad():
        g = gate.clone().requires_grad_()
        assert silu_mul(g, up).grad_fn is None
