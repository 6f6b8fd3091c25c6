"""Two writers of the same logical checkpoint (a ``Snapshot`` per rank -> one global-view file).

mpio    one ``checkpoint.h5`` written by all ranks with ``driver='mpio'``: datasets and attributes are
        created collectively (same order, same values on every rank: HDF5's metadata rule), then each
        rank writes its boxes with INDEPENDENT I/O, one H5Dwrite per dataset it owns data of (the
        union of its boxes): no collective per dataset, so the cost does not grow with the number of
        datasets times the collective latency (the old collective writes took 40-90 ms each at 4
        oversubscribed ranks). A rank with nothing in a dataset makes no call (independent I/O has
        no collective to skip: the hang of h5py #965 cannot happen).
shards  each rank writes ``shards/shard-RRRRR.h5`` with serial h5py while the rank with the least
        data writes ``checkpoint.h5``, whose datasets are HDF5 virtual datasets mapping every box to
        its shard (relative paths: the directory can be renamed and moved); the manifest of
        checksums is added to it last.

``before_write`` (test-only fault injection) runs on each rank just before its own writes; an error it
raises is handled like a write error. Both run on ``comm``, a ``Communicator`` on a duplicate of the world communicator reserved for
checkpoints (so every exchange is numbered and watched, the parallel-HDF5 section included), and
return after every rank's data is in the files (not yet fsynced or verified: the manager does that).
"""
from __future__ import annotations

import gc
import json
import os
import re
import sys
from collections import defaultdict

import h5py
import numpy as np

from hpctrain.checkpoint.format import MASTER_FILE, Box, crc32, encode_json
from hpctrain.checkpoint.reader import JSON_ATTRS
from hpctrain.checkpoint.transfer import WriteItem


def has_parallel_h5py() -> bool:
    return bool(h5py.get_config().mpi)


def union_datasets(comm, snapshot) -> list[tuple[str, tuple, str]]:
    merged = {}
    for part in comm.allgather_object(snapshot.datasets):
        merged.update(part)
    return [(name, tuple(shape), dtype) for name, (shape, dtype) in sorted(merged.items())]


def _manifest(entries_per_rank) -> dict:
    manifest = defaultdict(list)
    for entries in entries_per_rank:
        for name, offset, shape, crc, *_ in entries:
            manifest[name].append([list(offset), list(shape), crc])
    return {name: sorted(boxes) for name, boxes in manifest.items()}


def _set_attrs(f, attrs: dict) -> None:
    for key, value in sorted(attrs.items()):
        f.attrs[key] = json.dumps(value, sort_keys=True) if key in JSON_ATTRS else value


def _independent_write(dataset, items) -> None:
    """One independent H5Dwrite of the union of ``items``' boxes into ``dataset`` (none: no call)."""
    if not items:
        return
    fspace = dataset.id.get_space()
    for i, item in enumerate(items):
        op = h5py.h5s.SELECT_SET if i == 0 else h5py.h5s.SELECT_OR
        fspace.select_hyperslab(item.box.offset, item.box.shape, op=op)
    data = items[0].data.reshape(-1) if len(items) == 1 else np.concatenate([it.data.reshape(-1) for it in items])
    mspace = h5py.h5s.create_simple((data.size,))
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_INDEPENDENT)
    dataset.id.write(mspace, fspace, np.ascontiguousarray(data, dtype=dataset.dtype), dxpl=dxpl)


def _crc_and_finite(item) -> tuple[int, bool]:
    """CRC-32 of the item's bytes and whether its floats are all finite: one visit of the data while it
    is in cache (the finite check is what keeps a diverged state from ever being published)."""
    finite = item.data.dtype.kind != "f" or bool(np.isfinite(item.data).all())
    return crc32(item.data), finite


