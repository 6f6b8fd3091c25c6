"""Which kernel ``F.scaled_dot_product_attention`` runs: flash / memory-efficient on CUDA, checked once.

    choice = choose_sdpa(device, dtype, head_dim, masked=window > 0 or packed)  # trial calls on CUDA
    use_sdpa(model, choice)            # every Attention module (``sdpa_choice``) calls SDPA under it
    out = attention(q, k, v, choice)   # [B, H, S, hd]; causal, or with ``attn_mask`` [.., S, S] bool

On CUDA the fast kernels (``FLASH_ATTENTION``, ``EFFICIENT_ATTENTION``) are tried once at start-up with a
forward and backward call of the model's dtype and head size, causal, and when the model uses masks
(a sliding window, packed documents: flash takes no ``attn_mask``) with a boolean mask too. Calls then
run under ``sdpa_kernel`` with the kernels that passed, so a later call that cannot use them fails loudly
instead of silently taking the slow path; when none passed, the math kernel with ONE warning naming why
(``SdpaChoice.warning``; the trainer prints it on rank 0). On the host nothing is restricted: torch's own
choice, reported as "math/cpu". Ring attention (cp > 1, long sliding windows) does not call SDPA.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FAST = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)  # tried in this order
NAMES = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}
TRIAL_SEQ = 128  # tokens of the trial call when the caller gives none
MAX_TRIAL_SEQ = 8192  # longer sequences are tried at this length (the mask trial's [S, S] bool stays 64 MiB)


@dataclass(frozen=True)
class SdpaChoice:
    """The SDPA kernels allowed for causal calls and for calls with an ``attn_mask`` (() = torch's own
    choice, unrestricted); ``name`` for the start-up line; ``warning``: why the fast kernels are not used
    ("" when they are)."""

    causal: tuple = ()
    masked: tuple = ()
    name: str = "math/cpu"
    warning: str = ""


HOST = SdpaChoice()


def attention(q, k, v, choice: SdpaChoice, attn_mask=None):
    """SDPA of q, k, v [B, H, S, hd] under ``choice``: causal when ``attn_mask`` is None, else masked by it
    (bool, True = attend). No communication."""
    backends = choice.causal if attn_mask is None else choice.masked
    if not backends:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
    with sdpa_kernel(list(backends)):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)


def trial(backend, device, dtype, head_dim: int, masked: bool, seq: int = TRIAL_SEQ) -> str:
    """"" when ``backend`` runs a forward and backward of [1, 2, seq, head_dim] ``dtype`` on ``device``
    (causal, or with a causal boolean ``attn_mask`` when ``masked``), else why not (torch's reasons)."""
    seq = min(seq, MAX_TRIAL_SEQ)
    shape = (1, 2, seq, head_dim)
    q, k, v = (torch.full(shape, 0.5, device=device, dtype=dtype, requires_grad=True) for _ in range(3))  # no RNG
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril() if masked else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
            out.float().sum().backward()
            return ""
        except RuntimeError as exc:
            reasons = [str(w.message).strip().splitlines()[0] for w in caught] or [str(exc).splitlines()[0]]
            return " ".join(dict.fromkeys(r for r in reasons if r))[:300]


def _allowed(device, dtype, head_dim: int, masked: bool, probe, seq: int) -> tuple[tuple, list[str]]:
    """The FAST kernels that pass ``probe`` (in order), and the reasons of those that do not."""
    ok, why = [], []
    for backend in FAST:
        reason = probe(backend, device, dtype, head_dim, masked, seq)
        if reason:
            why.append(f"{NAMES[backend]}: {reason}")
        else:
            ok.append(backend)
    return tuple(ok), why


def choose_sdpa(device, dtype, head_dim: int, masked: bool = False, probe=trial, seq: int = TRIAL_SEQ) -> SdpaChoice:
    """The kernels for a model of ``dtype`` and ``head_dim`` on ``device`` with sequences of ``seq`` tokens
    (``masked``: it also calls SDPA with an ``attn_mask``). ``probe(backend, device, dtype, head_dim, masked,
    seq)`` -> "" or the reason a kernel cannot run (``trial``; injected in tests). Host devices: ``HOST``, no
    probe."""
    if torch.device(device).type != "cuda":
        return HOST
    causal, why = _allowed(device, dtype, head_dim, False, probe, seq)
    masked_ok, masked_why = _allowed(device, dtype, head_dim, True, probe, seq) if masked else ((), [])
    if probe is trial:
        torch.cuda.reset_peak_memory_stats(device)  # the run's peak-memory report leaves the trials out
    name = NAMES[causal[0]] if causal else "math"
    problems = []
    if not causal:
        causal = (SDPBackend.MATH,)
        problems.append(f"causal attention ({'; '.join(why)})")
    if masked:
        if not masked_ok:
            masked_ok = (SDPBackend.MATH,)
            problems.append(f"masked attention (sliding window / packed documents: {'; '.join(masked_why)})")
        name += f" (masked: {NAMES[masked_ok[0]]})"
    dtype_name = str(dtype).removeprefix("torch.")
    warning = (f"SDPA falls back to the math kernel for {' and '.join(problems)} with {dtype_name}, head_dim "
               f"{head_dim}: slower and O(S^2) memory" if problems else "")
    return SdpaChoice(causal, tuple(masked_ok), name, warning)


def use_sdpa(model: torch.nn.Module, choice: SdpaChoice) -> SdpaChoice:
    """Set ``choice`` on every submodule of ``model`` that calls SDPA (has ``sdpa_choice``); returns it."""
    for module in model.modules():
        if hasattr(module, "sdpa_choice"):
            module.sdpa_choice = choice
    return choice
