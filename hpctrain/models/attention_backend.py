"""Which kernel ``F.scaled_dot_product_attention`` runs: the fastest of cuDNN / flash / memory-efficient on CUDA.

    choice = choose_sdpa(device, dtype, head_dim, masked=window > 0 or packed, seq=S, heads=H, batch=B)
    use_sdpa(model, choice)            # every Attention module (``sdpa_choice``) calls SDPA under it
    out = attention(q, k, v, choice)   # [B, H, S, hd]; causal, or with ``attn_mask`` [.., S, S] bool

On CUDA the fast kernels (``CUDNN_ATTENTION``, ``FLASH_ATTENTION``, ``EFFICIENT_ATTENTION``) each get a trial
at start-up (``trial``): a forward and backward of the run's dtype, head size, heads, micro-batch and length
(causal; and, when the model uses masks, a sliding window or packed documents, with a boolean mask too: flash
takes no ``attn_mask``), checked (constant inputs give a known output), then ``TRIAL_REPS`` more timed with
CUDA events. The kernels that passed run in order of their time, fastest first (``sdpa_kernel`` with
``set_priority``): a later call that none of them takes fails loudly instead of silently taking the slow
path. With ``gather`` (an allgather over the world) every rank takes the slowest rank's time of each kernel,
so all ranks choose alike. When none passed: the math kernel with ONE warning naming why
(``SdpaChoice.warning``); a kernel that raised in its trial, or that this torch install lacks (cuDNN), is
named in ONE note with the kernel used instead (``SdpaChoice.note``); the trainer prints both on rank 0,
and the timings (``SdpaChoice.timings``) with ``--verbose``. On the host nothing is restricted: torch's own
choice, reported as "math/cpu". Ring attention (cp > 1, long sliding windows) does not call SDPA.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDNN = SDPBackend.CUDNN_ATTENTION
FAST = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, CUDNN)  # all tried; equal times: this order
NAMES = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math",
         CUDNN: "cudnn"}
TRIAL_SEQ = 128  # tokens of the trial call when the caller gives none
MAX_TRIAL_SEQ = 8192  # longer sequences are tried at this length (the mask trial's [S, S] bool stays 64 MiB)
TRIAL_REPS = 3  # timed forward + backward calls per kernel, after one untimed (plans, autotuning) and checked


@dataclass(frozen=True)
class TrialShape:
    """The trial's q, k, v: [batch, heads, seq, head_dim] (the model's local heads, micro-batch, length)."""

    batch: int
    heads: int
    seq: int
    head_dim: int


@dataclass(frozen=True)
class Trial:
    """One kernel's trial: ``ms`` per forward + backward, or None with ``reason`` when it cannot run;
    ``failed``: it raised, gave a wrong result or is missing from this install (not torch refusing these inputs)."""

    ms: float | None
    reason: str = ""
    failed: bool = False


@dataclass(frozen=True)
class SdpaChoice:
    """The SDPA kernels allowed for causal calls and for calls with an ``attn_mask``, fastest first (() =
    torch's own choice, unrestricted); ``name`` for the start-up line; ``warning``: why the fast kernels are
    not used ("" when they are); ``note``: kernels that failed their trial and what runs instead;
    ``timings``: each kernel's trial (--verbose)."""

    causal: tuple = ()
    masked: tuple = ()
    name: str = "math/cpu"
    warning: str = ""
    note: str = ""
    timings: str = ""


HOST = SdpaChoice()


def attention(q, k, v, choice: SdpaChoice, attn_mask=None):
    """SDPA of q, k, v [B, H, S, hd] under ``choice``: causal when ``attn_mask`` is None, else masked by it
    (bool, True = attend). No communication."""
    backends = choice.causal if attn_mask is None else choice.masked
    if not backends:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
    with sdpa_kernel(list(backends), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)


def trial(backend, device, dtype, shape: TrialShape, masked: bool, reps: int = TRIAL_REPS) -> Trial:
    """``backend``'s forward and backward of q, k, v ``shape`` (laid out as the model's [S, B, H, hd],
    permuted) of ``dtype`` on ``device``, causal or, when ``masked``, with a causal boolean ``attn_mask``:
    the time per call (``reps`` calls timed by CUDA events after one checked call), or why it cannot run."""
    if backend is CUDNN and not torch.backends.cudnn.is_available():
        return Trial(None, "cuDNN is not available in this torch install", failed=True)
    seq = min(shape.seq, MAX_TRIAL_SEQ)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            leaves = [torch.full((seq, shape.batch, shape.heads, shape.head_dim), 0.5, device=device, dtype=dtype,
                                 requires_grad=True) for _ in range(3)]  # constant: no RNG, a known output
            q, k, v = (t.permute(1, 2, 0, 3) for t in leaves)
            mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril() if masked else None
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
                out.float().sum().backward()
                if not torch.allclose(out.float(), torch.full_like(out, 0.5, dtype=torch.float32), atol=1e-2):
                    return Trial(None, "wrong result (constant inputs: every output must be 0.5)", failed=True)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
                    out.float().sum().backward()
                end.record()
                end.synchronize()
            return Trial(start.elapsed_time(end) / reps)
        except Exception as exc:  # noqa: BLE001 - any failure of a kernel is a reason, never a traceback
            # torch's checks said no (on CUDA with warnings naming why), not the kernel failing
            refused = any(text in str(exc) for text in ("No available kernel", "No viable backend"))
            reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
            if not (refused and reasons):
                reasons = [f"{type(exc).__name__}: {(str(exc).strip() or '?').splitlines()[0]}"]
            return Trial(None, " ".join(dict.fromkeys(reasons))[:300], failed=not refused)


def choose_sdpa(device, dtype, head_dim: int, masked: bool = False, probe=trial, seq: int = TRIAL_SEQ,
                heads: int = 2, batch: int = 1, gather: Callable[[list], list] | None = None) -> SdpaChoice:
    """The kernels for a model of ``dtype``, ``head_dim`` and ``heads`` (local) on ``device``, with micro-batches
    of ``batch`` sequences of ``seq`` tokens (``masked``: it also calls SDPA with an ``attn_mask``).
    ``probe(backend, device, dtype, TrialShape, masked)`` -> ``Trial`` (``trial``; injected in tests);
    ``gather``: an allgather of Python objects over the ranks that must choose alike (each kernel's time is
    the slowest rank's; a kernel fails if it fails anywhere), or None. Host devices: ``HOST``, no probe."""
    if torch.device(device).type != "cuda":
        return HOST
    shape = TrialShape(batch, heads, seq, head_dim)
    kinds = (False, True) if masked else (False,)
    trials = {(b, m): probe(b, device, dtype, shape, m) for m in kinds for b in FAST}
    # (no reset of the device's peak: the run's memory reports count everything since the process started)
    keys = list(trials)
    times = [math.inf if trials[key].ms is None else float(trials[key].ms) for key in keys]
    if gather is not None:
        times = [max(ranks) for ranks in zip(*gather(times))]
    ms = dict(zip(keys, times))
    order = {m: tuple(sorted((b for b in FAST if ms[(b, m)] < math.inf), key=lambda b: ms[(b, m)]))
             for m in kinds}
    problems = []
    for m, what in ((False, "causal attention"), (True, "masked attention (sliding window / packed documents)")):
        if m in order and not order[m]:
            order[m] = (SDPBackend.MATH,)
            problems.append(f"{what} ({'; '.join(_why(trials, m))})")
    name = NAMES[order[False][0]] + (f" (masked: {NAMES[order[True][0]]})" if masked else "")
    dtype_name = str(dtype).removeprefix("torch.")
    warning = (f"SDPA falls back to the math kernel for {' and '.join(problems)} with {dtype_name}, head_dim "
               f"{head_dim}: slower and O(S^2) memory" if problems else "")
    failed = sorted({f"{NAMES[b]} ({t.reason})" for (b, _), t in trials.items() if t.failed})
    note = (f"SDPA kernel(s) {'; '.join(failed)} failed their trial: attention runs {name}"
            if failed and not problems else "")
    timings = "; ".join(f"{'masked' if m else 'causal'}: " + ", ".join(
        f"{NAMES[b]} {ms[(b, m)]:.3f} ms" if ms[(b, m)] < math.inf else f"{NAMES[b]} -" for b in FAST) for m in kinds)
    return SdpaChoice(order[False], order.get(True, ()), name, warning, note, timings)


def _why(trials: dict, masked: bool) -> list[str]:
    """"kernel: reason" of every kernel that did not pass its ``masked`` trial on this rank (another rank's
    failure, with ``gather``: "passed here, not on every rank")."""
    return [f"{NAMES[b]}: {t.reason or 'passed here, not on every rank'}" for (b, m), t in trials.items()
            if m == masked]


def use_sdpa(model: torch.nn.Module, choice: SdpaChoice) -> SdpaChoice:
    """Set ``choice`` on every submodule of ``model`` that calls SDPA (has ``sdpa_choice``); returns it."""
    for module in model.modules():
        if hasattr(module, "sdpa_choice"):
            module.sdpa_choice = choice  # type: ignore[assignment]  # Module.__setattr__'s stub takes only Tensor/Module
    return choice
