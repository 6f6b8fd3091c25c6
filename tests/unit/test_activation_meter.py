"""``ActivationMeter`` (hpctrain/profiling/activations.py): live bytes follow autograd's saved tensors, a storage
counts once however many tensors view it, the model state never counts, and metering changes no result."""
import torch

from hpctrain.profiling.activations import ActivationMeter, tensors_in


def test_live_bytes_rise_with_the_forward_and_fall_after_the_backward():
    w = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.float64))
    meter = ActivationMeter(lambda: [w])
    x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    with meter.saving():
        y = torch.tanh(x @ w).pow(2).sum()  # saves x (w excluded) and tanh's output (twice: one storage)
        live = meter.sample()
        assert live == 2 * 32 * 64 * 8
        y.backward()
    assert meter.sample() == 32 * 64 * 8  # the graph is gone; x, a saved tensor, is still alive here
    del x, y  # (y's graph keeps its leaf x)
    assert meter.sample() == 0 and meter.peak == live
    assert meter.total_saved == live  # distinct storages saved over the meter's life


def test_views_share_a_storage_and_extra_tensors_count():
    meter = ActivationMeter()
    base = torch.zeros(100, dtype=torch.float32)
    assert meter.sample(tensors_in({"a": base[:10], "b": [base[50:], None]}, (torch.zeros(4),))) == 400 + 16


def test_metering_changes_no_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16, dtype=torch.float64)
    x = torch.randn(8, 16, dtype=torch.float64)
    layer(x).pow(2).sum().backward()
    plain = layer.weight.grad.clone()
    layer.weight.grad = None
    meter = ActivationMeter(lambda: list(layer.parameters()))
    with meter.saving():
        layer(x).pow(2).sum().backward()
    assert torch.equal(plain, layer.weight.grad) and meter.total_saved > 0
