"""Which kernel runs the LM head and its cross-entropy at tp = 1 (``model.head_kernel``): hpctrain's own fused
chunks (hpctrain/parallel/head_loss.py, the reference and the default), Liger-Kernel's fused linear
cross-entropy ("liger") or Apple's Cut Cross-Entropy ("cce"), picked by a trial at start-up.

    choice = choose_head_kernel(setting, device, dtype, tp_size, fused_head_loss, HeadShape(...), gather=...)
    stage.head_kernel = choice.fn                  # None: hpctrain's own
    loss = choice.fn(h, w[:n_valid], targets)      # h [N, D], w [n_valid, D], targets [N] int64 -> summed loss

A candidate's ``fn`` takes h [N, D] and the head's real rows w [n_valid, D] (the padding rows left out) of the
run's dtype, and targets [N] int64 where -100 marks a token that does not count; it returns the SUM of the
counted tokens' losses, a float32 scalar differentiable in h and w. Both libraries are optional
(``pip install 'hpctrain[kernels]'``) and need CUDA (Triton).

``trial``: one forward + backward on the run's exact shapes (tokens per micro-batch, d_model, vocabulary rows,
dtype: compiled and autotuned kernels specialise on them, so the trial's warm the run's) from seeded random
inputs, checked against hpctrain's eager ``fused_head_cross_entropy`` on the same inputs (the loss and both
gradients, compared in float32 within bf16 tolerances), then ``TRIAL_REPS`` more timed with CUDA events;
hpctrain's own is timed the same way (``own``: the run's form of it, e.g. its compiled chunks), so ``auto``
picks the fastest of the three that passed.
With ``gather`` (an allgather over the world) each time is the slowest rank's and a failure on any rank
fails the kernel there too, so every rank chooses alike. Nothing raises: a package that is not installed, a
kernel that raises or gives a wrong result is a reason, in ONE note (``HeadKernelChoice.note``) naming what
runs instead; the trainer prints it on rank 0, and the timings (``HeadKernelChoice.timings``) with --verbose.
"""
from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hpctrain.parallel.head_loss import chunk_tokens, fused_head_cross_entropy

OWN = "hpctrain"
CANDIDATES = ("liger", "cce")  # all tried under ``auto``; equal times: hpctrain's own, then this order
PACKAGES = {"liger": ("liger-kernel", "liger_kernel"), "cce": ("cut-cross-entropy", "cut_cross_entropy")}
NEEDS_CUDA = CANDIDATES  # Triton kernels: on another device a reason, not a try
EXTRA = "pip install 'hpctrain[kernels]'"
IGNORE = -100  # a target that does not count (both libraries' ignore_index)
TRIAL_REPS = 3  # timed forward + backward calls per kernel, after one untimed (autotuning) and checked
LOSS_RTOL, GRAD_RTOL = 1e-2, 3e-2  # relative error of the loss, of each gradient (in norm), in float32

HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadShape:
    """The trial's head, the last stage's: ``tokens`` per micro-batch (h [tokens, d_model]), the head's
    ``rows`` (padded vocabulary) of which the first ``n_valid`` are real; ``chunk``: model.loss_chunk_tokens."""

    tokens: int
    d_model: int
    n_valid: int
    rows: int
    chunk: int = 0


@dataclass(frozen=True)
class HeadTrial:
    """One kernel's trial: ``ms`` per forward + backward, or None with ``reason``; ``missing``: its package
    is not installed (``auto`` passes over it without a note); ``fn``: the kernel tried (None for hpctrain's)."""

    ms: float | None
    reason: str = ""
    missing: bool = False
    fn: HeadFn | None = None


@dataclass(frozen=True)
class HeadKernelChoice:
    """The head kernel of the last stage: ``name`` (for the start-up line), ``fn`` (None: hpctrain's own);
    ``note``: why a kernel asked for or tried is not used, and what runs ("" when nothing to say);
    ``timings``: each trial (--verbose)."""

    name: str = OWN
    fn: Callable | None = None
    note: str = ""
    timings: str = ""


def _liger() -> HeadFn:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    try:  # weight gradients summed in float32 over Liger's chunks, as hpctrain's (liger-kernel >= 0.6.2)
        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE, accum_dtype=torch.float32)
    except TypeError:
        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE)
    return lambda h, w, targets: loss(w, h, targets).float()  # (weight, input, target): Liger's order


