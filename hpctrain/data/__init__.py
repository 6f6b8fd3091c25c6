"""Training data: token corpora and a deterministic, dp-invariant sampler.

Typical use::

    tokens = load_tokens_collective(mpi_comm, "builtin")      # (N,) uint16
    sampler = SequenceSampler(tokens, seq_len=256, seed=1234)
    batches = GlobalBatchIterator(sampler, global_batch=64, dp_size=dp, dp_rank=r)
    inputs, targets = batches.next_batch()                   # (64 // dp, 256) int64 each
"""

from hpctrain.data.corpus import (
    BYTE_VOCAB_SIZE,
    DataError,
    default_cache_dir,
    infer_vocab_size,
    load_tokens,
    load_tokens_collective,
)
from hpctrain.data.sampler import GlobalBatchIterator, SequenceSampler, rank_slice

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DataError",
    "GlobalBatchIterator",
    "SequenceSampler",
    "default_cache_dir",
    "infer_vocab_size",
    "load_tokens",
    "load_tokens_collective",
    "rank_slice",
]
