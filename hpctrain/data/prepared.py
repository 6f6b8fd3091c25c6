"""Prepared corpora: token ids in one HDF5 file, tokenized in parallel, read by slabs.

File layout (``format = "hpctrain-tokens-v1"``)::

    /tokens        1-D uint16 (uint32 when the vocabulary exceeds 65536): every document's ids, in order
    /doc_offsets   1-D int64, n_docs + 1: document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]
    /doc_names     1-D strings: where each document came from
    attrs: format, tokenizer (name), tokenizer_sha256 (the tokenizer file's, or "bytes"), vocab_size,
           max_token, num_tokens, num_docs

``prepare`` (collective over an hpctrain Communicator): rank r tokenizes its share of the documents
(balanced by size) into ``OUT.parts/rankR.npy`` files, then rank 0 assembles the HDF5 file in document
order under a temporary name and renames it into place: a failed prepare never leaves a half file
under the final name, and an existing ``--out`` is never overwritten (unless ``force``).

``PreparedCorpus(path)`` opens the file lazily: ``len``, ``dtype``, ``max()`` (from the attributes) and
``corpus[positions]`` for the sampler's 2-D window index arrays read only those windows (one slab per
window), so no rank loads the whole corpus.
"""
from __future__ import annotations

import os
import shutil

import numpy as np

from hpctrain.data.documents import DataError, text_documents
from hpctrain.errors import everywhere

FORMAT = "hpctrain-tokens-v1"


class PreparedCorpus:
    """A lazily read prepared corpus (see the module docstring); 1-D, integer, like a token array."""

    ndim = 1
    FORMAT = FORMAT  # the file's format attribute (an SFT corpus, hpctrain/data/packing.py, has its own)

    def __init__(self, path: str):
        import h5py

        try:
            self._file = h5py.File(path, "r")
        except OSError as exc:
            raise DataError(f"data source {path!r}: cannot open HDF5 file: {exc}") from exc
        attrs = self._file.attrs
        if attrs.get("format") != self.FORMAT or "tokens" not in self._file:
            self._file.close()
            raise DataError(f"data source {path!r}: not a corpus made by `hpctrain data prepare` "
                            f"(format attribute {attrs.get('format')!r})")
        self.path = path
        self._tokens = self._file["tokens"]
        self.dtype = self._tokens.dtype
        self.tokenizer_sha256 = str(attrs["tokenizer_sha256"])
        self.tokenizer = str(attrs["tokenizer"])
        self.vocab_size = int(attrs["vocab_size"])
        self._max = int(attrs["max_token"])
        self.doc_offsets = self._file["doc_offsets"][()]
        self.tokens_read = 0  # tokens this process has read (tests: no rank reads the whole corpus)

    def __len__(self) -> int:
        return int(self._tokens.shape[0])

    def max(self) -> int:
        return self._max

    def __getitem__(self, index):
        """``corpus[positions]`` (2-D int array of windows, each row consecutive) or a plain slice."""
        if isinstance(index, np.ndarray) and index.ndim == 2:
            width = index.shape[1]
            self.tokens_read += index.size
            return np.stack([self._tokens[int(row[0]):int(row[0]) + width] for row in index]) \
                if len(index) else np.empty((0, width), dtype=self.dtype)
        return self._tokens[index]

    def close(self) -> None:
        self._file.close()

    @classmethod
    def has_format(cls, path: str) -> bool:
        """Whether ``path`` is an HDF5 file of this class's format."""
        if not (isinstance(path, str) and path.endswith((".h5", ".hdf5")) and os.path.isfile(path)):
            return False
        import h5py

        try:
            with h5py.File(path, "r") as f:
                return f.attrs.get("format") == cls.FORMAT
        except OSError:
            return False


def is_prepared(path: str) -> bool:
    return PreparedCorpus.has_format(path)


def _shares(sizes: list[int], nranks: int) -> list[list[int]]:
    """Document indices per rank, largest first to the least loaded rank (greedy balance)."""
    loads = [0] * nranks
    shares: list[list[int]] = [[] for _ in range(nranks)]
    for d in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = loads.index(min(loads))
        shares[r].append(d)
        loads[r] += sizes[d]
    return [sorted(s) for s in shares]


