"""Fast single-process tests of hpctrain.data (corpora and the deterministic sampler)."""

import os

import h5py
import numpy as np
import pytest
import torch

from hpctrain.data import (
    DataError,
    GlobalBatchIterator,
    SequenceSampler,
    infer_vocab_size,
    load_tokens,
    load_tokens_collective,
    rank_slice,
)
from hpctrain.data import corpus

BUILTIN_MAX_BYTES = 2_000_000


@pytest.fixture
def tokens():
    return np.arange(10_000, dtype=np.uint16) % 256


# ---------------------------------------------------------------- sampler

def test_same_seed_and_index_give_same_window_across_instances(tokens):
    first, second = SequenceSampler(tokens, 32, seed=7), SequenceSampler(tokens.copy(), 32, seed=7)
    for i in (0, 1, 5, 12345, 2**40):
        assert np.array_equal(first.sample(i), second.sample(i))
    # batch and sample agree, whatever order samples are drawn in
    inputs, targets = first.batch(100, 4)
    for row in range(4):
        window = second.sample(100 + row)
        assert torch.equal(inputs[row], torch.from_numpy(window[:-1]))
        assert torch.equal(targets[row], torch.from_numpy(window[1:]))


def test_sample_shape_dtype_and_window_contents(tokens):
    sampler = SequenceSampler(tokens, 16, seed=0)
    window = sampler.sample(3)
    assert window.shape == (17,) and window.dtype == np.int64
    offset = int(sampler.offsets(3, 1)[0])
    assert np.array_equal(window, tokens[offset:offset + 17].astype(np.int64))


def test_different_seeds_give_different_samples(tokens):
    a, b = SequenceSampler(tokens, 32, seed=1), SequenceSampler(tokens, 32, seed=2)
    assert not np.array_equal(a.offsets(0, 64), b.offsets(0, 64))


def test_offsets_cover_the_whole_corpus():
    short = np.arange(40, dtype=np.uint16)
    sampler = SequenceSampler(short, 8, seed=3)
    offsets = sampler.offsets(0, 5000)
    assert offsets.min() == 0 and offsets.max() == len(short) - 9
    assert len(np.unique(offsets)) == len(short) - 8


