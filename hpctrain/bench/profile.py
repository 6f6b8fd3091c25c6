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
                                             "points": [[bytes, seconds], ...]}, ...}, ...},
     "device": {"name": "cpu", "peak_tflops": .., "efficiency": .., "hbm_gbps": .., "matmul_tflops": ..,
                "ranks_per_node": 2, "cores_per_node": 2}}

``device``: what one rank's device does while every rank computes at once (so ranks that share cores
or a GPU see their share): ``matmul_tflops``, the rate of square ``--dtype`` matrix products of
``DEVICE_MATMUL`` (given to the planner as ``peak_tflops``), ``efficiency``: the share of that rate a
transformer block reaches (one ``hpctrain.models.gpt.Block`` of ``BLOCK_SHAPE`` timed forward +
backward: ``block_s``, read through the planner's own cost formula), ``optimizer_s_per_param``, the seconds of hpctrain's AdamW update
(``hpctrain.optim.flat.adamw_update_``) per parameter, and ``hbm_gbps``, the bytes per second of an element-wise update (read + write),
the slowest rank's; ``cores_per_node`` (CPU runs) lets the planner rescale the rate to another number
of ranks per node (ranks beyond the cores share them). ``name`` is ``cpu`` or ``cuda``'s device name (``hpctrain plan`` then takes the
preset of that name: give ``--device`` when it is not one).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch

from hpctrain.bench.comm import (OPS, _choices, default_iters, format_size, hpctrain_step, make_buffers,
                                 parse_size, time_step)
from hpctrain.config import OptimConfig
from hpctrain.errors import HpcTrainError
from hpctrain.optim.flat import adamw_update_
from hpctrain.plan.machine import wire_bytes  # the byte model the planner applies the fit with
from hpctrain.runtime.dtypes import torch_dtype

DEFAULT_SIZES = "4K,64K,256K,1M,4M,16M"
DEVICE_MATMUL = 512  # square matrix size of the device measurement (a transformer block's GEMMs are this order)


def _rate(work, seconds: float, sync, rounds: int = 3) -> float:
    """Calls of ``work`` per second: the best of ``rounds`` rounds of about ``seconds / rounds`` each,
    after a warm-up call (the best round: ranks sharing cores are descheduled now and then)."""
    import time

    work()
    sync()
    best = 0.0
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while True:
            work()
            calls += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / rounds:
                break
        best = max(best, calls / elapsed)
    return best