def _cce() -> HeadFn:
    from cut_cross_entropy import linear_cross_entropy

    return lambda h, w, targets: linear_cross_entropy(h, w, targets, ignore_index=IGNORE, reduction="sum").float()


LOADERS: dict[str, Callable[[], HeadFn]] = {"liger": _liger, "cce": _cce}


def load(name: str) -> tuple[HeadFn | None, str, bool]:
    """(candidate ``name``'s fn, "", False), or (None, why not, whether its package is not installed)."""
    package, module = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        return None, f"{package} is not installed ({EXTRA})", True
    try:
        return LOADERS[name](), "", False
    except Exception as exc:  # noqa: BLE001 - an install that does not import is a reason, never a traceback
        return None, f"{package} does not import: {_words(exc)}", False


def _words(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip() or '?').splitlines()[0]}"[:300]


def _inputs(device, dtype: torch.dtype, shape: HeadShape, n: int):
    """Seeded (the process's RNG untouched) h [n, D] ~ N(0, 1), w [rows, D] ~ N(0, 1/D) (logits of
    about unit size; padding rows 0, as the model's), targets [n] over the real rows, every 8th -100."""
    gen = torch.Generator(device=device).manual_seed(1234)
    h = torch.randn(n, shape.d_model, generator=gen, device=device).to(dtype)
    w = torch.randn(shape.rows, shape.d_model, generator=gen, device=device).div_(math.sqrt(shape.d_model))
    w[shape.n_valid:] = 0
    targets = torch.randint(0, shape.n_valid, (n,), generator=gen, device=device)
    targets[::8] = IGNORE
    return h.requires_grad_(), w.to(dtype).requires_grad_(), targets


def _own(shape: HeadShape, n: int) -> Callable:
    """hpctrain's eager fused head + loss over the padded rows: fn(h, w [rows, D], targets) -> summed loss."""
    chunk = chunk_tokens(shape.chunk, n, shape.rows)
    return lambda h, w, targets: fused_head_cross_entropy(h, w, targets, None, 0, shape.n_valid, chunk,
                                                          targets != IGNORE)


def _real_rows(fn: HeadFn, n_valid: int) -> Callable:
    """A candidate as the model calls it: fn(h, w [rows, D], targets) -> fn(h, w[:n_valid], targets)."""
    return lambda h, w, targets: fn(h, w[:n_valid], targets)


def _mismatch(loss, dh, dw, ref) -> str:
    """"" when the loss and the gradients dh [N, D], dw [rows, D] match ``ref`` (loss, dh, dw: hpctrain's)
    within bf16 tolerances, else what differs."""
    problems = []
    got, want = float(loss), float(ref[0])
    if not abs(got - want) <= LOSS_RTOL * abs(want) + 1e-3:  # (a NaN fails too)
        problems.append(f"loss {got:.6g}, not {want:.6g}")
    for what, grad, expected in (("dh", dh, ref[1]), ("dW", dw, ref[2])):
        err = math.inf if grad is None else _relative_error(grad, expected)
        if not err <= GRAD_RTOL:
            problems.append(f"{what} off by {err:.2g} of its norm")
    return f"wrong result against hpctrain's head ({'; '.join(problems)})" if problems else ""


def _relative_error(got: torch.Tensor, want: torch.Tensor, rows: int = 4096) -> float:
    """|got - want| / |want| (2-norms over every element) in float32, ``rows`` rows at a time."""
    num = den = 0.0
    for s in range(0, want.shape[0], rows):
        g, w = got[s:s + rows].float(), want[s:s + rows].float()
        num, den = num + float((g - w).square().sum()), den + float(w.square().sum())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def trial(name: str, device, dtype: torch.dtype, shape: HeadShape, reps: int = TRIAL_REPS,
          own: Callable | None = None) -> HeadTrial:
    """Kernel ``name`` (``OWN`` or a candidate) on ``shape`` of ``dtype`` on ``device``: one checked forward +
    backward, then the time per call of ``reps`` more (CUDA events; the host's clock elsewhere), or why it
    cannot run. ``own``: hpctrain's head as the run calls it, fn(h, w [rows, D], targets) (None: the eager
    ``fused_head_cross_entropy``, which is the reference either way)."""
    fn: HeadFn | None = None
    if name != OWN:
        fn, reason, missing = load(name)
        if fn is None:
            return HeadTrial(None, reason, missing)
        if name in NEEDS_CUDA and torch.device(device).type != "cuda":
            return HeadTrial(None, f"{PACKAGES[name][0]} needs a CUDA device (Triton kernels), not {device}")
    n = max(1, shape.tokens)
    try:
        h, w, targets = _inputs(device, dtype, shape, n)
        h_ref, w_ref = h.detach().requires_grad_(), w.detach().requires_grad_()  # the same storage
        ref_loss = _own(shape, n)(h_ref, w_ref, targets)
        ref_loss.backward()
        ref = (ref_loss.detach(), h_ref.grad, w_ref.grad)
        del h_ref, w_ref, ref_loss
        call = (own or _own(shape, n)) if fn is None else _real_rows(fn, shape.n_valid)
        loss = call(h, w, targets)
        loss.backward()
        wrong = _mismatch(loss.detach(), h.grad, w.grad, ref)
        if wrong:
            return HeadTrial(None, wrong)
        del ref, loss
        cuda = torch.device(device).type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        for _ in range(reps):
            call(h, w, targets).backward()
        if cuda:
            end.record()
            end.synchronize()
            return HeadTrial(start.elapsed_time(end) / reps, fn=fn)
        return HeadTrial((time.perf_counter() - began) * 1e3 / reps, fn=fn)
    except Exception as exc:  # noqa: BLE001 - any failure of a kernel is a reason, never a traceback
        return HeadTrial(None, _words(exc))


