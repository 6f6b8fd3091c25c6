"""SDPA kernel selection (hpctrain/models/attention_backend.py): the fastest kernel that passes its trial, with
the trials' timings and failures injected (runs anywhere); the trial itself on the CPU with fake CUDA events;
the host path; and on CUDA the real trial calls."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from fake_cuda import FakeCuda
from hpctrain.models import attention_backend
from hpctrain.models.attention_backend import HOST, Trial, TrialShape, attention, choose_sdpa, trial, use_sdpa

CUDA = torch.device("cuda")  # a device object only: the probe is injected, nothing runs on it
FLASH, EFFICIENT, MATH = SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH
CUDNN = SDPBackend.CUDNN_ATTENTION
SHAPE = TrialShape(batch=1, heads=4, seq=64, head_dim=16)


def probe_with(results: dict, default_ms=1.0):
    """A probe: ``results[(backend, masked)]`` is a time in ms or a Trial; calls are recorded."""
    calls = []

    def probe(backend, device, dtype, shape, masked):
        assert shape == TrialShape(2, 8, 128, 64)
        calls.append((backend, masked))
        result = results.get((backend, masked), default_ms)
        return result if isinstance(result, Trial) else Trial(result)
    probe.calls = calls
    return probe


def choose(probe, dtype=torch.bfloat16, masked=False, gather=None):
    return choose_sdpa(CUDA, dtype, 64, masked=masked, probe=probe, seq=128, heads=8, batch=2, gather=gather)


def test_the_fastest_kernel_first_then_the_others_by_time():
    probe = probe_with({(FLASH, False): 0.9, (EFFICIENT, False): 1.4, (CUDNN, False): 0.5})
    choice = choose(probe)
    assert choice.causal == (CUDNN, FLASH, EFFICIENT) and choice.name == "cudnn"
    assert not choice.warning and not choice.note and choice.masked == ()
    assert choice.timings == "causal: flash 0.900 ms, efficient 1.400 ms, cudnn 0.500 ms"
    assert sorted(probe.calls, key=str) == sorted([(b, False) for b in (FLASH, EFFICIENT, CUDNN)], key=str)
    assert choose(probe_with({(FLASH, False): 0.3, (CUDNN, False): 0.5})).name == "flash"


def test_masks_take_the_fastest_kernel_that_accepts_an_attn_mask():
    refused = Trial(None, "Flash attention does not support the attn_mask")  # torch's check: not a failure
    choice = choose(probe_with({(FLASH, False): 0.4, (FLASH, True): refused, (EFFICIENT, True): 2.0,
                                (CUDNN, True): 1.5}), masked=True)
    assert choice.causal[0] == FLASH and choice.masked == (CUDNN, EFFICIENT)
    assert choice.name == "flash (masked: cudnn)" and not choice.warning and not choice.note
    assert "masked: flash -, efficient 2.000 ms, cudnn 1.500 ms" in choice.timings


def test_a_kernel_that_fails_its_trial_is_named_once_with_what_runs_instead():
    broken = Trial(None, "RuntimeError: cuDNN Frontend error: no valid execution plan", failed=True)
    choice = choose(probe_with({(CUDNN, False): broken, (FLASH, False): 0.8, (EFFICIENT, False): 0.9}))
    assert choice.causal == (FLASH, EFFICIENT) and not choice.warning
    assert choice.note == ("SDPA kernel(s) cudnn (RuntimeError: cuDNN Frontend error: no valid execution plan) "
                           "failed their trial: attention runs flash")
    missing = Trial(None, "cuDNN is not available in this torch install", failed=True)
    choice = choose(probe_with({(CUDNN, False): missing, (CUDNN, True): missing}), masked=True)
    assert choice.note.count("cuDNN is not available") == 1 and "\n" not in choice.note


def test_no_fast_kernel_is_math_with_one_warning_naming_why():
    results = {(b, m): Trial(None, f"{b.name} cannot run float64") for b in (FLASH, EFFICIENT, CUDNN)
               for m in (False, True)}
    choice = choose(probe_with(results), dtype=torch.float64, masked=True)
    assert choice.causal == (MATH,) and choice.masked == (MATH,) and choice.name == "math (masked: math)"
    warning = choice.warning
    assert "\n" not in warning and "float64" in warning and "head_dim 64" in warning and not choice.note
    assert "flash: FLASH_ATTENTION cannot run float64" in warning and "cudnn: CUDNN_ATTENTION" in warning
    assert "masked attention" in warning


def test_the_ranks_agree_on_the_slowest_ranks_times():
    mine = probe_with({(FLASH, False): 0.5, (EFFICIENT, False): 0.7, (CUDNN, False): 0.6})
    other = [[2.0, 0.8, float("inf")]]  # flash, efficient, cudnn on another rank: cudnn failed there
    sent = []
    choice = choose(mine, gather=lambda times: sent.append(times) or [times] + other)
    assert sent == [[0.5, 0.7, 0.6]] and choice.causal == (EFFICIENT, FLASH)
    nowhere = [[float("inf")] * 3]
    choice = choose(mine, gather=lambda times: [times] + nowhere)
    assert choice.causal == (MATH,) and "flash: passed here, not on every rank" in choice.warning


def test_host_is_unrestricted_and_never_probed():
    probe = probe_with({})
    assert choose_sdpa(torch.device("cpu"), torch.float32, 64, masked=True, probe=probe) is HOST
    assert HOST.name == "math/cpu" and HOST.causal == () and not probe.calls


def test_the_trial_times_forward_and_backward_with_cuda_events(monkeypatch):
    cuda = FakeCuda().install(monkeypatch, available=False)
    cuda.elapsed_ms = [6.0, 9.0]
    result = trial(MATH, torch.device("cpu"), torch.float32, SHAPE, masked=False)
    assert result == Trial(2.0)  # 6 ms over TRIAL_REPS = 3 calls
    records = [e for e in cuda.log if e[0] == "record"]
    assert len(records) == 2 and cuda.events[1].synchronized == 1  # start, end; waited for the end only
    assert trial(MATH, torch.device("cpu"), torch.float32, SHAPE, masked=True) == Trial(3.0)


def test_a_kernel_torch_refuses_a_kernel_that_raises_or_computes_wrong_and_missing_cudnn(monkeypatch):
    FakeCuda().install(monkeypatch, available=False)
    refused = trial(EFFICIENT, torch.device("cpu"), torch.float32, SHAPE, masked=False)  # no CPU kernel
    assert refused.ms is None and not refused.failed and "No viable backend" in refused.reason
    real_sdpa = F.scaled_dot_product_attention

    def raising(*args, **kwargs):
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED\nstack...")
    monkeypatch.setattr(F, "scaled_dot_product_attention", raising)
    broken = trial(MATH, torch.device("cpu"), torch.float32, SHAPE, masked=False)
    assert broken == Trial(None, "RuntimeError: CUDNN_STATUS_EXECUTION_FAILED", failed=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: real_sdpa(*a, **k) * 0)
    wrong = trial(MATH, torch.device("cpu"), torch.float32, SHAPE, masked=False)
    assert wrong.failed and wrong.reason.startswith("wrong result")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert trial(CUDNN, CUDA, torch.bfloat16, SHAPE, masked=False) == \
        Trial(None, "cuDNN is not available in this torch install", failed=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the trials failing on a torch without CUDA")
def test_every_trial_failing_is_math_with_one_warning_never_a_traceback(monkeypatch):
    cuda = FakeCuda().install(monkeypatch, available=False)
    choice = choose_sdpa(CUDA, torch.bfloat16, 64, masked=True)  # the real trials: torch has no CUDA here
    assert choice.causal == (MATH,) and choice.masked == (MATH,) and "\n" not in choice.warning
    assert "Torch not compiled with CUDA enabled" in choice.warning and choice.note == ""
    assert ("reset_peak", CUDA) not in cuda.log  # the run's peak memory counts the trials (never reset)


def test_attention_runs_the_choice_in_its_order_of_priority(monkeypatch):
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril(0).triu(-3)
    restricted = HOST.__class__(causal=(MATH, FLASH), masked=(MATH,), name="math")
    for choice in (HOST, restricted):
        assert torch.allclose(attention(q, k, v, choice), F.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert torch.allclose(attention(q, k, v, choice, attn_mask=mask),
                              F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    seen, real_sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch._C._get_sdp_priority_order()[:2], torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled()))
        return real_sdpa(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    attention(q, k, v, HOST.__class__(causal=(CUDNN, FLASH), name="cudnn"))
    assert seen == [([CUDNN.value, FLASH.value], True, False)]  # the fastest first, the efficient kernel off


def test_use_sdpa_reaches_every_attention():
    from hpctrain.config import load_config, resolve_model
    from hpctrain.models.gpt import GPTStage

    stage = GPTStage(resolve_model(load_config(None, ["model.n_layers=3"]).model), (0, 3), is_first=True,
                     is_last=True)
    choice = HOST.__class__(causal=(MATH,), name="math")
    assert use_sdpa(stage, choice) is choice and len(stage.layers) == 3
    assert all(b.attn.sdpa_choice is choice for b in stage.layers.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the real cudnn/flash/efficient trials")
def test_cuda_selects_the_fastest_kernel_for_bfloat16_and_warns_for_float64():
    fast = choose_sdpa(CUDA, torch.bfloat16, 64, masked=True, seq=1000)  # not a multiple of any block
    assert fast.causal[0] in attention_backend.FAST and not fast.warning, fast
    assert fast.masked and fast.masked[0] != MATH, fast  # the efficient kernel takes a boolean mask
    assert "causal: flash" in fast.timings and "ms" in fast.timings
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