def measure_device(world, device: torch.device, dtype, seconds: float = 1.0) -> dict:
    """Per-rank matmul TFLOP/s and element-wise GB/s with every rank of ``world`` (a Communicator: its
    watchdog covers every wait) busy at once (the slowest rank's); see the module docstring."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = DEVICE_MATMUL
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    x = torch.randn(16 * 2**20, dtype=dtype, device=device)  # 64 MiB in float32: past the caches
    world.barrier()
    matmul = 2.0 * n**3 * _rate(lambda: torch.mm(a, b), seconds, sync) / 1e12
    world.barrier()
    stream = 2.0 * x.numel() * x.element_size() * _rate(lambda: x.mul_(1.0), seconds, sync) / 1e9
    world.barrier()
    n_adam = 8 * 2**20  # 4 x 32 MiB in float32: a model's optimizer state is far past the caches
    master, grad, m, v = (torch.randn(n_adam, dtype=dtype, device=device).abs() for _ in range(4))
    adam = OptimConfig()
    step = 1.0 / (n_adam * _rate(lambda: adamw_update_(master, grad, m, v, 1e-9, 1, adam), seconds, sync))
    del master, grad, m, v
    world.barrier()
    block_s = 1.0 / _rate(_block_step(device, dtype), seconds, sync)
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).lower()
    every = world.allgather_object((matmul, stream, step, block_s))
    slowest = {"matmul": min(r[0] for r in every), "stream": min(r[1] for r in every),
               "adamw": max(r[2] for r in every), "block": max(r[3] for r in every)}
    return {"name": name, "peak_tflops": slowest["matmul"], "hbm_gbps": slowest["stream"],
            "efficiency": block_efficiency(slowest["block"], slowest["matmul"], slowest["stream"], dtype),
            "matmul_tflops": slowest["matmul"], "matmul_size": n, "optimizer_s_per_param": slowest["adamw"],
            "block_s": slowest["block"], "block_shape": dict(BLOCK_SHAPE)}


# The transformer block timed by the device measurement (hpctrain.models.gpt.Block, forward + backward).
BLOCK_SHAPE = {"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "d_ff": 1024, "seq_len": 128, "micro_batch": 4}


def _block_model():
    from hpctrain.config import ModelConfig, resolve_model

    shape: dict[str, Any] = {k: v for k, v in BLOCK_SHAPE.items() if k not in ("seq_len", "micro_batch")}
    return resolve_model(ModelConfig(preset="custom", vocab_size=256, n_layers=1, **shape))


def _block_step(device: torch.device, dtype):
    """One forward + backward of one Block of BLOCK_SHAPE (its input [S, B, D])."""
    from hpctrain.models.gpt import Block

    block = Block("block", _block_model(), None, False, dtype, 0).to(device)
    x = torch.randn(BLOCK_SHAPE["seq_len"], BLOCK_SHAPE["micro_batch"], BLOCK_SHAPE["d_model"], dtype=dtype,
                    device=device, requires_grad=True)

    def step():
        block(x).sum().backward()
    return step


def block_efficiency(block_s: float, peak_tflops: float, hbm_gbps: float, dtype) -> float:
    """The matmul efficiency that makes the performance model (hpctrain/plan/cost.py: forward = FLOPs /
    (peak x efficiency) + 2 x activation bytes / bandwidth, backward twice that) reproduce the measured
    ``block_s``; capped to [0.05, 1]."""
    from hpctrain.config.arithmetic import block_matmul_parameters
    from hpctrain.plan.stages import layer_activation_bytes

    m, b, seq = _block_model(), BLOCK_SHAPE["micro_batch"], BLOCK_SHAPE["seq_len"]
    nbytes = torch.tensor([], dtype=dtype).element_size()
    flops = 2.0 * b * seq * block_matmul_parameters(m) + 2.0 * b * seq * seq * m.d_model  # causal (flash)
    memory_s = 2 * layer_activation_bytes(m, b, seq, 1, False, True, nbytes) / (hbm_gbps * 1e9)
    compute_s = block_s / 3 - memory_s
    if compute_s <= 0:
        return 1.0
    return min(1.0, max(0.05, flops / compute_s / (peak_tflops * 1e12)))



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


def measure(comm, mpi_world, op: str, sizes: list[int], dtype, rounds: int, iters: int,
            watch=None) -> list[tuple[int, float]]:
    """[(bytes, seconds)] for ``op`` on ``comm`` (a Communicator), every group of a level at once (best
    round, max over the ranks of ``mpi_world``, an mpi4py communicator)."""
    points = []
    for size in sizes:
        buffers, nbytes = make_buffers(op, size, comm.size, dtype)
        n = iters or default_iters(nbytes)
        step = hpctrain_step(op, comm, buffers)
        best = min(time_step(step, n, max(2, min(10, n // 10)), mpi_world, mpi_world, watch)
                   for _ in range(rounds))
        points.append((nbytes, best))
    return points


def run_link_profile(args) -> int:
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.runtime.launcher import discover

    ops = _choices(args.ops, OPS, "op")
    sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
    dtype, rounds = torch_dtype(args.dtype), max(1, args.rounds)
    torch.set_num_threads(1)
    info = discover()
    grid = ProcessGrid.build(info, timeout_s=args.comm_timeout)
    mpi_world = grid.world.mpi
    try:
        levels = levels_of(grid)
        if not levels:
            raise HpcTrainError("one rank: no link to profile; launch at least 2 ranks (2 per node for the "
                                "intra-node level, 2 nodes for the inter-node level)")
        doc = {"version": 1, "ranks": info.size, "nodes": info.num_nodes, "dtype": args.dtype,
               "mpi_library": info.mpi_library,
               "hostnames": sorted(set(grid.world.allgather_object(info.hostname))),
               "levels": {}, "collectives": {}}
        for level, comm in levels.items():
            pooled = []
            for op in ops:
                points = measure(comm, mpi_world, op, sizes, dtype, rounds, args.iters, grid.world)
                wire = [(wire_bytes(op, b, comm.size), s) for b, s in points]
                pooled += wire
                doc["collectives"].setdefault(op, {})[level] = {**fit_alpha_beta(wire), "points": points}
                if info.rank == 0:
                    done = ", ".join(f"{format_size(b)} {s * 1e6:.0f} us" for b, s in points)
                    print(f"bench comm --profile: {level} {op}: {done}", file=sys.stderr, flush=True)
            fit = fit_alpha_beta(pooled)
            groups = sum(grid.world.allgather_object(1 if comm.rank == 0 else 0))
            doc["levels"][level] = {**fit, "bandwidth_GBps": 1 / fit["beta_s_per_byte"] / 1e9
                                    if fit["beta_s_per_byte"] > 0 else None, "ranks": comm.size, "groups": groups}
        from hpctrain.runtime.device import select_device

        device = select_device(getattr(args, "device", "auto") or "auto", info)
        doc["device"] = {**measure_device(grid.world, device, dtype), "ranks_per_node": info.local_size,
                         "cores_per_node": len(os.sched_getaffinity(0)) if device.type == "cpu" else None}
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
    dev = doc.get("device")
    if dev:
        print(f"device {dev['name']}: {dev['matmul_tflops'] * 1e3:.1f} GFLOP/s matmul, {dev['hbm_gbps']:.1f} GB/s "
              f"element-wise per rank, {dev['ranks_per_node']} ranks per node busy at once")
