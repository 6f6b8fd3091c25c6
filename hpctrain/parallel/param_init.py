"""Initial values drawn where they live: a parameter's elements are a pure function of (seed, name, global
index), so a rank draws exactly the elements it keeps and every layout holds the same global tensor.

Every parameter carries an ``InitRule`` (``param.init``) beside its ``SlabSpec`` (``param.spec``,
hpctrain/parallel/slab.py). The generator is counter-based: SplitMix64 (Steele, Lea and Flood, OOPSLA 2014;
Java's SplittableRandom), whose n-th output of the stream keyed by k is ``mix64(k + (n + 1) * GAMMA)`` and
needs no earlier output. The key is (seed, crc32(name)); element i of a parameter takes output i:

- ``normal``: Box-Muller, ``std * sqrt(-2 ln u1) * cos(2 pi u2)`` in float64, with u1 and u2 in (0, 1) from
  the output's high and low 32 bits (so |value| < 6.8 std);
- ``uniform``: ``bound * (2 u - 1)``, u from the top 53 bits (LoRA's Kaiming-uniform A);
- ``ones`` / ``zeros``: no draw.

Vocabulary padding rows (``SlabSpec.padded_dim``) are zero. ``fill_`` writes any flat range [lo, hi) of a
rank's slab (a ZeRO-3 slice cuts through rows), in float64 chunks of ``CHUNK`` elements, so the memory it
takes beside its output is bounded and its time is proportional to the elements it writes.

``new_param`` makes a parameter under the current default device: on a real device it is filled at once;
under ``torch.device("meta")`` it has a shape and no storage, and ``FlatParams`` / ``FrozenSlices``
(hpctrain/parallel/data_parallel.py, zero/frozen_slices.py) or ``materialize_`` give it storage later
(``give_storage``) and fill only what this rank keeps.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hpctrain.errors import HpcTrainError, everywhere
from hpctrain.parallel.slab import SlabSpec

GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (the golden ratio)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
CHUNK = 1 << 20  # elements drawn at once (~40 MiB of float64 and uint64 temporaries)
MAX_ELEMENTS = 2**62  # global flat indices are int64 (and the stream's counters 64-bit): larger cannot be addressed
KINDS = ("normal", "uniform", "ones", "zeros")


@dataclass(frozen=True)
class InitRule:
    """How a parameter's global tensor starts: ``kind`` (one of ``KINDS``), ``scale`` (normal: the std;
    uniform: the bound), ``seed`` (``train.seed``)."""

    kind: str
    scale: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"init kind {self.kind!r} is not one of {KINDS}")

    @staticmethod
    def normal(std: float | None, seed: int) -> InitRule:
        """N(0, std); std None: ones (a norm's weight)."""
        return InitRule("ones") if std is None else InitRule("normal", float(std), seed)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function, in place on uint64 ``z`` (wrapping arithmetic)."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def stream_key(seed: int, name: str) -> np.uint64:
    """The key of parameter ``name``'s stream: (seed, crc32(name)) mixed into 64 bits."""
    z = np.array([(seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64], dtype=np.uint64)
    return _mix64(z)[0]


def _outputs(key: np.uint64, index: np.ndarray) -> np.ndarray:
    """uint64 [len(index)]: output ``index`` (int64 >= 0, overwritten) of stream ``key``, one per element."""
    z = index.view(np.uint64)  # in place: ``index`` is not read again (non-negative, so the same integers)
    z += np.uint64(1)
    z *= GAMMA
    z += key
    return _mix64(z)


def _unit(bits: np.ndarray, width: int) -> torch.Tensor:
    """float64 in (0, 1): (bits + 1/2) / 2**width, for integers ``bits`` below 2**width."""
    return torch.from_numpy(bits.astype(np.float64)).add_(0.5).mul_(2.0 ** -width)


def values_at(rule: InitRule, name: str, index: np.ndarray) -> torch.Tensor:
    """float64 [len(index)]: the initial values of global flat elements ``index`` (int64, consumed) of ``name``."""
    n = len(index)
    if rule.kind == "zeros":
        return torch.zeros(n, dtype=torch.float64)
    if rule.kind == "ones":
        return torch.ones(n, dtype=torch.float64)
    z = _outputs(stream_key(rule.seed, name), index)
    if rule.kind == "uniform":
        return _unit(z >> np.uint64(11), 53).mul_(2.0).sub_(1.0).mul_(rule.scale)
    radius = _unit(z >> np.uint64(32), 32).log_().mul_(-2.0).sqrt_()
    angle = _unit(z & np.uint64(0xFFFFFFFF), 32).mul_(2.0 * math.pi).cos_()
    return radius.mul_(angle).mul_(rule.scale)


def global_index(spec: SlabSpec, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """For elements [lo, hi) of this rank's flattened slab (``spec.local_shape``, C order): their global flat
    index (int64) and whether each is real (False: a vocabulary padding row, whose index is meaningless).

    The slab is runs of consecutive global elements: below the last dimension ``d`` that is cut (the tp
    split, or the experts' dim 0), each index of the dims before ``d`` is one run of ``local[d] x whole[d+1:]``
    elements; a run's global start comes from its coordinates in the dims before ``d`` plus the offsets."""
    local, whole = spec.local_shape, spec.global_shape
    offsets = [0] * len(whole)
    if spec.split_dim is not None:
        offsets[spec.split_dim] = spec.tp_rank * (spec.split_length // spec.tp_size)
    if spec.experts is not None:
        offsets[0] += spec.experts[0]
    cut = [dim for dim in range(len(whole)) if offsets[dim] or local[dim] != whole[dim]]
    positions = np.arange(lo, hi, dtype=np.int64)
    if not cut or hi <= lo:
        return positions, np.ones(hi - lo, dtype=bool)
    d = cut[-1]
    inner = math.prod(whole[d + 1:])
    run_length = local[d] * inner
    first_run, last_run = lo // run_length, (hi - 1) // run_length
    runs = np.arange(first_run, last_run + 1, dtype=np.int64)
    starts = np.zeros(len(runs), dtype=np.int64)  # each run's global start
    for c, size, off in zip(np.unravel_index(runs, local[:d]) if d else (), whole[:d], offsets[:d]):
        starts *= size
        starts += c + off
    starts *= whole[d] * inner
    starts += offsets[d] * inner
    # each run's elements in [lo, hi): global = local position + (its run's start - the run's local start)
    counts = np.full(len(runs), run_length, dtype=np.int64)
    counts[0] -= lo - first_run * run_length
    counts[-1] -= (last_run + 1) * run_length - hi
    index = positions + np.repeat(starts - runs * run_length, counts)
    if spec.padded_dim is None:
        return index, np.ones(hi - lo, dtype=bool)
    return index, (positions % run_length) // inner + offsets[d] < whole[d]


@torch.no_grad()
def fill_(dest: torch.Tensor, spec: SlabSpec, rule: InitRule, lo: int = 0) -> None:
    """Write elements [lo, lo + dest.numel()) of this rank's flattened slab of ``spec`` into ``dest``
    (contiguous, any device and dtype), drawn by ``rule``; padding rows 0. No communication."""
    flat = dest.view(-1)
    n = flat.numel()
    if rule.kind in ("zeros", "ones") and spec.padded_dim is None:
        flat.fill_(0.0 if rule.kind == "zeros" else 1.0)
        return
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        index, real = global_index(spec, lo + start, lo + stop)
        values = values_at(rule, spec.name, index)
        if not real.all():
            values[torch.from_numpy(~real)] = 0.0
        flat[start:stop].copy_(values)


def check_addressable(spec: SlabSpec) -> None:
    """Refuse, on every rank alike, a global tensor whose elements the counter-based stream cannot address."""
    n = math.prod(spec.global_shape)
    if n >= MAX_ELEMENTS:
        raise everywhere(HpcTrainError(
            f"{spec.name}: the global shape {tuple(spec.global_shape)} has {n} elements, which the counter-based "
            f"initialisation cannot be addressed beyond (2**62, the 64-bit global index); use a smaller model"))


def new_param(spec: SlabSpec, dtype: torch.dtype, rule: InitRule, requires_grad: bool = True) -> nn.Parameter:
    """A parameter of shape ``spec.local_shape`` on the current default device, carrying ``spec`` and ``rule``
    (``param.spec``, ``param.init``); filled now unless that device is meta (filled where it comes to live)."""
    check_addressable(spec)
    p = nn.Parameter(torch.empty(spec.local_shape, dtype=dtype), requires_grad=requires_grad)
    p.spec = spec  # type: ignore[attr-defined]  # the SlabSpec hpctrain attaches (parallel/slab.py)
    p.init = rule  # type: ignore[attr-defined]  # its InitRule
    if not p.is_meta:
        fill_(p.data, spec, rule)
    return p


def init_from_global_(param: torch.Tensor, spec: SlabSpec, seed: int, std: float | None) -> None:
    """Fill ``param`` (its whole slab) with N(0, std) (std None: ones) of the global tensor; padding rows 0."""
    fill_(param.data, spec, InitRule.normal(std, seed))


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` holds its elements (False: built on the meta device, or given storage-less by
    ``give_storage``, waiting to be filled)."""
    return not t.is_meta and t.untyped_storage().size() > 0


def give_storage(module: nn.Module, device: torch.device) -> None:
    """Replace, in place (``torch.utils.swap_tensors``: the same Parameter objects, so shared and tied ones
    stay shared), every meta parameter of ``module`` by one of the same shape on ``device`` whose storage is
    empty: what ``FlatParams`` / ``FrozenSlices`` point into their buffers and fill, or ``materialize_`` fills.
    Every attribute (``spec``, ``init``) is kept. Nothing is allocated for longer than one parameter."""
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) in seen or not p.is_meta:
            continue
        seen.add(id(p))
        real = torch.empty(p.shape, dtype=p.dtype, device=device)
        real.untyped_storage().resize_(0)
        new = nn.Parameter(real, requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, new)


@torch.no_grad()
def materialize_(params, device: torch.device) -> None:
    """Give each of ``params`` without storage its whole slab on ``device``, drawn from its rule (the
    parameters no flat buffer holds: a LoRA run's frozen base below ZeRO-3)."""
    for p in params:
        if not has_storage(p):
            p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
            fill_(p.data, p.spec, p.init)
