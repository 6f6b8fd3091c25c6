"""The fused head + loss kernel's choice (hpctrain/parallel/head_kernels.py, ``model.head_kernel``) with the
trials' timings and failures injected (runs anywhere); the real trial on the CPU: hpctrain's own timed, the
libraries a clean reason (not installed, or no CUDA), a candidate's wrong result caught by the check."""
import pytest
import torch

from hpctrain.parallel import head_kernels
from hpctrain.parallel.head_kernels import HeadKernelChoice, HeadShape, HeadTrial, choose_head_kernel, trial

CUDA = torch.device("cuda")  # a device object only: the probe is injected, nothing runs on it
SHAPE = HeadShape(tokens=4096, d_model=64, n_valid=1000, rows=1024)
NOT_INSTALLED = HeadTrial(None, "liger-kernel is not installed (pip install 'hpctrain[kernels]')", missing=True)


def liger_fn(h, w, targets):
    return h.sum()


def cce_fn(h, w, targets):
    return w.sum()


def probe_with(results: dict):
    """A probe: ``results[name]`` is a time in ms or a HeadTrial (a passing candidate gets its fake fn)."""
    calls = []

    def probe(name, device, dtype, shape):
        assert shape == SHAPE and device == CUDA
        calls.append(name)
        result = results[name]
        fn = {"liger": liger_fn, "cce": cce_fn}.get(name)
        return result if isinstance(result, HeadTrial) else HeadTrial(result, fn=fn)
    probe.calls = calls
    return probe


def choose(probe, setting="auto", tp=1, fused=True, device=CUDA, gather=None, probe_here=True):
    return choose_head_kernel(setting, device, torch.bfloat16, tp, fused, SHAPE, probe=probe, gather=gather,
                              probe_here=probe_here)


def test_the_fastest_that_passed_wins():
    probe = probe_with({"hpctrain": 2.0, "liger": 1.5, "cce": 1.2})
    choice = choose(probe)
    assert choice == HeadKernelChoice("cce", cce_fn, "", "hpctrain 2.000 ms, liger 1.500 ms, cce 1.200 ms")
    assert probe.calls == ["hpctrain", "liger", "cce"]
    assert choose(probe_with({"hpctrain": 1.0, "liger": 1.5, "cce": 1.2})) == HeadKernelChoice(
        "hpctrain", None, "", "hpctrain 1.000 ms, liger 1.500 ms, cce 1.200 ms")
    assert choose(probe_with({"hpctrain": 1.0, "liger": 1.0, "cce": 1.0})).name == "hpctrain"  # ties: its own


def test_a_candidate_that_raised_or_was_wrong_is_named_and_not_picked():
    wrong = HeadTrial(None, "wrong result against hpctrain's head (dW off by 0.5 of its norm)")
    raised = HeadTrial(None, "RuntimeError: Triton Error [CUDA]: out of resource: shared memory")
    choice = choose(probe_with({"hpctrain": 2.0, "liger": wrong, "cce": raised}))
    assert choice.name == "hpctrain" and choice.fn is None
    assert choice.note == ("head kernel liger cannot run: wrong result against hpctrain's head (dW off by 0.5 of "
                           "its norm); cce cannot run: RuntimeError: Triton Error [CUDA]: out of resource: shared "
                           "memory; the head runs hpctrain's own")
    assert "\n" not in choice.note and choice.timings == "hpctrain 2.000 ms, liger -, cce -"
    choice = choose(probe_with({"hpctrain": 2.0, "liger": wrong, "cce": 1.0}))
    assert choice.name == "cce" and choice.fn is cce_fn and choice.note.endswith("; the head runs cce")


def test_auto_passes_over_a_package_that_is_not_installed_without_a_note():
    choice = choose(probe_with({"hpctrain": 2.0, "liger": NOT_INSTALLED, "cce": 1.0}))
    assert choice.name == "cce" and not choice.note
    assert choice.timings == "hpctrain 2.000 ms, liger - (not installed), cce 1.000 ms"


def test_an_explicit_candidate_that_is_not_installed_or_fails_falls_back_with_one_line():
    probe = probe_with({"liger": NOT_INSTALLED})
    choice = choose(probe, "liger")
    assert probe.calls == ["liger"] and choice.name == "hpctrain" and choice.fn is None
    assert choice.note == ("head kernel liger cannot run: liger-kernel is not installed (pip install "
                           "'hpctrain[kernels]'); the head runs hpctrain's own")
    choice = choose(probe_with({"cce": HeadTrial(None, "ValueError: boom")}), "cce")
    assert choice.name == "hpctrain" and choice.note == "head kernel cce cannot run: ValueError: boom; the head runs " \
                                                        "hpctrain's own"
    choice = choose(probe_with({"liger": 3.0}), "liger")  # asked for and passed: it, however slow
    assert choice == HeadKernelChoice("liger", liger_fn, "", "liger 3.000 ms")


@pytest.mark.parametrize("where, why", [
    (dict(device=torch.device("cpu")), "on the host"),
    (dict(tp=2), "under tp=2 (it has no vocab-parallel form)"),
    (dict(fused=False), "with model.fused_head_loss=false")])
def test_host_tp_and_the_plain_head_take_hpctrains_own_without_a_trial(where, why):
    probe = probe_with({})
    assert choose(probe, **where) == HeadKernelChoice()
    assert choose(probe, "hpctrain", **where) == HeadKernelChoice()
    choice = choose(probe, "cce", **where)
    assert choice.name == "hpctrain" and choice.fn is None
    assert choice.note == f"model.head_kernel=cce is not used {why}: the head runs hpctrain's own"
    assert probe.calls == []
    assert choose(probe, "hpctrain") == HeadKernelChoice() and probe.calls == []  # no trial when asked for it