def checksums_in_background(snapshot):
    """CRC-32 of every item's data, computed on a thread while the caller writes (zlib and numpy release
    the GIL): returns a callable that waits and gives the list, in ``items`` order; it also records in
    ``snapshot.nonfinite`` the datasets holding inf or NaN (the manager refuses to publish those)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-crc")
    future = pool.submit(lambda: [_crc_and_finite(item) for item in snapshot.items])
    pool.shutdown(wait=False)

    def result() -> list[int]:
        checked = future.result()
        snapshot.nonfinite = sorted({it.dataset for it, (_, finite) in zip(snapshot.items, checked) if not finite})
        return [crc for crc, _ in checked]
    return result


def write_mpio(comm, directory: str, snapshot, before_write=None) -> list[str]:
    """Collective parallel-HDF5 write; returns the files this rank should fsync."""
    datasets = union_datasets(comm, snapshot)
    crcs = checksums_in_background(snapshot)
    by_dataset = defaultdict(list)
    for item in snapshot.items:  # items of one dataset come in increasing local (= file) order
        by_dataset[item.dataset].append(item)
    path = os.path.join(directory, MASTER_FILE)
    error = write_or_error(path, before_write) if before_write is not None else None  # test-only fault injection
    with comm.watched("mpio write"), h5py.File(path, "w", driver="mpio", comm=comm.mpi) as f:
        for name, shape, dtype in datasets:
            f.create_dataset(name, shape=shape, dtype=np.dtype(dtype))
        for name, _, _ in datasets:  # independent: a failing rank keeps its error and stays in step
            error = error or write_or_error(path, lambda: _independent_write(f[name], by_dataset.get(name, [])))
        entries = [(it.dataset, it.box.offset, it.box.shape, crc) for it, crc in zip(snapshot.items, crcs())]
        manifest = encode_json(_manifest(comm.allgather_object(entries)))
        f.create_dataset("manifest", shape=manifest.shape, dtype=np.uint8)  # collective: same shape everywhere
        if comm.rank == 0:
            _independent_write(f["manifest"], [WriteItem("manifest", Box((0,), manifest.shape), manifest)])
        _set_attrs(f, {**snapshot.attrs, "writer": "mpio"})
    if error:
        raise WriteFailed(error)
    return [path]  # every rank fsyncs: on a parallel file system each node flushes its own cache


def write_shards(comm, directory: str, snapshot, before_write=None) -> list[str]:
    """Per-rank shard files plus a virtual-dataset master; returns the files this rank should fsync.

    The master needs only where each box goes (not its data), so it is built while the shards are
    written, by the rank with the least data to write; only the manifest (checksums) waits for all.
    Every rank makes the same collective calls whatever fails: a rank's I/O error (ENOSPC, quota, EIO)
    is kept, passed along with the checksums, and raised (``WriteFailed``) by every failing rank only
    after the last collective, so the manager agrees on it at once instead of ranks waiting in
    different collectives.
    """
    datasets = union_datasets(comm, snapshot)
    rank = comm.rank
    relative = f"shards/shard-{rank:05d}.h5"
    boxes = [(item.dataset, item.box.offset, item.box.shape, relative, f"b{k}")
             for k, item in enumerate(snapshot.items)]
    everything = comm.allgather_object((sum(item.data.nbytes for item in snapshot.items), boxes))
    builder = min(range(len(everything)), key=lambda r: (everything[r][0], -r))
    path = os.path.join(directory, MASTER_FILE)
    shard_path = os.path.join(directory, relative)
    error = write_or_error(shard_path, before_write) if before_write is not None else None  # test-only fault injection
    if rank == builder and error is None:
        error = write_or_error(path, lambda: _write_master(path, datasets, everything, snapshot.attrs))
    entries, written = [], []
    if snapshot.items:
        crcs = checksums_in_background(snapshot)
        error = error or write_or_error(shard_path, lambda: _write_shard(shard_path, snapshot.items))
        entries = [(it.dataset, it.box.offset, it.box.shape, crc) for it, crc in zip(snapshot.items, crcs())]
        written.append(shard_path)
    gathered = comm.gather_object((entries, error is not None), root=builder)
    if rank == builder and error is None and not any(failed for _, failed in gathered):
        error = write_or_error(path, lambda: _add_manifest(path, [e for e, _ in gathered]))
        written.append(path)
    if error:
        raise WriteFailed(error)
    return written


class WriteFailed(OSError):
    """A rank's checkpoint file could not be written; the message names the file and the OS error."""


def _write_master(path, datasets, everything, attrs) -> None:
    sources = defaultdict(list)
    for _, rank_boxes in everything:
        for name, offset, shape, rel, key in rank_boxes:
            sources[name].append((offset, shape, rel, key))
    with h5py.File(path, "w") as f:
        for name, shape, dtype in datasets:
            dtype = np.dtype(dtype)
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            for offset, box_shape, rel, key in sources.get(name, []):
                index = tuple(slice(o, o + n) for o, n in zip(offset, box_shape))
                layout[index] = h5py.VirtualSource(rel, key, shape=tuple(box_shape), dtype=dtype)
            f.create_virtual_dataset(name, layout, fillvalue=np.nan if dtype.kind == "f" else 0)
        _set_attrs(f, {**attrs, "writer": "shards"})


def _write_shard(path, items) -> None:
    with h5py.File(path, "w") as f:
        for k, item in enumerate(items):
            f.create_dataset(f"b{k}", data=item.data)


def _add_manifest(path, entries_per_rank) -> None:
    with h5py.File(path, "a") as f:
        f["manifest"] = encode_json(_manifest(entries_per_rank))


def write_or_error(path: str, write) -> str | None:
    """Run ``write`` (h5py calls on ``path``); None, or one line naming the file and the OS error.

    HDF5 reports a failed write of cached data when handles are released, from destructors that
    Python can only print ("Exception ignored in h5py._objects.ObjectID.__dealloc__", once per
    object: hundreds of tracebacks for one full disk). Those are collected here instead, and the
    first one names the error when ``write`` itself raised something vaguer."""
    ignored: list[sys.UnraisableHookArgs] = []
    previous, sys.unraisablehook = sys.unraisablehook, ignored.append
    try:
        write()
        problem = None  # the file closed cleanly: nothing left to release (no full GC on the save path)
    except Exception as exc:  # noqa: BLE001 - reported by the caller after the collectives
        gc.collect()  # release what the failed write left, while the hook collects HDF5's complaints
        problem = exc
    finally:
        sys.unraisablehook = previous
    if problem is None and not ignored:
        return None
    return f"{path}: {_os_error_text(problem, [str(u.exc_value) for u in ignored])}"


def _os_error_text(exc, ignored: list[str]) -> str:
    """The errno text of ``exc`` or of HDF5's messages ('... errno = 28, error message = 'No space
    left on device' ...'), else the exception itself."""
    if isinstance(exc, OSError) and exc.errno:
        return f"{os.strerror(exc.errno)} (errno {exc.errno})"
    for text in [str(exc or "")] + ignored:
        found = re.search(r"errno = (\d+), error message = '([^']*)'", text)
        if found:
            return f"{found.group(2)} (errno {found.group(1)})"
    return f"{type(exc).__name__}: {exc}" if exc else ignored[0].splitlines()[0]
