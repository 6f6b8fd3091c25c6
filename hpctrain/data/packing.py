"""Packed SFT samples: whole examples packed into sequences, with loss masks and document ids.

Packing (the same on every rank, from the example lengths alone): examples are taken in file order and
a sequence of ``seq_len + 1`` tokens is filled greedily until the next example does not fit; the rest
is padding (token 0, never counted). An example longer than ``seq_len + 1`` tokens is refused with its
"FILE:LINE". A sequence is one slab of the token array (its examples are consecutive).

Sample ``i`` is sequence ``perm_e[i mod n]`` of epoch ``e = i // n`` (n sequences; ``perm_e`` a
permutation keyed by (seed, epoch): every sequence once per epoch, in a new order each epoch). Like
``SequenceSampler``, a sample depends only on (seed, i), so the global batch sequence is the same for
every dp layout and resumes from ``consumed``.

A batch is (inputs, targets, loss_mask, docs), each [B, seq_len]: ``loss_mask`` (bool) marks the
targets the loss counts, ``docs`` (int64) numbers the examples of each row 0, 1, ... (non-decreasing;
the padding is one more document), from which attention builds its block-diagonal causal mask and
per-document positions (hpctrain/parallel/packed.py). ``counted(start, count)``: the counted targets of
samples start..start+count-1, from per-sequence counts, so every rank knows the global batch's count
without communication.
"""
from __future__ import annotations

import numpy as np
import torch

from hpctrain.data.documents import DataError
from hpctrain.data.prepared import PreparedCorpus
from hpctrain.data.sampler import SamplerError, SequenceSampler, sample_hashes, validation_split
from hpctrain.data.sft import FORMAT
from hpctrain.errors import everywhere

PAD_TOKEN = 0


