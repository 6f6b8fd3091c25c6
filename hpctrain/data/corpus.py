"""Token corpora: the builtin stdlib corpus, text files/folders, .npy and .h5 arrays.

Every loader returns a 1-D integer token array. Byte-level sources (builtin, text,
folders) give ``uint16`` tokens in 0..255 (vocab 256); pre-tokenized arrays keep
their ids (converted to ``uint16`` when they fit).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile

import numpy as np

from hpctrain.data.documents import BINARY_SNIFF_BYTES, BUILTIN_SOURCE, DataError  # noqa: F401 (re-exported)
from hpctrain.data.documents import builtin_source_files, folder_text_files
from hpctrain.data.packing import SFTCorpus, is_sft
from hpctrain.data.prepared import PreparedCorpus, is_prepared
from hpctrain.errors import HpcTrainError, everywhere
from hpctrain.runtime import env

BYTE_VOCAB_SIZE = 256
FILE_SEPARATOR = b"\n\n"
CACHE_FORMAT_TAG = "hpctrain-builtin-v1"


def default_cache_dir() -> str:
    """``$HPCTRAIN_CACHE`` if set, else ``~/.cache/hpctrain``."""
    return env.cache_dir()


def infer_vocab_size(tokens: np.ndarray) -> int:
    """Smallest vocab covering ``tokens``, never below the byte vocab (256)."""
    if len(tokens) == 0:
        return BYTE_VOCAB_SIZE
    return max(BYTE_VOCAB_SIZE, int(np.max(tokens)) + 1)


def load_tokens(source: str = BUILTIN_SOURCE, cache_dir: str = "", max_bytes: int = 0) -> np.ndarray:
    """Load a corpus as a 1-D token array (``uint16`` unless ids exceed 65535).

    source: ``"builtin"`` (stdlib ``.py`` files, cached as .npy under cache_dir),
    a text file, a folder of text files, a ``.npy`` array or a ``.h5``/``.hdf5``
    file with a ``tokens`` dataset. ``max_bytes > 0`` keeps only the first
    ``max_bytes`` tokens (= bytes for byte-level sources). Raises DataError.
    """
    tokens, _ = _load(source, cache_dir, max_bytes, mmap=False)
    return tokens


def load_tokens_collective(mpi_comm, source: str = BUILTIN_SOURCE, cache_dir: str = "",
                           max_bytes: int = 0) -> np.ndarray | PreparedCorpus | SFTCorpus:
    """Collective ``load_tokens`` over an mpi4py communicator (``None``: single process).

    Rank 0 loads (building the builtin cache), then broadcasts success or its error;
    on failure every rank raises DataError with rank 0's message. Other ranks then
    read the cache (memory-mapped) or the source itself. Uses only ``mpi_comm.Get_rank``
    and ``mpi_comm.bcast``.
    """
    if is_prepared(source):  # `hpctrain data prepare` output: every rank opens it and reads its own windows
        return PreparedCorpus(source)
    if is_sft(source):  # `hpctrain data prepare --format sft-jsonl` output: packed examples with loss masks
        return SFTCorpus(source)
    if mpi_comm is None:
        return load_tokens(source, cache_dir, max_bytes)
    rank = mpi_comm.Get_rank()
    tokens = None
    root_error = None
    status = None
    if rank == 0:
        try:
            tokens, cache_path = _load(source, cache_dir, max_bytes, mmap=False)
            status = {"ok": True, "cache_path": cache_path}
        except Exception as exc:  # every failure must reach the other ranks
            root_error = exc
            message = str(exc) if isinstance(exc, DataError) else (
                f"data source {source!r}: {type(exc).__name__}: {exc}")
            status = {"ok": False, "message": message}
    status = mpi_comm.bcast(status, root=0)
    if not status["ok"]:
        raise everywhere(DataError(status["message"])) from root_error
    if rank == 0:
        assert tokens is not None  # status ok: rank 0 loaded them
        return tokens
    try:
        cache_path = status["cache_path"]
        if cache_path and os.path.isfile(cache_path):
            return _validated_array(np.load(cache_path, mmap_mode="r", allow_pickle=False),
                                    cache_path, max_bytes=0)
        tokens, _ = _load(source, cache_dir, max_bytes, mmap=True)
        return tokens
    except DataError as exc:
        raise DataError(f"rank {rank}: {exc} (rank 0 loaded it successfully)") from exc
    except Exception as exc:
        raise DataError(f"rank {rank}: data source {source!r}: {type(exc).__name__}: {exc} "
                        "(rank 0 loaded it successfully)") from exc


def _load(source: str, cache_dir: str, max_bytes: int, mmap: bool) -> tuple[np.ndarray, str]:
    """Dispatch on source kind; returns (tokens, cache path or "")."""
    if not isinstance(max_bytes, int) or max_bytes < 0:
        raise DataError(f"data source {source!r}: max_bytes must be an int >= 0, got {max_bytes!r}")
    if source == BUILTIN_SOURCE:
        return _load_builtin(cache_dir or default_cache_dir(), max_bytes, mmap)
    path = os.path.expanduser(str(source))
    if not os.path.exists(path):
        raise DataError(f"data source {path!r}: path does not exist "
                        f"(use {BUILTIN_SOURCE!r}, a text file, a folder, .npy or .h5)")
    if os.path.isdir(path):
        return _bytes_to_tokens(_read_folder(path, max_bytes), path), ""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        return _load_npy(path, max_bytes, mmap), ""
    if suffix in (".h5", ".hdf5"):
        return _load_h5(path, max_bytes), ""
    data = _read_file(path, max_bytes)
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        raise DataError(f"data source {path!r}: file looks binary (NUL byte in the first "
                        f"{BINARY_SNIFF_BYTES} bytes); give a text file, .npy or .h5")
    return _bytes_to_tokens(data, path), ""


# ---------------------------------------------------------------- builtin corpus

def builtin_cache_path(cache_dir: str, files: list[str], max_bytes: int) -> str:
    """Cache file for the builtin corpus; name hashes (python version, #files, size, max_bytes)."""
    total_size = sum(os.path.getsize(p) for p in files)
    key = f"{CACHE_FORMAT_TAG}|{sys.version}|{len(files)}|{total_size}|{max_bytes}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"builtin-{digest}.npy")


def _load_builtin(cache_dir: str, max_bytes: int, mmap: bool) -> tuple[np.ndarray, str]:
    files = builtin_source_files()
    if not files:
        raise DataError("builtin corpus: no .py files found in the stdlib folder "
                        f"{sysconfig.get_paths()['stdlib']!r}")
    cache_path = builtin_cache_path(cache_dir, files, max_bytes)
    if os.path.isfile(cache_path):
        try:
            cached = np.load(cache_path, mmap_mode="r" if mmap else None, allow_pickle=False)
            return _validated_array(cached, cache_path, max_bytes=0), cache_path
        except (OSError, ValueError):
            pass  # unreadable or corrupt cache: rebuild it below
    tokens = _bytes_to_tokens(_read_builtin_bytes(files, max_bytes), "builtin corpus")
    _save_atomically(tokens, cache_path)
    return tokens, cache_path


def _read_builtin_bytes(files: list[str], max_bytes: int) -> bytes:
    """Stdlib source bytes joined by FILE_SEPARATOR, truncated to max_bytes (> 0)."""
    return _join_files(files, max_bytes)


def _save_atomically(tokens: np.ndarray, cache_path: str) -> None:
    """Write ``tokens`` to cache_path via temp file + os.replace (safe with concurrent ranks)."""
    cache_dir = os.path.dirname(cache_path)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp_path = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=cache_dir)
    except OSError as exc:
        raise DataError(f"builtin corpus: cannot write cache folder {cache_dir!r}: {exc}") from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, tokens, allow_pickle=False)
        os.replace(tmp_path, cache_path)
    except BaseException as exc:
        try:
            os.unlink(tmp_path)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise DataError(f"builtin corpus: cannot write cache {cache_path!r}: {exc}") from exc
        raise


