"""SDPA kernel selection (hpctrain/models/attention_backend.py): the choice logic with the kernels' availability
injected (runs anywhere), the host path, and on CUDA the real trial calls."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from hpctrain.models.attention_backend import HOST, attention, choose_sdpa, trial, use_sdpa

CUDA = torch.device("cuda")  # a device object only: the probe is injected, nothing runs on it
FLASH, EFFICIENT, MATH = SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH


def probe_with(unusable: dict):
    """A probe where ``unusable[(backend, masked)]`` is the reason a kernel cannot run; calls are recorded."""
    calls = []

    def probe(backend, device, dtype, head_dim, masked, seq):
        assert seq == 128
        calls.append((backend, masked))
        return unusable.get((backend, masked), "")
    probe.calls = calls
    return probe


def test_flash_first_when_everything_runs():
    probe = probe_with({})
    choice = choose_sdpa(CUDA, torch.bfloat16, 64, probe=probe)
    assert choice.causal == (FLASH, EFFICIENT) and choice.name == "flash" and not choice.warning
    assert choice.masked == () and all(not masked for _, masked in probe.calls)  # no mask used: not probed


def test_masks_take_the_efficient_kernel_flash_has_no_attn_mask():
    choice = choose_sdpa(CUDA, torch.bfloat16, 64, masked=True,
                         probe=probe_with({(FLASH, True): "flash takes no attn_mask"}))
    assert choice.causal == (FLASH, EFFICIENT) and choice.masked == (EFFICIENT,)
    assert choice.name == "flash (masked: efficient)" and not choice.warning


def test_float32_runs_the_efficient_kernel():
    choice = choose_sdpa(CUDA, torch.float32, 64, probe=probe_with({(FLASH, False): "Expected fp16 or bf16"}))
    assert choice.causal == (EFFICIENT,) and choice.name == "efficient" and not choice.warning


def test_no_fast_kernel_is_math_with_one_warning_naming_why():
    unusable = {(b, m): f"{b.name} cannot run float64" for b in (FLASH, EFFICIENT) for m in (False, True)}
    choice = choose_sdpa(CUDA, torch.float64, 96, masked=True, probe=probe_with(unusable))
    assert choice.causal == (MATH,) and choice.masked == (MATH,) and choice.name == "math (masked: math)"
    warning = choice.warning
    assert "\n" not in warning and "float64" in warning and "head_dim 96" in warning
    assert "flash: FLASH_ATTENTION cannot run float64" in warning and "efficient: EFFICIENT_ATTENTION" in warning
    assert "masked attention" in warning


def test_host_is_unrestricted_and_never_probed():
    probe = probe_with({})
    assert choose_sdpa(torch.device("cpu"), torch.float32, 64, masked=True, probe=probe) is HOST
    assert HOST.name == "math/cpu" and HOST.causal == () and not probe.calls


def test_attention_equals_sdpa_with_and_without_a_restriction():
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril(0).triu(-3)
    restricted = HOST.__class__(causal=(MATH,), masked=(MATH,), name="math")
    for choice in (HOST, restricted):
        assert torch.allclose(attention(q, k, v, choice), F.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert torch.allclose(attention(q, k, v, choice, attn_mask=mask),
                              F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_the_trial_runs_the_math_kernel_and_use_sdpa_reaches_every_attention():
    from hpctrain.config import load_config, resolve_model
    from hpctrain.models.gpt import GPTStage

    assert trial(MATH, torch.device("cpu"), torch.float32, 16, masked=True) == ""
    stage = GPTStage(resolve_model(load_config(None, ["model.n_layers=3"]).model), (0, 3), is_first=True,
                     is_last=True)
    choice = HOST.__class__(causal=(MATH,), name="math")
    assert use_sdpa(stage, choice) is choice and len(stage.layers) == 3
    assert all(b.attn.sdpa_choice is choice for b in stage.layers.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the real flash/efficient trial calls")
def test_cuda_selects_a_fast_kernel_for_bfloat16_and_warns_for_float64():
    fast = choose_sdpa(CUDA, torch.bfloat16, 64, masked=True, seq=1000)  # not a multiple of any block
    assert fast.causal[0] in (FLASH, EFFICIENT) and not fast.warning, fast
    assert fast.masked and fast.masked[0] != MATH, fast  # the efficient kernel takes a boolean mask
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert torch.allclose(attention(q, k, v, fast), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          atol=2e-2)
    slow = choose_sdpa(CUDA, torch.float64, 64)
    assert slow.causal == (MATH,) and "float64" in slow.warning, slow


def test_a_restricted_call_traces_without_graph_breaks():
    """train.compile: ``sdpa_kernel`` inside the compiled region is traced, not a graph break (dynamo only)."""
    import torch._dynamo

    restricted = HOST.__class__(causal=(MATH,), masked=(MATH,), name="math")
    q = torch.randn(1, 2, 16, 8)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    explained = torch._dynamo.explain(lambda q: attention(q, q, q, restricted) + attention(q, q, q, restricted, mask))(q)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
