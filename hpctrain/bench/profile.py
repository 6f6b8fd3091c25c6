"""``hpctrain bench comm --profile OUT.json``: latency (alpha) and inverse bandwidth (beta) per link level.

The grid's topology says which levels a job has: ``intra`` (ranks sharing a node: a group of the
ranks on each node) and ``inter`` (one rank per node: the ranks with the same position on every
node), from ``ProcessGrid.node_split("world")``. Each level's groups are timed all at once (every
node's intra group together; every position's inter group together: the NIC is shared as it is
when dp groups of a real run reduce at the same time), with hpctrain's Communicator, for each
collective and size; each size's time is the best of ``--rounds`` rounds of ``iters`` iterations, the
max over ranks.

The fit, per (collective, level): ``t = alpha + beta * w`` where ``w`` is the bytes each rank puts on
the wire for that collective of ``n`` bytes under the bandwidth-optimal algorithms (the
Communicator's byte model: allreduce 2(p-1)/p n; reduce_scatter, allgather, broadcast (p-1)/p n;
sendrecv n), least squares on relative error. ``beta`` is then seconds per wire byte (1/beta: the
link's bytes per second as the collective sees it). Per level, one fit pools every collective.
``fit_error``: the RMS relative difference between the fit and the measured times.

The JSON (read by ``hpctrain plan --profile``, ``hpctrain/plan/machine.py``)::

    {"version": 1, "ranks": 4, "nodes": 2, "hostnames": [...], "mpi_library": "...", "dtype": "float32",
     "levels": {"intra": {"alpha_s": .., "beta_s_per_byte": .., "bandwidth_GBps": .., "fit_error": ..,
                          "ranks": 2, "groups": 2}, "inter": {...}},
     "collectives": {"allreduce": {"intra": {"alpha_s": .., "beta_s_per_byte": .., "fit_error": ..,
                                             "points": [[bytes, seconds], ...]}, ...}, ...}}
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

from hpctrain.bench.comm import (DTYPES, OPS, _choices, default_iters, format_size, hpctrain_step, make_buffers,
                                 parse_size, time_step)
from hpctrain.errors import HpcTrainError

DEFAULT_SIZES = "4K,64K,256K,1M,4M,16M"


def wire_bytes(op: str, nbytes: int, p: int) -> float:
    """Bytes one rank of a group of ``p`` sends for ``op`` on ``nbytes`` (collectives.py's model)."""
    if op == "allreduce":
        return 2 * (p - 1) / p * nbytes
    if op == "sendrecv":
        return float(nbytes)
    return (p - 1) / p * nbytes


def fit_alpha_beta(points: list[tuple[float, float]]) -> dict:
    """Least squares of t = alpha + beta * w on relative error; alpha, beta >= 0. ``points``: (w, t)."""
    w = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    a = np.stack([np.ones_like(w), w], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # pure bandwidth
        alpha, beta = 0.0, float(np.sum(w * t / t**2) / np.sum(w * w / t**2))
    if beta < 0:  # pure latency
        alpha, beta = float(np.median(t)), 0.0
    predicted = alpha + beta * w
    error = float(np.sqrt(np.mean(((predicted - t) / t) ** 2)))
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta), "fit_error": error}


def levels_of(grid) -> dict:
    """{level: Communicator} for the levels this job has (a level needs groups of >= 2 ranks)."""
    split, reason = grid.node_split("world")
    if split is None:
        if grid.info.num_nodes == 1:
            return {"intra": grid.world} if grid.world.size > 1 else {}
        raise HpcTrainError(f"cannot profile the links: {reason}; launch the same number of ranks on every node")
    intra, inter = split
    return {name: comm for name, comm in (("intra", intra), ("inter", inter)) if comm.size > 1}


def measure(comm, world, op: str, sizes: list[int], dtype, rounds: int, iters: int) -> list[tuple[int, float]]:
    """[(bytes, seconds)] for ``op`` on every group of a level at once (best round, max over ranks)."""
    points = []
    for size in sizes:
        buffers, nbytes = make_buffers(op, size, comm.size, dtype)
        n = iters or default_iters(nbytes)
        step = hpctrain_step(op, comm, buffers)
        best = min(time_step(step, n, max(2, min(10, n // 10)), world, world) for _ in range(rounds))
        points.append((nbytes, best))
    return points


def run_link_profile(args) -> int:
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.runtime.launcher import discover

    ops = _choices(args.ops, OPS, "op")
    sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
    dtype, rounds = DTYPES[args.dtype], max(1, args.rounds)
    torch.set_num_threads(1)
    info = discover()
    grid = ProcessGrid.build(info)
    world = grid.world.mpi
    try:
        levels = levels_of(grid)
        if not levels:
            raise HpcTrainError("one rank: no link to profile; launch at least 2 ranks (2 per node for the "
                                "intra-node level, 2 nodes for the inter-node level)")
        doc = {"version": 1, "ranks": info.size, "nodes": info.num_nodes, "dtype": args.dtype,
               "mpi_library": info.mpi_library, "hostnames": sorted(set(world.allgather(info.hostname))),
               "levels": {}, "collectives": {}}
        for level, comm in levels.items():
            pooled = []
            for op in ops:
                points = measure(comm, world, op, sizes, dtype, rounds, args.iters)
                wire = [(wire_bytes(op, b, comm.size), s) for b, s in points]
                pooled += wire
                doc["collectives"].setdefault(op, {})[level] = {**fit_alpha_beta(wire), "points": points}
                if info.rank == 0:
                    done = ", ".join(f"{format_size(b)} {s * 1e6:.0f} us" for b, s in points)
                    print(f"bench comm --profile: {level} {op}: {done}", file=sys.stderr, flush=True)
            fit = fit_alpha_beta(pooled)
            groups = world.allreduce(1 if comm.rank == 0 else 0)
            doc["levels"][level] = {**fit, "bandwidth_GBps": 1 / fit["beta_s_per_byte"] / 1e9
                                    if fit["beta_s_per_byte"] > 0 else None, "ranks": comm.size, "groups": groups}
    finally:
        grid.close()
    if info.rank == 0:
        _write_json(args.profile, doc)
        print_profile(doc)
        print(f"link profile written to {args.profile}", flush=True)
    return 0


def _write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def print_profile(doc: dict) -> None:
    print(f"link profile: {doc['ranks']} ranks on {doc['nodes']} node(s); {doc['mpi_library']}")
    print(f"{'level':>6} {'collective':>15} {'alpha us':>9} {'GB/s':>8} {'fit err':>8}")
    for level, lv in doc["levels"].items():
        for op, per_level in doc["collectives"].items():
            c = per_level.get(level)
            if c:
                bw = 1 / c["beta_s_per_byte"] / 1e9 if c["beta_s_per_byte"] > 0 else float("inf")
                print(f"{level:>6} {op:>15} {c['alpha_s'] * 1e6:>9.1f} {bw:>8.3f} {c['fit_error']:>8.1%}")
        bw = lv["bandwidth_GBps"] or float("inf")
        print(f"{level:>6} {'(all pooled)':>15} {lv['alpha_s'] * 1e6:>9.1f} {bw:>8.3f} {lv['fit_error']:>8.1%}")