def choose_head_kernel(setting: str, device, dtype: torch.dtype, tp_size: int, fused_head_loss: bool,
                       shape: HeadShape, probe: Callable[..., HeadTrial] = trial,
                       gather: Callable[[list], list] | None = None, probe_here: bool = True) -> HeadKernelChoice:
    """The head kernel for ``setting`` (model.head_kernel: auto, hpctrain, liger, cce). hpctrain's own, without
    a trial, on a host device, under tp > 1 (the candidates have no vocab-parallel form) or with the fused head
    off (with a note when a candidate was asked for), and for ``auto`` in float64; else ``probe(name, device, dtype, shape)`` -> ``HeadTrial``
    (``trial``; injected in tests) of each kernel in question: ``auto``: hpctrain's and every candidate, the
    fastest that passed wins; a candidate: it when it passes, else hpctrain's with a note. ``gather``: an
    allgather of Python objects over the ranks that must choose alike, or None; ``probe_here``: False on a
    rank without the last stage (it tries nothing and takes the others' results)."""
    why = ("on the host" if torch.device(device).type != "cuda" else
           f"under tp={tp_size} (it has no vocab-parallel form)" if tp_size > 1 else
           "with model.fused_head_loss=false" if not fused_head_loss else "")
    if setting == OWN or why or (setting == "auto" and dtype == torch.float64):  # the libraries: float32 at best
        note = (f"model.head_kernel={setting} is not used {why}: the head runs hpctrain's own"
                if setting in CANDIDATES else "")
        return HeadKernelChoice(note=note)
    names = (OWN, *CANDIDATES) if setting == "auto" else (setting,)
    trials = {name: probe(name, device, dtype, shape) if probe_here else HeadTrial(0.0) for name in names}
    mine = [(t.ms, t.reason, t.missing) for t in trials.values()]
    every = gather(mine) if gather is not None else [mine]
    ms: dict[str, float] = {}
    reasons: dict[str, tuple[str, bool]] = {}
    for i, name in enumerate(names):
        results = [rank[i] for rank in every]
        times = [float(r[0]) for r in results if r[0] is not None]
        if len(times) == len(results):
            ms[name] = max(times)
        else:  # this rank's reason first, else the first rank's that has one
            reason, missing = next(((r[1], r[2]) for r in [mine[i], *results] if r[0] is None and r[1]),
                                   ("passed here, not on every rank", False))
            reasons[name] = (reason, missing)
    pick = min(ms, key=lambda name: ms[name]) if ms and (setting == "auto" or setting in ms) else OWN
    failed = [f"{name} cannot run: {reason}" for name, (reason, missing) in reasons.items()
              if name != pick and not (missing and setting == "auto")]
    note = f"head kernel {'; '.join(failed)}; the head runs {_named(pick)}" if failed else ""
    timings = ", ".join(f"{name} {ms[name]:.3f} ms" if name in ms else
                        f"{name} - (not installed)" if reasons[name][1] else f"{name} -" for name in names)
    return HeadKernelChoice(pick, trials[pick].fn if pick in trials else None, note, timings)


def _named(name: str) -> str:
    return "hpctrain's own" if name == OWN else name