class SFTCorpus(PreparedCorpus):
    """A lazily read SFT corpus (hpctrain/data/sft.py): tokens, loss mask and the per-example tables."""

    FORMAT = FORMAT

    def __init__(self, path: str):
        super().__init__(path)
        self._mask = self._file["loss_mask"]
        self.doc_counted = self._file["doc_counted"][()]
        self.doc_names = [n.decode() if isinstance(n, bytes) else str(n) for n in self._file["doc_names"][()]]
        self.template = str(self._file.attrs["template"])

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss mask) of positions lo..hi-1."""
        self.tokens_read += hi - lo
        return self._tokens[lo:hi], self._mask[lo:hi]


def is_sft(path: str) -> bool:
    return SFTCorpus.has_format(path)


def pack_documents(lengths: np.ndarray, width: int, names: list[str]) -> np.ndarray:
    """Greedy in-order packing -> int64 boundaries (n_seq + 1,): sequence s holds documents
    bounds[s]..bounds[s + 1]-1, at most ``width`` tokens in all. SamplerError if one is longer."""
    too_long = np.flatnonzero(lengths > width)
    if len(too_long):
        d = int(too_long[0])
        raise everywhere(SamplerError(
            f"SFT example {names[d]} has {int(lengths[d])} tokens, more than train.seq_len + 1 = {width} "
            f"({len(too_long)} example(s) too long): raise train.seq_len or shorten them"))
    bounds, used = [0], 0
    for d, n in enumerate(lengths.tolist()):
        if used + n > width:
            bounds.append(d)
            used = 0
        used += n
    bounds.append(len(lengths))
    return np.array(bounds, dtype=np.int64)


class PackedSampler:
    """Packed sequences of documents ``first_doc..last_doc-1`` of an SFTCorpus (module docstring)."""

    def __init__(self, corpus: SFTCorpus, seq_len: int, seed: int, first_doc: int = 0, last_doc: int | None = None):
        self.corpus, self.seq_len, self.seed = corpus, int(seq_len), int(seed)
        last_doc = len(corpus.doc_offsets) - 1 if last_doc is None else last_doc
        offsets = np.asarray(corpus.doc_offsets[first_doc:last_doc + 1], dtype=np.int64)
        if len(offsets) < 2:
            raise everywhere(SamplerError(f"SFT corpus {corpus.path!r}: no examples to sample from"))
        bounds = pack_documents(np.diff(offsets), self.seq_len + 1, corpus.doc_names[first_doc:last_doc])
        self.doc_offsets = offsets  # of this sampler's documents, global token positions
        self.bounds = bounds  # sequence s: documents bounds[s]..bounds[s+1]-1 (local to this sampler)
        counted = np.asarray(corpus.doc_counted[first_doc:last_doc], dtype=np.int64)
        self.sequence_counted = np.add.reduceat(counted, bounds[:-1])
        self.num_sequences = len(bounds) - 1
        self._perms: dict[int, np.ndarray] = {}

    def describe(self) -> str:
        """One line for the run's start: examples, sequences, how full they are, counted tokens."""
        docs, tokens = len(self.doc_offsets) - 1, int(self.doc_offsets[-1] - self.doc_offsets[0])
        return (f"SFT data: {docs} examples packed into {self.num_sequences} sequences of {self.seq_len + 1} tokens "
                f"({tokens / (self.num_sequences * (self.seq_len + 1)):.0%} filled), "
                f"{int(self.sequence_counted.sum())} tokens counted in the loss per epoch")

    def sequences(self, start: int, count: int) -> np.ndarray:
        """int64 sequence index (count,) of samples start..start+count-1."""
        if start < 0 or count < 0:
            raise ValueError(f"sample range must have start >= 0 and count >= 0, got start={start}, count={count}")
        n = self.num_sequences
        indices = np.arange(start, start + count, dtype=np.int64)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(indices // n):
            where = indices // n == epoch
            out[where] = self._permutation(int(epoch))[indices[where] % n]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = self.num_sequences
            keys = sample_hashes(self.seed, np.arange(epoch * n, (epoch + 1) * n, dtype=np.uint64))
            if len(self._perms) > 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.argsort(keys, kind="stable")
        return self._perms[epoch]

    def counted(self, start: int, count: int) -> int:
        """Counted (loss) targets of samples start..start+count-1."""
        return int(self.sequence_counted[self.sequences(start, count)].sum())

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, ...]:
        """Samples start..start+count-1 as (inputs, targets, loss_mask, docs), each (count, seq_len)."""
        width = self.seq_len + 1
        tokens = np.full((count, width), PAD_TOKEN, dtype=np.int64)
        mask = np.zeros((count, width), dtype=bool)
        docs = np.empty((count, width), dtype=np.int64)
        for row, s in enumerate(self.sequences(start, count)):
            first, last = self.bounds[s], self.bounds[s + 1]
            lo, hi = int(self.doc_offsets[first]), int(self.doc_offsets[last])
            tokens[row, :hi - lo], mask[row, :hi - lo] = self.corpus.read(lo, hi)
            lengths = np.diff(self.doc_offsets[first:last + 1])
            docs[row, :hi - lo] = np.repeat(np.arange(last - first), lengths)
            docs[row, hi - lo:] = last - first  # the padding: one more document
        tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        return tensor(tokens[:, :-1]), tensor(tokens[:, 1:]), tensor(mask[:, 1:]), tensor(docs[:, :-1])


def sft_split(corpus: SFTCorpus, fraction: float) -> int:
    """The first validation example: the last ``fraction`` of the examples (at least one each) are held
    out; 0 -> all examples train."""
    n = len(corpus.doc_offsets) - 1
    if fraction <= 0:
        return n
    held = max(1, int(round(fraction * n)))
    if held >= n:
        raise everywhere(DataError(f"data.valid_fraction={fraction} of {n} SFT examples leaves none to train on"))
    return n - held


def samplers_for(tokens, valid_fraction: float, seq_len: int, seed: int) -> tuple:
    """(training sampler, validation sampler or None) of a corpus: packed examples of an SFT corpus (its last
    ``valid_fraction`` of the examples held out), else windows (``SequenceSampler``, ``validation_split``);
    validation draws with ``seed + 1``."""
    if isinstance(tokens, SFTCorpus):
        split = sft_split(tokens, valid_fraction)
        held_out = split < len(tokens.doc_offsets) - 1
        return (PackedSampler(tokens, seq_len, seed, last_doc=split),
                PackedSampler(tokens, seq_len, seed + 1, first_doc=split) if held_out else None)
    split = validation_split(tokens, valid_fraction, seq_len)
    return (SequenceSampler(tokens, seq_len, seed, hi=split),
            None if split == len(tokens) else SequenceSampler(tokens, seq_len, seed + 1, lo=split))
