"""``hpctrain bench comm``: collectives timed side by side through hpctrain, raw mpi4py and gloo.

OSU / nccl-tests style. For every op and message size, in ONE job, on the same group of ranks and
the same buffers, each implementation runs ``warmup`` untimed and then ``iters`` timed iterations
after a barrier. A round's time is the max over ranks of the per-iteration mean; the reported time
is the best of ``rounds`` rounds (implementations interleaved per size, their order rotated each round).

Sizes are the total buffer (nccl-tests convention): the allreduce / broadcast tensor, the
reduce_scatter input, the allgather output, the message each rank sends in sendrecv (a ring: to
group rank+1, from rank-1), each rank's alltoall input (equal splits: size/n to every rank). algbw =
bytes / time; busbw = algbw * 2(n-1)/n for allreduce, (n-1)/n for reduce_scatter, allgather and
alltoall, 1 for broadcast and sendrecv. GB = 1e9 bytes.

Implementations: ``hpctrain`` = ``grid.comm(axis)``'s Communicator on torch tensors (watchdog and
counters included). ``mpi4py`` = the same group's mpi4py communicator on numpy views of the same
tensors (Allreduce(IN_PLACE), Reduce_scatter_block, Allgather, Bcast, Sendrecv, Alltoallv with its
counts and displacements built once); MPI has no
bfloat16, so for 16-bit dtypes it reduces the raw words as int16 (same bytes; hpctrain stages
reductions in float32, and the gap shows that cost). ``gloo`` = torch.distributed gloo over TCP
(rendezvous on rank 0, port broadcast over MPI) with one ``new_group`` per group of the axis. The
``alltoall`` op times the uneven path with equal splits: ``Communicator.alltoallv`` (counts and displacements
built per call; given the largest block, as the MoE dispatcher gives it, so blocks of 128 KiB or more go one
Isend/Irecv per peer), mpi4py ``Alltoallv``, gloo ``all_to_all_single`` with splits.
``hpctrain-shm`` = the node-local shared-memory collectives (hpctrain/comm/shm.py: an MPI-3 shared
window, each rank summing its slice out of its peers' slots; allreduce, reduce_scatter and allgather
only: the row is left out for other ops); a group spanning nodes goes hierarchical (comm/hierarchical.py,
through a Communicator as in training). ``hpctrain-persistent`` = the small-message path of the
training step (``Communicator.recurring_allreduce`` / ``recurring_broadcast``: an MPI-4 persistent
request built once per buffer, hpctrain/comm/persistent.py); allreduce and broadcast only.
``hpctrain-auto`` = a second Communicator of the group set up as training's ``comm.intra_node = auto``
(hpctrain/comm/routes.py: each op and size class through shared memory or MPI, whichever measured faster
on this node, the table cached; its summary is printed first); every op.
Host (CPU) tensors only.
"""
from __future__ import annotations

import contextlib

import re
import socket
import sys
import time
from datetime import timedelta

import torch

from hpctrain.bench.report import write_records
from hpctrain.errors import HpcTrainError
from hpctrain.runtime import env
from hpctrain.runtime.dtypes import torch_dtype

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "sendrecv", "alltoall")
IMPLS = ("hpctrain", "hpctrain-persistent", "hpctrain-shm", "hpctrain-auto", "mpi4py", "gloo")
FIELDS = ("impl", "op", "bytes", "time_us", "algbw_GBps", "busbw_GBps", "ratio_vs_mpi4py", "ranks", "axis",
          "group_size", "dtype", "iters", "rounds")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_HALF = (torch.bfloat16, torch.float16)


