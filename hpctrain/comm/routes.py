"""``comm.intra_node = auto``: which of the dp group's collectives go through shared memory, by op and size.

On a node, the shared-memory window (shm.py) is not always faster than the MPI library: it depends on the
CPU, the MPI build and the size. ``choose_routes`` (collective over the world, after every dp group got its
``ShmRoute``) times the route against MPI on the group itself, per op (allreduce, reduce_scatter, allgather)
and size class (bytes of the whole buffer, as ``hpctrain bench comm`` counts them: the allreduce tensor,
the reduce_scatter input, the allgather output): <= 8 KiB, <= 64 KiB, <= 1 MiB, <= 16 MiB, larger, each
timed at its upper bound (the last at 64 MiB) in float32, median of a few rounds, about 0.5-1 s in all at
2 ranks here. Every rank decides from the slowest rank's median per candidate (one MPI MAX over the world),
so the table is the same on every rank of every dp group: ``decide`` (pure) gives shm to a class only when
it measured at least ``SHM_MARGIN`` x MPI's speed (``SHM_MARGIN_OVERSUBSCRIBED`` with more ranks on the
node than cores, where shm's speed swings from second to second). The table is cached per node and MPI as JSON under the
cache dir (``$HPCTRAIN_CACHE``, else ``data.cache_dir``, else ``~/.cache/hpctrain``, in ``intra-node/``),
keyed by hostname, MPI library, group size, ranks and cores per node, ``comm.shm_progress``, size classes,
margin and hpctrain's version; world rank 0 reads it (a corrupt or mismatched file is ignored: measured again) and
writes it atomically (temp file + ``os.replace``); ``comm.route_cache = false`` measures again every start.

Table: {op: [(max bytes or None for the last class, "shm" | "mpi", MPI's time / shm's time), ...]}.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import tempfile
import time

ROUTE_OPS = ("allreduce", "reduce_scatter", "allgather")
# (largest buffer of the class in bytes, None = no bound; the size it is timed at)
CLASSES: tuple[tuple[int | None, int], ...] = ((8 << 10, 8 << 10), (64 << 10, 64 << 10), (1 << 20, 1 << 20),
                                               (16 << 20, 16 << 20), (None, 64 << 20))
# shm takes a class only when it measured this much faster than MPI (closer calls stay on MPI): at 1.03 a
# noisy start-up measurement gave shm the 1 MiB reduce_scatter, which then ran at 0.74-0.88x MPI
# (docs/benchmarks.md); a wrong pick costs more than a missed small win
SHM_MARGIN = 1.2
# More ranks on the node than cores: shm's spin barriers are at the scheduler's mercy (4 ranks on 2 cores here:
# 16 MiB reduce_scatter 1.7x MPI in one second, 0.58x in the next, and always 0.5x with the ranks bound to cores)
SHM_MARGIN_OVERSUBSCRIBED = 2.0
SCHEMA = 1  # of the cache file

Table = dict[str, list[tuple[int | None, str, float]]]


def decide(timings: dict[str, list[tuple[float, float]]], margin: float = SHM_MARGIN) -> Table:
    """From {op: [(shm seconds, MPI seconds) per class of ``CLASSES``]} to the routing table."""
    table: Table = {}
    for op in ROUTE_OPS:
        rows = []
        for (limit, _), (shm, mpi) in zip(CLASSES, timings[op], strict=True):
            ratio = mpi / shm if shm > 0 else 0.0
            rows.append((limit, "shm" if ratio >= margin else "mpi", round(ratio, 3)))
        table[op] = rows
    return table


def uses_shm(table: Table) -> bool:
    return any(route == "shm" for rows in table.values() for _, route, _ in rows)


def bounds(table: Table) -> dict[str, tuple[tuple[float, bool], ...]]:
    """The table as ``ShmRoute.takes`` looks it up: {op: ((max bytes, through shm), ...)}, the last unbounded."""
    return {op: tuple((float("inf") if limit is None else limit, route == "shm") for limit, route, _ in rows)
            for op, rows in table.items()}


def size_text(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def class_text(index: int) -> str:
    """``"<= 64K"``, ``"> 16M"``: class ``index`` of ``CLASSES``."""
    limit = CLASSES[index][0]
    return f"> {size_text(CLASSES[index - 1][0] or 0)}" if limit is None else f"<= {size_text(limit)}"


def describe(table: Table) -> str:
    """Short: ``"allreduce shm > 64K, reduce_scatter shm, allgather mpi"`` (the ranges of classes through shm)."""
    parts = []
    for op, rows in table.items():
        shm = [route == "shm" for _, route, _ in rows]
        if all(shm) or not any(shm):
            parts.append(f"{op} {'shm' if all(shm) else 'mpi'}")
            continue
        spans = []
        for i, through in enumerate(shm):
            if through and (i == 0 or not shm[i - 1]):  # a run of shm classes starts at class i
                end = i
                while end + 1 < len(shm) and shm[end + 1]:
                    end += 1
                low = f"> {size_text(CLASSES[i - 1][0] or 0)}" if i else ""
                limit = rows[end][0]
                spans.append(" ".join(t for t in (low, "" if limit is None else f"<= {size_text(limit)}") if t))
        parts.append(f"{op} shm {' and '.join(spans)}")
    return ", ".join(parts)


# ---------------------------------------------------------------- cache
def cache_key(mpi_library: str, group_size: int, ranks_per_node: int, cores: int, progress: str) -> dict:
    """What a table depends on (``margin``: the one ``decide`` uses, higher on an oversubscribed node)."""
    from hpctrain import __version__

    margin = SHM_MARGIN if ranks_per_node <= cores else SHM_MARGIN_OVERSUBSCRIBED
    return {"schema": SCHEMA, "hpctrain": __version__, "hostname": socket.gethostname(), "mpi": mpi_library,
            "group_size": group_size, "ranks_per_node": ranks_per_node, "cores": cores, "progress": progress,
            "classes": [list(c) for c in CLASSES], "margin": margin}


def route_key(comm, world, progress: str) -> dict:
    """Collective over ``world``: world rank 0's ``cache_key`` for ``comm``'s table, on every rank (``cores``:
    the CPUs the ranks of its node may run on, the union of their affinities)."""
    from mpi4py import MPI

    node = world.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_per_node = node.Get_size()
    cores = len(set().union(*node.allgather(sorted(os.sched_getaffinity(0)))))
    node.Free()
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    key = cache_key(library, comm.size, ranks_per_node, cores, progress) if world.rank == 0 else None
    return world.broadcast_object(key, root=0)


def cache_path(cache_dir: str, key: dict) -> str:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, "intra-node", f"routes-{key['hostname']}-{digest}.json")


def read_cache(path: str, key: dict) -> Table | None:
    """The table stored at ``path`` for ``key``; None when missing, unreadable, corrupt or for another key."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data["key"] != key or sorted(data["table"]) != sorted(ROUTE_OPS):
            return None
        table: Table = {}
        for op in ROUTE_OPS:
            rows = [(limit, str(route), float(ratio)) for limit, route, ratio in data["table"][op]]
            if [r[0] for r in rows] != [c[0] for c in CLASSES] or any(r[1] not in ("shm", "mpi") for r in rows):
                return None
            table[op] = rows
        return table
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def write_cache(path: str, key: dict, table: Table) -> bool:
    """Store ``table`` at ``path`` atomically (a temp file, then ``os.replace``); False when it cannot."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".routes-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"key": key, "table": table, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- measurement
def _calls(route, host, op: str, nbytes: int, big, small):
    """(through shm, through MPI): one blocking call each of ``op`` on ``nbytes`` of the buffers."""
    n = host.size
    if op == "allreduce":
        t = big[:nbytes // 4]
        return (lambda: route.allreduce(t)), (lambda: host.allreduce(t))
    per = nbytes // 4 // n
    whole, part = big[:per * n], small[:per]
    if op == "reduce_scatter":
        return (lambda: route.reduce_scatter(part, whole)), (lambda: host.reduce_scatter(part, whole))
    return (lambda: route.allgather(whole, part)), (lambda: host.allgather(whole, part))


def measure(comm, route, rounds: int = 5) -> list[float]:
    """Collective over ``comm`` (the dp group; ``route``: its ``ShmRoute``): this rank's median seconds per
    call, flat in the order op x class x (shm, MPI). Untimed first round; candidates alternate each round."""
    import torch

    from hpctrain.comm.backends.mpi import MpiBackend

    host, n = MpiBackend(comm.mpi), comm.size
    top = max(size for _, size in CLASSES)
    big, small = torch.zeros(top // 4), torch.zeros(top // 4 // n + 1)
    medians = []
    for op in ROUTE_OPS:
        for _, nbytes in CLASSES:
            pair = _calls(route, host, op, nbytes, big, small)
            iters = max(1, min(32, (2 << 20) // nbytes))
            times: list[list[float]] = [[], []]
            for rnd in range(1 + (rounds if nbytes < top else max(2, rounds - 2))):
                for which in ((0, 1) if rnd % 2 else (1, 0)):
                    call = pair[which]
                    comm.mpi.Barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        call()
                    if rnd:
                        times[which].append((time.perf_counter() - start) / iters)
            medians += [statistics.median(times[0]), statistics.median(times[1])]
    return medians


def choose_routes(comm, world, route, cache_dir: str, use_cache: bool = True,
                  progress: str = "call") -> tuple[Table, str]:
    """Collective over ``world`` (every dp group, each with its ``ShmRoute`` ``route``): the routing table,
    from the cache or measured (then cached), the same on every rank; and where it came from ("cached
    PATH", "measured, cached in PATH" or "measured (not cached: ...)")."""
    import numpy as np
    from mpi4py import MPI

    key = route_key(comm, world, progress)
    path = cache_path(cache_dir, key)
    cached = read_cache(path, key) if use_cache and world.rank == 0 else None
    table = world.broadcast_object(cached, root=0)
    if table is not None:
        return table, f"cached in {path}"
    start = time.perf_counter()
    with comm.watched("comm.intra_node=auto measurement"):
        mine = np.array(measure(comm, route), dtype=np.float64)
    with world.watched("comm.intra_node=auto measurement result"):
        world.mpi.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)  # the slowest rank's median: one table everywhere
    k = len(CLASSES)
    values = [float(v) for v in mine]
    table = decide({op: [(values[2 * (i * k + j)], values[2 * (i * k + j) + 1]) for j in range(k)]
                    for i, op in enumerate(ROUTE_OPS)}, key["margin"])
    took = f"{time.perf_counter() - start:.1f} s"
    if world.rank == 0:
        where = f"cached in {path}" if write_cache(path, key, table) else f"not cached: cannot write {path}"
    else:
        where = ""
    return table, f"measured in {took}, {world.broadcast_object(where, root=0)}"