# ---------------------------------------------------------------- files and folders

def _read_file(path: str, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(max_bytes) if max_bytes > 0 else handle.read()
    except OSError as exc:
        raise DataError(f"data source {path!r}: cannot read file: {exc}") from exc


def _read_folder(folder: str, max_bytes: int) -> bytes:
    """All text-like files under folder (recursive, sorted, hidden entries skipped), joined."""
    return _join_files(folder_text_files(folder), max_bytes)


def _join_files(paths: list[str], max_bytes: int) -> bytes:
    """Contents of paths joined by FILE_SEPARATOR; stops reading once max_bytes (> 0) is reached."""
    parts, total = [], 0
    for index, path in enumerate(paths):
        if index:
            parts.append(FILE_SEPARATOR)
            total += len(FILE_SEPARATOR)
        data = _read_file(path, 0)
        parts.append(data)
        total += len(data)
        if 0 < max_bytes <= total:
            break
    joined = b"".join(parts)
    return joined[:max_bytes] if max_bytes > 0 else joined


def _bytes_to_tokens(data: bytes, label: str) -> np.ndarray:
    if not data:
        raise DataError(f"data source {label!r}: corpus is empty (0 bytes)")
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


# ---------------------------------------------------------------- token arrays

def _validated_array(array: np.ndarray, path: str, max_bytes: int) -> np.ndarray:
    """Check a token array is 1-D, integer, non-empty and >= 0; truncate; prefer uint16."""
    if array.dtype.kind not in "iu":
        raise DataError(f"data source {path!r}: token array must have an integer dtype, "
                        f"got {array.dtype}")
    if array.ndim != 1:
        raise DataError(f"data source {path!r}: token array must be 1-D, got shape {array.shape}")
    if max_bytes > 0:
        array = array[:max_bytes]
    if len(array) == 0:
        raise DataError(f"data source {path!r}: token array is empty")
    if array.dtype == np.uint16:
        return array
    if array.dtype.kind == "i" and int(array.min()) < 0:
        raise DataError(f"data source {path!r}: token ids must be >= 0, found {int(array.min())}")
    if int(array.max()) <= np.iinfo(np.uint16).max:
        return array.astype(np.uint16)
    return array


def _load_npy(path: str, max_bytes: int, mmap: bool) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"data source {path!r}: cannot load .npy array: {exc}") from exc
    if not isinstance(array, np.ndarray):
        raise DataError(f"data source {path!r}: expected a single .npy array, got {type(array).__name__}")
    return _validated_array(array, path, max_bytes)


def _load_h5(path: str, max_bytes: int) -> np.ndarray:
    try:
        import h5py
    except ImportError as exc:
        raise DataError(f"data source {path!r}: reading .h5 files needs h5py (pip install h5py)") from exc
    try:
        with h5py.File(path, "r") as handle:
            dataset = handle.get("tokens")
            if not isinstance(dataset, h5py.Dataset):
                names = []
                handle.visititems(lambda name, obj: names.append(name)
                                  if isinstance(obj, h5py.Dataset) else None)
                raise DataError(f"data source {path!r}: no 'tokens' dataset; "
                                f"available datasets: {sorted(names) or 'none'}")
            if dataset.ndim != 1:
                raise DataError(f"data source {path!r}: dataset 'tokens' must be 1-D, "
                                f"got shape {dataset.shape}")
            array = dataset[:max_bytes] if max_bytes > 0 else dataset[()]
    except OSError as exc:
        raise DataError(f"data source {path!r}: cannot read HDF5 file: {exc}") from exc
    return _validated_array(np.asarray(array), path, max_bytes=0)