def test_batch_shapes_and_shifted_targets(tokens):
    inputs, targets = SequenceSampler(tokens, 24, seed=5).batch(10, 6)
    assert inputs.shape == targets.shape == (6, 24)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_rank_slice_contiguous_and_errors():
    assert [rank_slice(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert rank_slice(8, 1, 0) == (0, 8)
    with pytest.raises(ValueError, match="not divisible by dp_size 3"):
        rank_slice(8, 3, 0)
    with pytest.raises(ValueError, match="dp_rank"):
        rank_slice(8, 4, 4)
    with pytest.raises(ValueError, match="dp_size"):
        rank_slice(8, 0, 0)


def _global_batches(sampler, global_batch, dp_size, steps, start_sample=0):
    """Per step, the global batch assembled from every dp rank's slice."""
    iterators = [GlobalBatchIterator(sampler, global_batch, dp_size, r, start_sample)
                 for r in range(dp_size)]
    steps_out = []
    for _ in range(steps):
        parts = [it.next_batch() for it in iterators]
        steps_out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    assert all(it.consumed == start_sample + steps * global_batch for it in iterators)
    return steps_out


def test_global_batch_is_invariant_to_dp_size(tokens):
    sampler = SequenceSampler(tokens, 16, seed=11)
    reference = _global_batches(sampler, 8, 1, steps=3)
    for dp_size in (2, 4):
        for ref, got in zip(reference, _global_batches(sampler, 8, dp_size, steps=3)):
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert not torch.equal(reference[0][0], reference[1][0])


def test_restart_from_state_dict_continues_identically(tokens):
    sampler = SequenceSampler(tokens, 16, seed=21)
    uninterrupted = GlobalBatchIterator(sampler, 8, 2, 1)
    expected = [uninterrupted.next_batch() for _ in range(5)]

    first_run = GlobalBatchIterator(sampler, 8, 2, 1)
    for _ in range(3):
        first_run.next_batch()
    state = first_run.state_dict()
    assert state == {"consumed": 24, "seed": 21, "seq_len": 16}

    resumed = GlobalBatchIterator(SequenceSampler(tokens, 16, seed=21), 8, 2, 1)
    resumed.load_state_dict(state)
    for want in expected[3:]:
        got = resumed.next_batch()
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_restart_with_another_dp_size_continues_on_same_samples(tokens):
    sampler = SequenceSampler(tokens, 16, seed=4)
    reference = _global_batches(sampler, 8, 1, steps=4)
    resumed = _global_batches(sampler, 8, 4, steps=2, start_sample=16)
    for ref, got in zip(reference[2:], resumed):
        assert torch.equal(ref[0], got[0])


def test_load_state_dict_rejects_mismatched_seed_or_seq_len(tokens):
    iterator = GlobalBatchIterator(SequenceSampler(tokens, 16, seed=1), 4, 1, 0)
    with pytest.raises(ValueError, match=r"seed=2.*seed=1"):
        iterator.load_state_dict({"consumed": 4, "seed": 2, "seq_len": 16})
    with pytest.raises(ValueError, match=r"seq_len=32.*seq_len=16"):
        iterator.load_state_dict({"consumed": 4, "seed": 1, "seq_len": 32})
    assert iterator.consumed == 0


def test_sampler_rejects_too_short_corpus_and_bad_args():
    with pytest.raises(ValueError, match="corpus too short"):
        SequenceSampler(np.arange(17, dtype=np.uint16), 16, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        SequenceSampler(np.arange(100, dtype=np.uint16), 0, seed=0)
    with pytest.raises(ValueError, match="1-D integer"):
        SequenceSampler(np.zeros(100, dtype=np.float32), 8, seed=0)
    with pytest.raises(ValueError, match=">= 0"):
        SequenceSampler(np.arange(100, dtype=np.uint16), 8, seed=0).sample(-1)


# ---------------------------------------------------------------- builtin corpus

def test_builtin_corpus_loads_and_is_cached(tmp_path):
    tokens = load_tokens("builtin", cache_dir=str(tmp_path), max_bytes=BUILTIN_MAX_BYTES)
    assert tokens.ndim == 1 and tokens.dtype == np.uint16
    assert len(tokens) == BUILTIN_MAX_BYTES and int(tokens.max()) < 256
    assert infer_vocab_size(tokens) == 256
    assert b"def " in tokens[:100_000].astype(np.uint8).tobytes()
    cached = [p for p in os.listdir(tmp_path) if p.endswith(".npy")]
    assert len(cached) == 1 and cached[0].startswith("builtin-")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]

    again = load_tokens("builtin", cache_dir=str(tmp_path), max_bytes=BUILTIN_MAX_BYTES)
    assert np.array_equal(tokens, again)
    # a second load reads the cache, not the stdlib: a marked cache file comes back as is
    cache = corpus.builtin_cache_path(str(tmp_path), corpus.builtin_source_files(), BUILTIN_MAX_BYTES)
    assert os.path.basename(cache) == cached[0]
    marked = np.full(BUILTIN_MAX_BYTES, 7, dtype=np.uint16)
    np.save(cache, marked)
    assert np.array_equal(load_tokens("builtin", cache_dir=str(tmp_path), max_bytes=BUILTIN_MAX_BYTES), marked)


def test_builtin_cache_key_and_corrupt_cache_rebuild(tmp_path):
    load_tokens("builtin", cache_dir=str(tmp_path), max_bytes=1000)
    load_tokens("builtin", cache_dir=str(tmp_path), max_bytes=2000)
    paths = sorted(tmp_path.glob("builtin-*.npy"))
    assert len(paths) == 2
    small = corpus.builtin_cache_path(str(tmp_path), corpus.builtin_source_files(), 1000)
    with open(small, "wb") as handle:
        handle.write(b"garbage")
    rebuilt = load_tokens("builtin", cache_dir=str(tmp_path), max_bytes=1000)
    assert len(rebuilt) == 1000 and np.array_equal(np.load(small), rebuilt)


def test_builtin_sources_skip_tests_and_site_packages():
    files = corpus.builtin_source_files()
    assert files == sorted(files) and files
    for path in files:
        parts = set(path.split(os.sep))
        assert not parts & {"site-packages", "test", "tests", "idlelib"}


def test_builtin_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_CACHE", str(tmp_path / "env_cache"))
    load_tokens("builtin", max_bytes=500)
    assert list((tmp_path / "env_cache").glob("builtin-*.npy"))


# ---------------------------------------------------------------- file sources

def test_text_file_source(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes("hello wörld".encode())
    tokens = load_tokens(str(path))
    assert tokens.dtype == np.uint16
    assert tokens.astype(np.uint8).tobytes() == "hello wörld".encode()
    assert len(load_tokens(str(path), max_bytes=5)) == 5


def test_folder_source_sorted_recursive_skipping_binary(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_bytes(b"third")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    tokens = load_tokens(str(tmp_path))
    assert tokens.astype(np.uint8).tobytes() == b"first\n\nsecond\n\nthird"


def test_npy_source(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.array([1, 2, 300, 4], dtype=np.int64))
    tokens = load_tokens(str(path))
    assert tokens.dtype == np.uint16 and tokens.tolist() == [1, 2, 300, 4]
    assert infer_vocab_size(tokens) == 301
    big = tmp_path / "big.npy"
    np.save(big, np.array([70_000, 1], dtype=np.uint32))
    assert load_tokens(str(big)).tolist() == [70_000, 1]


def test_h5_source(tmp_path):
    path = tmp_path / "tokens.h5"
    with h5py.File(path, "w") as handle:
        handle["tokens"] = np.arange(50, dtype=np.int32)
    tokens = load_tokens(str(path), max_bytes=10)
    assert tokens.dtype == np.uint16 and tokens.tolist() == list(range(10))


# ---------------------------------------------------------------- errors

def test_missing_path_raises(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokens(str(tmp_path / "nope.txt"))


def test_empty_sources_raise(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_tokens(str(tmp_path / "empty.txt"))
    (tmp_path / "void").mkdir()
    with pytest.raises(DataError, match="no text files"):
        load_tokens(str(tmp_path / "void"))
    np.save(tmp_path / "empty.npy", np.array([], dtype=np.int64))
    with pytest.raises(DataError, match="empty"):
        load_tokens(str(tmp_path / "empty.npy"))


def test_binary_text_file_raises(tmp_path):
    (tmp_path / "blob.dat").write_bytes(b"ab\x00cd")
    with pytest.raises(DataError, match="binary"):
        load_tokens(str(tmp_path / "blob.dat"))


@pytest.mark.parametrize("array, problem", [
    (np.zeros(8, dtype=np.float32), "integer dtype"),
    (np.zeros((2, 4), dtype=np.int64), "1-D"),
    (np.array([1, -2, 3], dtype=np.int64), ">= 0"),
])
def test_bad_npy_arrays_raise(tmp_path, array, problem):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(DataError, match=problem) as info:
        load_tokens(str(path))
    assert str(path) in str(info.value)


def test_h5_errors(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as handle:
        handle["ids"] = np.arange(4)
        handle["group/more"] = np.arange(4)
    with pytest.raises(DataError, match=r"no 'tokens' dataset.*'group/more', 'ids'"):
        load_tokens(str(path))
    flat = tmp_path / "flat.h5"
    with h5py.File(flat, "w") as handle:
        handle["tokens"] = np.zeros((2, 2), dtype=np.int32)
    with pytest.raises(DataError, match="1-D"):
        load_tokens(str(flat))
    with h5py.File(tmp_path / "floats.h5", "w") as handle:
        handle["tokens"] = np.zeros(4, dtype=np.float64)
    with pytest.raises(DataError, match="integer dtype"):
        load_tokens(str(tmp_path / "floats.h5"))


# ---------------------------------------------------------------- collective loading

class FakeComm:
    """Stand-in for an mpi4py communicator: a fixed rank; bcast returns rank 0's payload."""

    def __init__(self, rank, root_payload=None):
        self.rank, self.root_payload, self.sent = rank, root_payload, []

    def Get_rank(self):
        return self.rank

    def bcast(self, obj, root=0):
        assert root == 0
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        return self.root_payload


def test_collective_load_rank0_then_others_read_cache(tmp_path):
    root = FakeComm(0)
    root_tokens = load_tokens_collective(root, "builtin", str(tmp_path), max_bytes=5000)
    other = FakeComm(1, root_payload=root.sent[0])
    other_tokens = load_tokens_collective(other, "builtin", str(tmp_path), max_bytes=5000)
    assert isinstance(other_tokens, np.memmap)
    assert np.array_equal(root_tokens, other_tokens)
    single = load_tokens_collective(None, "builtin", str(tmp_path), max_bytes=5000)
    assert np.array_equal(root_tokens, single)


def test_collective_error_on_rank0_raises_same_message_everywhere(tmp_path):
    missing = str(tmp_path / "missing.txt")
    root = FakeComm(0)
    with pytest.raises(DataError) as root_error:
        load_tokens_collective(root, missing)
    other = FakeComm(1, root_payload=root.sent[0])
    with pytest.raises(DataError) as other_error:
        load_tokens_collective(other, missing)
    assert str(root_error.value) == str(other_error.value)
    assert "does not exist" in str(other_error.value)


def test_collective_unexpected_error_on_rank0_is_broadcast(tmp_path):
    """An error the loaders do not classify (numpy's EOFError on a zero-byte .npy, e.g. a truncated copy)
    reaches every rank as a DataError naming the source and the exception type."""
    empty = tmp_path / "truncated.npy"
    empty.write_bytes(b"")
    root = FakeComm(0)
    with pytest.raises(DataError, match="truncated.npy.*EOFError") as root_error:
        load_tokens_collective(root, str(empty))
    with pytest.raises(DataError) as other_error:
        load_tokens_collective(FakeComm(1, root.sent[0]), str(empty))
    assert str(other_error.value) == str(root_error.value)
