"""Each compressor alone: payload size, reconstruction error bounds, and the error-feedback invariant."""
import dataclasses
import types

import pytest
import torch

from hpctrain.compression.memory import ErrorFeedback
from hpctrain.compression.methods import COMPRESSORS
from hpctrain.compression.powersgd import compressible
from hpctrain.config import CompressionConfig

CFG = types.SimpleNamespace(density=0.01, zfp_rate=8.0)
N = 10_000


def roundtrip(name, x, cfg=CFG):
    c = COMPRESSORS[name](cfg)
    payload = c.compress(x)
    assert payload.dtype == torch.uint8 and payload.numel() == c.payload_nbytes(x.numel(), x.dtype)
    assert payload.numel() % 8 == 0
    return c.decompress(payload, x.numel(), x.dtype), payload.numel()


@pytest.fixture
def x():
    return torch.randn(N, generator=torch.Generator().manual_seed(0)) * 1e-3


@pytest.mark.parametrize("name,bytes_per_value,rel_error", [
    ("fp16", 2, 1e-3), ("bf16", 2, 8e-3), ("int8", 1 + 4 / 256, 1.5e-2), ("zfp", 1, 0.2), ("onebit", 1 / 8, 0.7)])
def test_quantizers_size_and_error(x, name, bytes_per_value, rel_error):
    y, nbytes = roundtrip(name, x)
    assert nbytes <= bytes_per_value * N + 64
    assert float((y - x).norm() / x.norm()) < rel_error


def test_casts_equal_torch_casts(x):
    assert torch.equal(roundtrip("fp16", x)[0], x.half().float())
    assert torch.equal(roundtrip("bf16", x)[0], x.bfloat16().float())


def test_int8_error_is_at_most_half_a_step_per_block(x):
    y, _ = roundtrip("int8", x)
    for block in range(0, N, 256):
        xb, yb = x[block:block + 256], y[block:block + 256]
        assert (xb - yb).abs().max() <= xb.abs().max() / 127 / 2 * 1.0001


def test_onebit_is_sign_times_mean_magnitude(x):
    y, nbytes = roundtrip("onebit", x)
    assert nbytes == -(-(8 + N // 8) // 8) * 8  # padded to 8 bytes
    assert torch.allclose(y, torch.where(x >= 0, 1.0, -1.0) * x.abs().mean())


def test_topk_keeps_exactly_the_largest(x):
    y, nbytes = roundtrip("topk", x)
    k = 100
    assert nbytes == 8 * k and int((y != 0).sum()) == k
    assert torch.equal(y[y != 0], x[y != 0])
    assert y.abs().max() == x.abs().max() and x.abs()[y == 0].max() <= x.abs()[y != 0].min()


def test_randomk_indices_are_shared_and_change_per_step():
    c = COMPRESSORS["randomk"](CFG)
    a, b = c.indices(N, (1, 5, 0), "cpu"), c.indices(N, (1, 5, 0), "cpu")
    assert torch.equal(a, b) and a.numel() == 100 and a.unique().numel() == 100
    assert not torch.equal(a, c.indices(N, (1, 6, 0), "cpu"))


def test_zfp_rate_bounds_size_and_error(x):
    low, low_bytes = roundtrip("zfp", x, types.SimpleNamespace(zfp_rate=4.0))
    high, high_bytes = roundtrip("zfp", x, types.SimpleNamespace(zfp_rate=16.0))
    assert low_bytes < high_bytes <= 2 * N + 64
    assert (high - x).norm() < (low - x).norm() / 10


@pytest.mark.parametrize("name", ["topk", "onebit", "int8"])
def test_error_feedback_keeps_transmitted_plus_residual_equal_to_input(name):
    memory, c = ErrorFeedback(), COMPRESSORS[name](CFG)
    total_in = torch.zeros(N, dtype=torch.float64)
    total_sent = torch.zeros(N, dtype=torch.float64)
    for step in range(20):
        g = torch.randn(N, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        corrected = memory.corrected("b", g)
        sent = c.decompress(c.compress(corrected), N, g.dtype)
        memory.remember("b", corrected, sent)
        assert torch.allclose(sent + memory.residuals["b"], corrected, rtol=0, atol=1e-12)
        total_in += g
        total_sent += sent
    # nothing is lost, only delayed: everything sent so far plus what is held back = everything given
    assert torch.allclose(total_sent + memory.residuals["b"], total_in, atol=1e-9)


def test_powersgd_compresses_only_matrices_well_below_full_size():
    assert compressible((256, 256), 4, 0) and not compressible((256,), 4, 0)
    assert not compressible((8, 8), 4, 0)  # 2 (8 + 8) 4 > 64
    assert not compressible((256, 256), 4, 10**6)  # min_numel


def test_every_configurable_method_has_a_compressor():
    """``compression.method`` choices == the table's names + the methods that are not a chunk compressor of the
    gradient (onebit-adam compresses AdamW's momentum with ``onebit``)."""
    choices = {f.name: f.metadata for f in dataclasses.fields(CompressionConfig)}["method"]["choices"]
    assert set(choices) == set(COMPRESSORS) | {"none", "powersgd", "onebit-adam"}
    assert all(cls.name == name for name, cls in COMPRESSORS.items())


@pytest.mark.parametrize("n", [1, 7, 8, 9, 2048 * 3 + 5])
def test_sign_packing_on_the_host_is_the_device_form_byte_for_byte(n):
    """numpy's packbits (host tensors) and the torch ops (device tensors) give the same bytes: a payload
    packed on one side unpacks on the other."""
    import torch.nn.functional as F

    from hpctrain.compression.quantize import _BIT_WEIGHTS, pack_signs, unpack_signs

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[0] = 0.0  # zero counts as + (x >= 0)
    bits = F.pad((x >= 0).to(torch.uint8), (0, -n % 8)).view(-1, 8)
    device_form = (bits * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)
    assert torch.equal(pack_signs(x), device_form)
    assert torch.equal(unpack_signs(device_form, n, torch.float64), torch.where(x >= 0, 1.0, -1.0).double())