def prepare(comm, inputs: list[str], tokenizer, out: str, force: bool = False, progress: bool = True) -> dict:
    """Collective over ``comm`` (an hpctrain Communicator: its calls are watched, so a stopped or dead rank
    ends the job with a hang report; or any object with ``rank``, ``size``, ``broadcast_object``,
    ``allgather_object``, ``barrier``): tokenize ``inputs`` (files, folders, ``builtin``) into ``out``;
    returns the summary (on every rank). Errors (a missing input, an unreadable file, an existing
    ``out``) are raised on every rank."""
    rank, size = comm.rank, comm.size
    problem, docs = None, []
    if rank == 0:
        try:
            if os.path.exists(out) and not force:
                raise DataError(f"{out} exists: choose another --out or pass --force to replace it")
            docs = text_documents(inputs)
            os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        except (DataError, OSError) as exc:
            problem = str(exc)
    problem, docs = comm.broadcast_object((problem, docs), root=0)
    if problem:
        raise everywhere(DataError(problem))
    parts = f"{out}.parts"
    if rank == 0:
        shutil.rmtree(parts, ignore_errors=True)
        os.makedirs(parts)
    comm.barrier()
    mine = _shares([os.path.getsize(p) for p in docs], size)[rank]
    lengths, problem = {}, None
    try:
        token_lists = []
        for d in _progress(mine, progress and rank == 0, f"rank 0 of {size}: tokenizing"):
            ids = _tokenize_file(docs[d], tokenizer)
            lengths[d] = len(ids)
            token_lists.append(ids)
        dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
        np.save(os.path.join(parts, f"rank{rank}.npy"),
                np.concatenate(token_lists).astype(dtype) if token_lists else np.empty(0, dtype=dtype))
    except (DataError, OSError) as exc:
        problem = f"rank {rank}: {exc}"
    problems = [p for p in comm.allgather_object(problem) if p]
    if problems:
        if rank == 0:
            shutil.rmtree(parts, ignore_errors=True)
        raise everywhere(DataError("; ".join(problems[:3])))
    all_lengths = {d: n for part in comm.allgather_object(lengths) for d, n in part.items()}
    summary = None
    if rank == 0:
        try:
            summary = _assemble(out, parts, docs, all_lengths, _shares([os.path.getsize(p) for p in docs], size),
                                tokenizer)
        except (DataError, OSError) as exc:
            summary = {"error": str(exc)}
        finally:
            shutil.rmtree(parts, ignore_errors=True)
    summary = comm.broadcast_object(summary, root=0)
    if "error" in summary:
        raise everywhere(DataError(summary["error"]))
    return summary


def _tokenize_file(path: str, tokenizer) -> list[int]:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return tokenizer.encode(text)


def _progress(items, enabled: bool, label: str):
    if not enabled:
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=False) as bar:
        task = bar.add_task(label, total=len(items))
        for item in items:
            yield item
            bar.advance(task)


def _assemble(out: str, parts: str, docs: list[str], lengths: dict, shares: list[list[int]], tokenizer) -> dict:
    """Rank 0: the per-rank parts -> ``out`` in document order (temporary name, then rename)."""
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([lengths[d] for d in range(len(docs))], out=offsets[1:])
    where = {}  # document -> (rank, start within that rank's part)
    for r, share in enumerate(shares):
        start = 0
        for d in share:
            where[d] = (r, start)
            start += lengths[d]
    arrays = [np.load(os.path.join(parts, f"rank{r}.npy"), mmap_mode="r") for r in range(len(shares))]
    dtype = arrays[0].dtype if arrays else np.uint16
    tmp = f"{out}.tmp.{os.getpid()}"
    try:
        max_token = _write_h5(tmp, docs, offsets, where, lengths, arrays, dtype, tokenizer)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"path": out, "documents": len(docs), "tokens": int(offsets[-1]), "dtype": str(np.dtype(dtype)),
            "vocab_size": tokenizer.vocab_size, "max_token": max_token, "tokenizer": tokenizer.name}


def _write_h5(tmp, docs, offsets, where, lengths, arrays, dtype, tokenizer) -> int:
    import h5py

    max_token = 0
    with h5py.File(tmp, "w") as f:
        tokens = f.create_dataset("tokens", shape=(int(offsets[-1]),), dtype=dtype, chunks=True)
        for d in range(len(docs)):
            r, start = where[d]
            piece = arrays[r][start:start + lengths[d]]
            tokens[offsets[d]:offsets[d + 1]] = piece
            if len(piece):
                max_token = max(max_token, int(piece.max()))
        f["doc_offsets"] = offsets
        f["doc_names"] = np.array([os.path.relpath(p) if not os.path.isabs(p) else p for p in docs], dtype=object
                                  ).astype(h5py.string_dtype())
        f.attrs.update({"format": FORMAT, "tokenizer": tokenizer.name, "tokenizer_sha256": tokenizer.identity,
                        "vocab_size": tokenizer.vocab_size, "max_token": max_token,
                        "num_tokens": int(offsets[-1]), "num_docs": len(docs)})
    return max_token


def check_corpus(tokens, tokenizer_spec: str, vocab_size: int, source: str) -> None:
    """Before training: the corpus fits the model's vocabulary and was made by ``data.tokenizer``."""
    from hpctrain.data.tokenizer import BYTES, file_sha256

    spec = tokenizer_spec or BYTES
    if isinstance(tokens, PreparedCorpus):
        wanted = BYTES if spec == BYTES else (file_sha256(spec) if os.path.isfile(spec) else None)
        if wanted is None:
            raise everywhere(DataError(f"data.tokenizer={spec!r}: no such file"))
        if wanted != tokens.tokenizer_sha256:
            raise everywhere(DataError(
                f"data source {source!r} was prepared with tokenizer {tokens.tokenizer!r} (sha256 "
                f"{tokens.tokenizer_sha256[:12]}), but data.tokenizer={spec!r} is "
                f"{'the byte tokenizer' if wanted == BYTES else 'sha256 ' + wanted[:12]}: set data.tokenizer to the "
                f"file the corpus was prepared with, or prepare it again"))
    elif spec != BYTES:
        raise everywhere(DataError(f"data.tokenizer={spec!r} needs a prepared corpus: run `hpctrain data prepare "
                                   f"--input {source} --tokenizer {spec} --out tokens.h5` and train on tokens.h5"))
    top = int(tokens.max())
    if top >= vocab_size:
        hint = f" (the tokenizer's vocabulary is {tokens.vocab_size})" if isinstance(tokens, PreparedCorpus) else ""
        raise everywhere(DataError(f"the corpus has token id {top} >= model.vocab_size={vocab_size}{hint}: "
                                   f"set model.vocab_size to at least {top + 1}"))
