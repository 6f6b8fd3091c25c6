"""Deterministic, data-parallel-invariant sequence sampling.

Global sample ``i`` is the window of ``seq_len + 1`` tokens starting at an offset
that depends only on ``(seed, i)`` (a splitmix64 hash). A global batch of step
``s`` is samples ``consumed .. consumed + global_batch - 1``; each dp rank reads a
contiguous slice of it. So the global batch sequence is the same for any dp size,
and a run can resume with another dp size from the stored ``consumed`` count.
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.errors import HpcTrainError, everywhere


class SamplerError(HpcTrainError, ValueError):
    """The corpus or a saved sampler state does not fit this run (a user error: exit 2)."""

_UINT64_MASK = (1 << 64) - 1
_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = values + _GOLDEN_GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX_MUL_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_MUL_2
        return z ^ (z >> np.uint64(31))


def sample_hashes(seed: int, indices: np.ndarray) -> np.ndarray:
    """uint64 hash of each (seed, index) pair; depends on nothing else."""
    seed_key = _splitmix64(np.array([int(seed) & _UINT64_MASK], dtype=np.uint64))
    with np.errstate(over="ignore"):
        return _splitmix64(seed_key ^ _splitmix64(indices.astype(np.uint64)))


class SequenceSampler:
    """Windows of ``seq_len + 1`` tokens at offsets keyed by (seed, global sample index).

    tokens: 1-D integer array (may be memory-mapped, or a lazily read PreparedCorpus); windows lie in
    ``tokens[lo:hi]`` (default: all), which must hold more than seq_len + 1 tokens.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, lo: int = 0, hi: int | None = None):
        if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        if not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an int, got {seed!r}")
        tokens = tokens if hasattr(tokens, "dtype") else np.asarray(tokens)  # arrays, memmaps, PreparedCorpus
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a 1-D integer array, got dtype {tokens.dtype} "
                             f"shape {tokens.shape}")
        self.lo, self.hi = int(lo), len(tokens) if hi is None else int(hi)
        if self.hi - self.lo <= seq_len + 1:
            raise everywhere(SamplerError(f"corpus too short: {self.hi - self.lo} tokens, need more than "
                             f"seq_len + 1 = {seq_len + 1} (use a bigger corpus or a smaller seq_len)"))
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_windows = self.hi - self.lo - self.seq_len  # valid start offsets lo..lo+num_windows-1

    def offsets(self, start: int, count: int) -> np.ndarray:
        """int64 start offsets (count,) of samples start..start+count-1."""
        if start < 0 or count < 0:
            raise ValueError(f"sample range must have start >= 0 and count >= 0, "
                             f"got start={start}, count={count}")
        indices = np.arange(start, start + count, dtype=np.uint64)
        hashes = sample_hashes(self.seed, indices)
        return (hashes % np.uint64(self.num_windows)).astype(np.int64) + self.lo

    def windows(self, start: int, count: int) -> np.ndarray:
        """int64 windows (count, seq_len + 1) of samples start..start+count-1."""
        offsets = self.offsets(start, count)
        positions = offsets[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)[None, :]
        return np.asarray(self.tokens[positions], dtype=np.int64)

    def counted(self, start: int, count: int) -> int:
        """Tokens the loss counts in samples start..start+count-1: every target (a packed SFT sampler,
        hpctrain/data/packing.py, counts its response tokens only)."""
        return int(count) * self.seq_len

    def sample(self, i: int) -> np.ndarray:
        """int64 window (seq_len + 1,) of global sample i (>= 0)."""
        if i < 0:
            raise ValueError(f"sample index must be >= 0, got {i}")
        return self.windows(int(i), 1)[0]

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples start..start+count-1 as (inputs, targets), both LongTensor (count, seq_len).

        targets[:, t] == inputs[:, t + 1] for t < seq_len - 1 (next-token targets).
        """
        windows = self.windows(int(start), int(count))
        inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
        return inputs, targets


def validation_split(tokens, fraction: float, seq_len: int) -> int:
    """The token index where the held-out validation part (the last ``fraction`` of the corpus) begins:
    at the document boundary nearest to it when the corpus records documents (a prepared corpus's
    ``doc_offsets``), else at that position. Both parts must hold a window. 0 -> len(tokens)."""
    n = len(tokens)
    if fraction <= 0:
        return n
    target = int(round((1 - fraction) * n))
    offsets = getattr(tokens, "doc_offsets", None)
    if offsets is not None and len(offsets) > 2:
        inner = np.asarray(offsets[1:-1], dtype=np.int64)
        target = int(inner[np.argmin(np.abs(inner - target))])
    if min(target, n - target) <= seq_len + 1:
        raise everywhere(SamplerError(f"data.valid_fraction={fraction} splits the corpus of {n} tokens at {target}: "
                                      f"each part needs more than seq_len + 1 = {seq_len + 1} tokens"))
    return target


def rank_slice(global_batch: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """(start_offset, count) of the contiguous part of a global batch that dp_rank reads."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if global_batch % dp_size != 0:
        raise ValueError(f"global_batch {global_batch} is not divisible by dp_size {dp_size}; "
                         "choose a global batch that is a multiple of the data-parallel size")
    per_rank = global_batch // dp_size
    return dp_rank * per_rank, per_rank


class GlobalBatchIterator:
    """Per-dp-rank view of the global batch sequence of a SequenceSampler.

    ``consumed`` is the global index of the next step's first sample; it is what a
    checkpoint stores, and it is independent of dp size.
    """

    def __init__(self, sampler: SequenceSampler, global_batch: int, dp_size: int,
                 dp_rank: int, start_sample: int = 0):
        self.rank_offset, self.rank_count = rank_slice(global_batch, dp_size, dp_rank)
        if start_sample < 0:
            raise ValueError(f"start_sample must be >= 0, got {start_sample}")
        self.sampler = sampler
        self.global_batch = int(global_batch)
        self.dp_size = int(dp_size)
        self.dp_rank = int(dp_rank)
        self.consumed = int(start_sample)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the current step, each (global_batch // dp_size, seq_len)."""
        batch = self.sampler.batch(self.consumed + self.rank_offset, self.rank_count)
        self.consumed += self.global_batch
        return batch

    def __iter__(self) -> "GlobalBatchIterator":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict:
        """``{"consumed": int, "seed": int, "seq_len": int}``."""
        return {"consumed": self.consumed, "seed": self.sampler.seed,
                "seq_len": self.sampler.seq_len}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["consumed"]``; seed and seq_len must match this sampler's."""
        self.check_state_dict(state)
        self.consumed = int(state["consumed"])

    def check_state_dict(self, state: dict) -> None:
        """Raise SamplerError if ``state`` cannot resume this sampler (missing keys, another seed or
        seq_len, a negative position); changes nothing."""
        missing = [k for k in ("consumed", "seed", "seq_len") if k not in state]
        if missing:
            raise SamplerError(f"data sampler state is missing keys {missing}")
        if int(state["seed"]) != self.sampler.seed:
            raise SamplerError(f"data sampler seed mismatch: checkpoint has seed={int(state['seed'])}, "
                             f"this run uses seed={self.sampler.seed}")
        if int(state["seq_len"]) != self.sampler.seq_len:
            raise SamplerError(f"data sampler seq_len mismatch: checkpoint has "
                             f"seq_len={int(state['seq_len'])}, this run uses "
                             f"seq_len={self.sampler.seq_len}")
        if int(state["consumed"]) < 0:
            raise SamplerError(f"data sampler state has consumed={state['consumed']}, must be >= 0")