def parse_size(text: str) -> int:
    """``"1K"`` -> 1024, ``"16M"`` -> 16 MiB, ``"4096"`` -> 4096 (binary units; ``KiB``/``KB`` accepted)."""
    match = re.fullmatch(r"(\d+)\s*([KMG]?)(I?B)?", text.strip().upper())
    if not match or int(match.group(1)) == 0:
        raise HpcTrainError(f"bad message size {text!r}: use e.g. 1024, 1K, 64K, 16M, 1G (binary units)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def default_iters(nbytes: int) -> int:
    """200 iterations at <= 1 MiB down to 5 at >= 64 MiB (about 256 MiB moved per round)."""
    return max(5, min(200, (256 << 20) // nbytes))


def bus_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "allgather", "alltoall"):
        return (n - 1) / n
    return 1.0


def _choices(text: str, allowed: tuple, what: str) -> list[str]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    bad = [c for c in chosen if c not in allowed]
    if bad or not chosen:
        raise HpcTrainError(f"unknown {what}(s) {bad or text!r}: choose from {', '.join(allowed)}")
    return chosen


def make_buffers(op: str, nbytes: int, n: int, dtype) -> tuple[dict, int]:
    """Zero-filled buffers for one op (zeros: sums never overflow or go denormal); (buffers, bytes)."""
    esize = torch.empty((), dtype=dtype).element_size()
    if op in ("reduce_scatter", "allgather"):
        per = max(1, nbytes // (esize * n))
        return {"big": torch.zeros(per * n, dtype=dtype), "small": torch.zeros(per, dtype=dtype)}, per * n * esize
    if op == "alltoall":  # equal splits: ``per`` elements to every rank
        per = max(1, nbytes // (esize * n))
        return {"send": torch.zeros(per * n, dtype=dtype), "recv": torch.zeros(per * n, dtype=dtype)}, per * n * esize
    count = max(1, nbytes // esize)
    if op == "sendrecv":
        return {"send": torch.zeros(count, dtype=dtype), "recv": torch.zeros(count, dtype=dtype)}, count * esize
    return {"t": torch.zeros(count, dtype=dtype)}, count * esize


def hpctrain_step(op: str, comm, b: dict):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if op == "allreduce":
        return lambda: comm.allreduce(b["t"])
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(b["small"], b["big"])
    if op == "allgather":
        return lambda: comm.allgather(b["big"], b["small"])
    if op == "broadcast":
        return lambda: comm.broadcast(b["t"], root=0)
    if op == "alltoall":
        per = b["send"].numel() // comm.size
        splits = [per] * comm.size  # equal splits: every rank knows the largest block, as the MoE dispatcher does
        return lambda: comm.alltoallv(b["recv"], splits, b["send"], splits, largest_block=per)

    def sendrecv():
        handles = (comm.irecv(b["recv"], left), comm.isend(b["send"], right))
        for handle in handles:
            handle.wait()
    return sendrecv


def persistent_step(op: str, comm, b: dict):
    """``hpctrain-persistent``: a Recurring op on the buffer (building it is collective); None for other
    ops, and where the Recurring would not be a persistent request (16-bit dtypes: the ordinary path)."""
    if op not in ("allreduce", "broadcast"):
        return None
    step = comm.recurring_allreduce(b["t"]) if op == "allreduce" else comm.recurring_broadcast(b["t"], root=0)
    return step if step.lean else None


def shm_step(op: str, shm, b: dict):
    """``hpctrain-shm``: None for ops (and bfloat16) the shared-memory path does not implement (no row)."""
    if b[next(iter(b))].dtype == torch.bfloat16:
        return None
    if op == "allreduce":
        return lambda: shm.allreduce(b["t"])
    if op == "reduce_scatter":
        return lambda: shm.reduce_scatter(b["small"], b["big"])
    if op == "allgather":
        return lambda: shm.allgather(b["big"], b["small"])
    return None


def auto_communicator(grid, axis: str):
    """Collective over the world: (a Communicator of the ``axis`` group routed as comm.intra_node=auto routes
    the dp group, the ``RouteChoice``); close the Communicator (collective) when done."""
    from hpctrain.comm.collectives import Communicator
    from hpctrain.comm.intra_node import route_intra_node

    comm = grid.comm(axis)
    routed = Communicator(comm.mpi, comm.name, comm.members, grid.watchdog, grid.stats, comm.backend_choice)
    return routed, route_intra_node(routed, grid.world, "auto")


def mpi4py_step(op: str, mpi_comm, b: dict):
    from mpi4py import MPI

    v = {k: (t.view(torch.int16) if t.dtype in _HALF else t).numpy() for k, t in b.items()}
    n, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
    if op == "allreduce":
        return lambda: mpi_comm.Allreduce(MPI.IN_PLACE, v["t"], MPI.SUM)
    if op == "reduce_scatter":
        return lambda: mpi_comm.Reduce_scatter_block(v["big"], v["small"], MPI.SUM)
    if op == "allgather":
        return lambda: mpi_comm.Allgather(v["small"], v["big"])
    if op == "broadcast":
        return lambda: mpi_comm.Bcast(v["t"], 0)
    if op == "alltoall":
        per = v["send"].size // n
        counts, displs = [per] * n, [per * j for j in range(n)]
        return lambda: mpi_comm.Alltoallv([v["send"], (counts, displs)], [v["recv"], (counts, displs)])
    return lambda: mpi_comm.Sendrecv(v["send"], (r + 1) % n, 0, v["recv"], (r - 1) % n, 0)


def gloo_step(op: str, group, members: tuple, b: dict):
    import torch.distributed as dist

    i, n = members.index(dist.get_rank()), len(members)
    if op == "allreduce":
        return lambda: dist.all_reduce(b["t"], group=group)
    if op == "reduce_scatter":
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: reduce_scatter(b["small"], b["big"], group=group)
    if op == "allgather":
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: all_gather(b["big"], b["small"], group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(b["t"], src=members[0], group=group)
    if op == "alltoall":
        splits = [b["send"].numel() // n] * n
        return lambda: dist.all_to_all_single(b["recv"], b["send"], splits, splits, group=group)

    def sendrecv():
        ops = [dist.P2POp(dist.irecv, b["recv"], members[(i - 1) % n], group),
               dist.P2POp(dist.isend, b["send"], members[(i + 1) % n], group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return sendrecv


def init_gloo_world(mpi_world, info, timeout_s: float = 600.0) -> None:
    """torch.distributed gloo over ``mpi_world`` (the peer of the benchmarks): rank 0 picks the address
    (``HPCTRAIN_GLOO_ADDR``, else loopback on one node, else its hostname's) and a free port, and
    broadcasts them over MPI."""
    import torch.distributed as dist

    endpoint = None
    if info.rank == 0:
        addr = env.gloo_addr() or "127.0.0.1"
        if info.num_nodes > 1 and env.gloo_addr() is None:
            try:
                addr = socket.gethostbyname(socket.gethostname())
            except OSError:
                pass
        with socket.socket() as s:
            s.bind((addr, 0))
            endpoint = (addr, s.getsockname()[1])
    addr, port = mpi_world.bcast(endpoint, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=info.rank, world_size=info.size,
                            timeout=timedelta(seconds=timeout_s))


def init_gloo(mpi_world, info, comm, timeout_s: float):
    """gloo over ``mpi_world``; returns the gloo group matching ``comm`` (a Communicator; None = world)."""
    import torch.distributed as dist

    init_gloo_world(mpi_world, info, timeout_s)
    if comm.size == info.size:
        return None
    mine = None
    for members in sorted(set(mpi_world.allgather(comm.members))):  # every rank creates every group, same order
        group = dist.new_group(list(members))
        if info.rank in members:
            mine = group
    return mine


def time_step(step, iters: int, warmup: int, mpi_group, mpi_world, watch=None) -> float:
    """Seconds per iteration: max over ranks (of ``mpi_world``) of the mean over ``iters`` (after warmup and
    a barrier of ``mpi_group``; both mpi4py communicators).
    ``watch``: a Communicator whose watchdog covers the raw barrier and the reduction of the result (a
    stopped or dead rank then ends the job with a hang report instead of a hang)."""
    from mpi4py import MPI

    for _ in range(warmup):
        step()
    with watch.watched("bench barrier") if watch is not None else contextlib.nullcontext():
        mpi_group.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = (time.perf_counter() - start) / iters
    with watch.watched("bench result") if watch is not None else contextlib.nullcontext():
        return mpi_world.allreduce(elapsed, op=MPI.MAX)


def run_comm_bench(args) -> int:
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.runtime.launcher import discover

    ops, impls = _choices(args.ops, OPS, "op"), _choices(args.impls, IMPLS, "impl")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    dtype, rounds = torch_dtype(args.dtype), max(1, getattr(args, "rounds", 3))
    torch.set_num_threads(1)
    info = discover()
    grid = ProcessGrid.build(info, tp=args.tp, pp=args.pp, timeout_s=args.comm_timeout)
    comm, mpi_world = grid.comm(args.axis), grid.world.mpi
    if comm.size < 2:
        grid.close()
        raise HpcTrainError(f"axis {args.axis!r} has {comm.size} rank per group: nothing to benchmark; "
                            f"launch more ranks or pick another axis / --tp / --pp")
    gloo_group = init_gloo(mpi_world, info, comm, grid.watchdog.timeout_s or 600) if "gloo" in impls else None
    shm = grid.shm_collectives(args.axis) if "hpctrain-shm" in impls else None  # across nodes: hierarchical
    auto, choice = auto_communicator(grid, args.axis) if "hpctrain-auto" in impls else (None, None)
    if choice is not None and info.rank == 0:
        print(f"bench comm: hpctrain-auto routes {choice.kind}{choice.note()} ({choice.source or 'no table'})",
              file=sys.stderr, flush=True)
    builders = {"hpctrain": lambda op, b: hpctrain_step(op, comm, b),
                "hpctrain-persistent": lambda op, b: persistent_step(op, comm, b),
                "hpctrain-shm": lambda op, b: shm_step(op, shm, b),
                "hpctrain-auto": lambda op, b: hpctrain_step(op, auto, b),
                "mpi4py": lambda op, b: mpi4py_step(op, comm.mpi, b),
                "gloo": lambda op, b: gloo_step(op, gloo_group, comm.members, b)}
    records = []
    try:
        for op in ops:
            for size in sizes:
                buffers, nbytes = make_buffers(op, size, comm.size, dtype)
                iters = args.iters or default_iters(nbytes)
                warmup = max(2, min(10, iters // 10))
                steps = {impl: builders[impl](op, buffers) for impl in impls}
                here = [impl for impl in impls if steps[impl] is not None]
                best = {impl: float("inf") for impl in here}
                for rnd in range(rounds):
                    k = rnd % len(here)
                    for impl in here[k:] + here[:k]:
                        best[impl] = min(best[impl], time_step(steps[impl], iters, warmup, comm.mpi, mpi_world,
                                                                      grid.world))
                for impl in here:
                    algbw = nbytes / best[impl] / 1e9
                    records.append({"impl": impl, "op": op, "bytes": nbytes, "time_us": best[impl] * 1e6,
                                    "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, comm.size),
                                    "ratio_vs_mpi4py": best["mpi4py"] / best[impl] if "mpi4py" in best else None,
                                    "ranks": info.size, "axis": args.axis, "group_size": comm.size,
                                    "dtype": args.dtype, "iters": iters, "rounds": rounds})
                if info.rank == 0:
                    times = ", ".join(f"{i} {best[i] * 1e6:.1f} us" for i in here)
                    print(f"bench comm: {op} {format_size(nbytes)}: {times}", file=sys.stderr, flush=True)
                del steps, buffers
    finally:
        if "gloo" in impls:
            import torch.distributed as dist
            dist.destroy_process_group()
        if shm is not None:
            shm.close()
        if auto is not None:
            auto.close()
        grid.close()
    if info.rank == 0:
        title = (f"hpctrain bench comm: {info.size} ranks on {info.num_nodes} node(s), axis {args.axis} "
                 f"(group size {comm.size}), {args.dtype}, best of {rounds} round(s); {info.mpi_library}")
        print_table(records, title)
        write_records(records, args.json, args.csv, FIELDS)
    return 0


def print_table(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for name in ("op", "size", "impl", "time_us", "algbw GB/s", "busbw GB/s", "ratio vs mpi4py"):
        table.add_column(name, justify="left" if name in ("op", "impl") else "right")
    for i, r in enumerate(records):
        ratio = "-" if r["ratio_vs_mpi4py"] is None else f"{r['ratio_vs_mpi4py']:.2f}x"
        last = i + 1 == len(records) or (records[i + 1]["op"], records[i + 1]["bytes"]) != (r["op"], r["bytes"])
        table.add_row(r["op"], format_size(r["bytes"]), r["impl"], f"{r['time_us']:.1f}",
                      f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}", ratio, end_section=last)
    print(title, flush=True)
    Console(width=None if sys.stdout.isatty() else 120).print(table)