def test_auto_keeps_hpctrains_own_in_float64_without_a_trial():
    probe = probe_with({"liger": 1.0})
    assert choose_head_kernel("auto", CUDA, torch.float64, 1, True, SHAPE, probe=probe) == HeadKernelChoice()
    assert probe.calls == []
    choice = choose_head_kernel("liger", CUDA, torch.float64, 1, True, SHAPE, probe=probe)  # asked for: tried
    assert choice.name == "liger" and probe.calls == ["liger"]


def test_the_ranks_agree_on_the_slowest_ranks_time_and_any_failure():
    sent = []

    def gather(mine):
        sent.append(mine)
        other = [(1.0, "", False), (3.0, "", False), (None, "RuntimeError: on rank 1", False)]
        return [mine, other]
    choice = choose(probe_with({"hpctrain": 2.0, "liger": 1.5, "cce": 1.2}), gather=gather)
    assert sent == [[(2.0, "", False), (1.5, "", False), (1.2, "", False)]]
    assert choice.name == "hpctrain" and choice.timings == "hpctrain 2.000 ms, liger 3.000 ms, cce -"
    assert choice.note == "head kernel cce cannot run: RuntimeError: on rank 1; the head runs hpctrain's own"


def test_a_rank_without_the_last_stage_tries_nothing_and_takes_the_others_pick():
    probe = probe_with({})
    other = [(2.0, "", False), (1.0, "", False), (None, "cut-cross-entropy is not installed", True)]
    choice = choose(probe, gather=lambda mine: [mine, other], probe_here=False)
    assert probe.calls == [] and choice.name == "liger" and choice.fn is None  # no fn: it has no head to run
    assert not choice.note and choice.timings == "hpctrain 2.000 ms, liger 1.000 ms, cce - (not installed)"
    choice = choose(probe, "cce", gather=lambda mine: [mine, [(None, "", False)]], probe_here=False)
    assert choice.note == "head kernel cce cannot run: passed here, not on every rank; the head runs hpctrain's own"


def test_the_real_trial_of_hpctrains_own_on_the_cpu():
    shape = HeadShape(tokens=300, d_model=32, n_valid=250, rows=256, chunk=128)
    for dtype in (torch.float32, torch.bfloat16):
        result = trial("hpctrain", torch.device("cpu"), dtype, shape, reps=1)
        assert result.ms is not None and result.ms > 0 and not result.reason, result


@pytest.mark.parametrize("name, package", [("liger", "liger-kernel"), ("cce", "cut-cross-entropy")])
def test_the_real_trial_of_a_library_on_the_cpu_is_a_clean_reason(name, package):
    result = trial(name, torch.device("cpu"), torch.bfloat16, HeadShape(64, 32, 250, 256))
    assert result.ms is None and result.fn is None and "\n" not in result.reason
    assert result.reason in (f"{package} is not installed (pip install 'hpctrain[kernels]')",
                             f"{package} needs a CUDA device (Triton kernels), not cpu"), result
    assert result.missing == ("not installed" in result.reason)
    choice = choose_head_kernel(name, torch.device("cpu"), torch.bfloat16, 1, True, SHAPE)  # never tried there
    assert choice.name == "hpctrain" and "on the host" in choice.note


def fake_library(monkeypatch, fn):
    """Candidate "liger" is ``fn`` (installed, runs anywhere)."""
    monkeypatch.setattr(head_kernels, "load", lambda name: (fn, "", False))
    monkeypatch.setattr(head_kernels, "NEEDS_CUDA", ())


def reference_loss(h, w, targets):
    """A correct fn(h [N, D], w [n_valid, D], targets [N], -100 = not counted) -> summed float32 loss."""
    return torch.nn.functional.cross_entropy((h @ w.t()).float(), targets, ignore_index=-100, reduction="sum")


def test_the_check_passes_a_correct_kernel_and_catches_a_wrong_one(monkeypatch):
    shape = HeadShape(tokens=200, d_model=32, n_valid=250, rows=256, chunk=64)
    fake_library(monkeypatch, reference_loss)
    for dtype in (torch.float32, torch.bfloat16):
        result = trial("liger", torch.device("cpu"), dtype, shape, reps=1)
        assert result.ms is not None and result.fn is reference_loss and not result.reason, result
    wrong = {
        "mean": lambda h, w, t: reference_loss(h, w, t) / 175,
        "counts ignored tokens": lambda h, w, t: torch.nn.functional.cross_entropy(
            (h @ w.t()).float(), t.clamp_min(0), reduction="sum"),
        "no dW": lambda h, w, t: reference_loss(h, w.detach(), t),
        "nan": lambda h, w, t: reference_loss(h, w, t) * float("nan")}
    for what, fn in wrong.items():
        fake_library(monkeypatch, fn)
        result = trial("liger", torch.device("cpu"), torch.bfloat16, shape, reps=1)
        assert result.ms is None and result.reason.startswith("wrong result against hpctrain's head"), (what, result)
    fake_library(monkeypatch, lambda h, w, t: 1 / 0)
    result = trial("liger", torch.device("cpu"), torch.float32, shape)
    assert result == HeadTrial(None, "ZeroDivisionError: division by zero")
