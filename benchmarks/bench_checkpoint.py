#!/usr/bin/env python
"""Checkpoint I/O: hpctrain's writers and reader vs dd and torch.save/torch.load; async-save stall; restart time.

    mpiexec -n 4 python benchmarks/bench_checkpoint.py --mib-per-rank 64 --json ckpt_4.json --csv ckpt_4.csv
    # with parallel HDF5 (adds the mpio writer; see scripts/setup_parallel_hdf5.sh):
    PYTHONPATH=$PWD mpiexec.mpich -n 4 ~/.cache/hpctrain/venv-mpi/bin/python benchmarks/bench_checkpoint.py

One MPI job measures, on the same ranks and the same directory (``--dir``, default a new directory under
$TMPDIR or /tmp; it must be shared by all ranks when they span nodes):

I/O (a synthetic snapshot of ``--mib-per-rank`` MiB per rank: ``Snapshot`` objects of ``WriteItem``s, exactly
what the writers consume — 3 x ``--tensors`` float32 datasets (model, exp_avg, exp_avg_sq) of global shape
[ranks x rows, --cols], each rank owning one block of rows, like a ZeRO-1 optimizer's slices; its root
attributes are those of a real ``snapshot()`` of a ``--model`` Trainer with dp = ranks, ZeRO-1)
    dd              write  ``dd if=/dev/zero of=FILE bs=16M count=BYTES iflag=count_bytes conv=fdatasync``
                           per rank (same bytes); read ``dd if=FILE of=/dev/null bs=16M``
    torch.save      write  per rank, ``torch.save`` of the same arrays (as tensors) + fsync
    torch.load      read   per rank, ``torch.load`` of that file
    hpctrain-shards write  ``write_shards`` + fsync of every file it returns (the manager's write step)
                    save   ``CheckpointManager.save_snapshot``: the sync save minus the snapshot: write + fsync
                           + distributed verification (read-back + CRC-32) + publish (COMPLETE, rename,
                           ``latest``, prune)
                    read   ``CheckpointReader.read`` of every box of the manifest (each rank its own boxes)
    hpctrain-mpio   the same with ``write_mpio`` (only when h5py is built with MPI)
Every phase starts after a barrier; a phase's time is the max over ranks (the last rank to finish);
GB/s = bytes of all ranks / that time (GB = 1e9 B); ``vs dd`` = GB/s / dd's GB/s of the same direction.
Each phase runs ``--repeats`` times, the implementations' order rotated every round; the median is
reported (with min-max). Before every read, the pages of the files to read are evicted from the page
cache with ``posix_fadvise(DONTNEED)`` (after fsync), so reads come from the disk, as after a restart.

Async save (a real ``Trainer`` of ``--model`` with ZeRO-1 over all ranks, and a ``CheckpointManager``)
    sync save   ``manager.save(trainer.state, sync=True)``: snapshot + write + fsync + verify + publish
    async stall ``manager.save(trainer.state)`` with ``checkpoint.async=true``: the time the caller is blocked
                (the host snapshot and starting the background thread); target <= 5% of the sync save
    background  the background save's own duration while training runs, and ``save`` + ``wait`` with the
                main thread idle (the thread's cost without competition for CPU and GIL)
    step time   training steps while the background save runs vs steps without one (median each)
Restart (in the same, already warm, process)
    build       ProcessGrid + Trainer (tokens already loaded)
    resume      ``CheckpointManager.resume`` ("auto": open, read + CRC of the bytes loaded, verify
                of boxes no rank loaded, apply, agree: every byte read once)
    first step  the first ``train_step`` after resume vs the first step of a fresh Trainer
    startup     process start (from /proc) -> imports and MPI initialised, measured once

Diagnosis: ``--switch-interval S`` (Python's GIL hand-over interval), ``--sleeping-waits`` (every manager is
built with ``poll_sleep_s=0.001``: its agreements between ranks wait in Ibarrier + sleep instead of MPI's busy
polling), ``--parts``, ``--writers``.

Phase breakdowns come from the package's own timers: ``CheckpointManager.last_phases`` (prepare, write,
fsync, verify, publish, agree of a save; open, read + CRC, verify, apply, agree of a resume) and the
trainer's ``checkpoint`` phase (the blocking part of a save); ``CheckpointManager.pending`` says whether a
background save still runs. The benchmark uses only these public hooks: nothing in the package is patched.
Rank 0 prints the tables and writes ``--json`` / ``--csv`` records: impl, op, ranks, bytes, seconds,
GBps, ratio_vs_dd (I/O rows), ratio + ratio_to (other rows), min/max, phases.
"""
from __future__ import annotations

import os
import time

_WALL_AT_IMPORT = time.time()
_UPTIME_AT_IMPORT = None
try:  # process start -> now, from the kernel's clock (10 ms resolution)
    with open("/proc/uptime", encoding="ascii") as _f:
        _UPTIME_AT_IMPORT = float(_f.read().split()[0])
    with open("/proc/self/stat", encoding="ascii") as _f:
        _START_TICKS = int(_f.read().rsplit(")", 1)[1].split()[19])
    _PROCESS_AGE_AT_IMPORT = _UPTIME_AT_IMPORT - _START_TICKS / os.sysconf("SC_CLK_TCK")
except (OSError, ValueError, IndexError):
    _PROCESS_AGE_AT_IMPORT = None

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain.bench.report import run_benchmark, write_records  # noqa: E402
from hpctrain.checkpoint.directory import fsync_path  # noqa: E402

_STARTUP_S = (_PROCESS_AGE_AT_IMPORT + time.time() - _WALL_AT_IMPORT) if _PROCESS_AGE_AT_IMPORT is not None else None

FIELDS = ["impl", "op", "ranks", "bytes", "seconds", "GBps", "ratio_vs_dd", "ratio", "ratio_to", "seconds_min",
          "seconds_max", "repeats", "phases"]
MiB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib-per-rank", type=float, default=64.0, help="synthetic snapshot size per rank (default 64)")
    p.add_argument("--tensors", type=int, default=32, help="2-D tensors per kind (3 kinds) in the synthetic "
                                                           "snapshot (default 32: 96 datasets)")
    p.add_argument("--cols", type=int, default=1024, help="columns of each synthetic tensor (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every I/O phase (default 3; median reported)")
    p.add_argument("--writers", default="auto",
                   help="comma list of shards, mpio; auto = shards, plus mpio when h5py has MPI")
    p.add_argument("--parts", default="io,async,restart", help="comma list of io, async, restart (default all)")
    p.add_argument("--model", default="small", help="model preset of the Trainer for async/restart (default small)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=0, help="sequences per step (default 2 x ranks)")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus bytes to load (default 1 MB)")
    p.add_argument("--async-repeats", type=int, default=3, help="sync/async save pairs (default 3)")
    p.add_argument("--base-steps", type=int, default=3, help="steps without a background save per round")
    p.add_argument("--max-overlap-steps", type=int, default=50, help="cap on steps run while a save is pending")
    p.add_argument("--trainer-writer", default="auto", choices=("auto", "shards", "mpio"),
                   help="checkpoint.writer of the Trainer's manager (default auto)")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="diagnosis: sys.setswitchinterval(S) (Python's GIL hand-over, default 0.005 s)")
    p.add_argument("--sleeping-waits", action="store_true",
                   help="diagnosis: CheckpointManager(poll_sleep_s=0.001): the managers' agreements first wait "
                        "in Ibarrier + 1 ms sleeps (instead of MPI's busy polling inside their allgather), to "
                        "measure what polling costs a background save")
    p.add_argument("--dir", help="where to write (default: a new directory under $TMPDIR or /tmp, removed after)")
    p.add_argument("--keep-files", action="store_true", help="do not remove the files written")
    p.add_argument("--json", metavar="FILE", help="write records to FILE (JSON list)")
    p.add_argument("--csv", metavar="FILE", help="write records to FILE (CSV)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- helpers
PHASE_ORDER = ["stall (wait + snapshot)", "prepare", "write", "fsync", "verify", "publish", "open", "read + CRC",
               "apply", "agree", "other"]  # CheckpointManager.last_phases (hpctrain/checkpoint/manager.py)


def new_manager(args, ckpt_cfg, grid, run_dir):
    """A CheckpointManager; ``--sleeping-waits`` sets its documented ``poll_sleep_s`` hook."""
    from hpctrain.checkpoint.manager import CheckpointManager

    return CheckpointManager(ckpt_cfg, grid, run_dir, poll_sleep_s=0.001 if args.sleeping_waits else 0.0)


def timed(comm, fn, *args, **kwargs) -> tuple[float, object]:
    """Barrier, run ``fn`` on every rank; (max over ranks of its seconds, this rank's result)."""
    comm.Barrier()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX), result


def gather_phases(comm, phases: dict) -> list[dict]:
    """Every rank's phases (collective)."""
    return comm.allgather(dict(phases))


def summarize_phases(runs: list[list[dict]]) -> tuple[dict, list[dict]]:
    """``runs``: per run, per rank, phase -> seconds. Returns (median over runs of the max over ranks,
    per rank the median over runs), in PHASE_ORDER (ranks without a phase count as 0)."""
    names = sorted({n for run in runs for ranks in run for n in ranks},
                   key=lambda n: (PHASE_ORDER.index(n) if n in PHASE_ORDER else len(PHASE_ORDER), n))
    worst = {n: statistics.median(max(r.get(n, 0.0) for r in run) for run in runs) for n in names}
    by_rank = [{n: statistics.median(run[k].get(n, 0.0) for run in runs) for n in names}
               for k in range(len(runs[0]))]
    return worst, by_rank


def drop_cache(paths) -> None:
    """Evict the (already fsynced) files' pages from the page cache, so the next read hits the disk."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def clean_dir(comm, path: str, subdirs=()) -> None:
    """Rank 0 (re)creates ``path`` (and subdirs) empty; everyone waits."""
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        for sub in subdirs:
            os.makedirs(os.path.join(path, sub))
    comm.Barrier()


# --------------------------------------------------------------------------- synthetic snapshot
def synthetic_snapshot(rank: int, world: int, target_bytes: int, tensors: int, cols: int, attrs: dict,
                       step: int = 1):
    """3 x ``tensors`` float32 datasets [world*rows, cols]; this rank owns rows [rank*rows, (rank+1)*rows).
    ``attrs``: root attributes of a real snapshot (``checkpoint_attrs``), the step replaced."""
    from hpctrain.checkpoint.format import Box
    from hpctrain.checkpoint.transfer import Snapshot, WriteItem

    kinds = ("model", "optim/exp_avg", "optim/exp_avg_sq")
    rows = max(1, int(target_bytes) // (len(kinds) * tensors * cols * 4))
    rng = np.random.default_rng(1000 + rank)
    snap = Snapshot(step, {})
    for kind in kinds:
        for t in range(tensors):
            name = f"{kind}/layers.{t}.weight"
            snap.datasets[name] = ((world * rows, cols), "<f4")
            data = rng.standard_normal((rows, cols), dtype=np.float32)
            snap.items.append(WriteItem(name, Box((rank * rows, 0), (rows, cols)), data))
    snap.attrs = {**attrs, "step": step}
    return snap


def checkpoint_attrs(cfg, tokens) -> dict:
    """The root attributes ``hpctrain.checkpoint.transfer.snapshot`` gives a fresh Trainer of ``cfg`` (collective)."""
    from hpctrain.checkpoint.transfer import snapshot

    trainer = new_trainer(cfg, tokens)
    attrs = dict(snapshot(trainer.state).attrs)
    trainer.grid.close()
    return attrs


def snapshot_bytes(snap) -> int:
    return sum(item.data.nbytes for item in snap.items)


# --------------------------------------------------------------------------- I/O implementations
class DdImpl:
    impl = "dd"

    def __init__(self, directory, rank, nbytes):
        self.path = os.path.join(directory, f"dd-{rank:05d}.bin")
        self.nbytes = nbytes

    def prepare(self, comm):  # no truncation of an old file inside the timing
        if os.path.exists(self.path):
            os.remove(self.path)
        comm.Barrier()

    def write(self):
        subprocess.run(["dd", "if=/dev/zero", f"of={self.path}", "bs=16M", f"count={self.nbytes}",
                        "iflag=count_bytes", "conv=fdatasync"], check=True, capture_output=True)
        return [self.path]

    def read(self):
        subprocess.run(["dd", f"if={self.path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)


class TorchImpl:
    impl = "torch.save"

    def __init__(self, directory, rank, snap):
        self.path = os.path.join(directory, f"torch-{rank:05d}.pt")
        self.state = {f"{item.dataset}@{','.join(map(str, item.box.offset))}": torch.from_numpy(item.data)
                      for item in snap.items}

    prepare = DdImpl.prepare

    def write(self):
        torch.save(self.state, self.path)
        fsync_path(self.path)
        return [self.path]

    def read(self):
        loaded = torch.load(self.path, weights_only=True)
        assert len(loaded) == len(self.state)
        return loaded


class HpcTrainImpl:
    """One of hpctrain's writers, called as the manager calls it (its checkpoint communicator, then fsync)."""

    def __init__(self, writer, manager, directory, snap):
        from hpctrain.checkpoint import writers

        self.writer, self.manager, self.snap = writer, manager, snap
        self.impl = f"hpctrain-{writer}"
        self.fn = writers.write_mpio if writer == "mpio" else writers.write_shards
        self.dir = os.path.join(directory, f"hpctrain-{writer}")
        self.files: list[str] = []

    def prepare(self, comm):
        clean_dir(comm, self.dir, ["shards"])

    def write(self):
        self.files = self.fn(self.manager.comm, self.dir, self.snap)
        for path in self.files:
            fsync_path(path)
        return self.files

    def read(self):
        from hpctrain.checkpoint.reader import CheckpointReader

        with CheckpointReader(self.dir) as reader:
            return [reader.read(item.dataset, item.box) for item in self.snap.items]

    def check(self, arrays) -> None:
        for item, array in zip(self.snap.items, arrays):
            if not np.array_equal(item.data, array):
                raise AssertionError(f"{self.impl}: {item.dataset} box {item.box} read back differs")


def record(impl, op, ranks, nbytes, times, *, phase_runs=None, ratio=None, ratio_to=None) -> dict:
    median = statistics.median(times)
    phases, by_rank = summarize_phases(phase_runs) if phase_runs else ({}, [])
    return {"impl": impl, "op": op, "ranks": ranks, "bytes": int(nbytes), "seconds": median,
            "GBps": nbytes / median / 1e9 if nbytes and median > 0 else None, "ratio_vs_dd": None,
            "ratio": ratio, "ratio_to": ratio_to, "seconds_min": min(times), "seconds_max": max(times),
            "repeats": len(times), "phases": phases, "phases_by_rank": by_rank}


def run_io(args, comm, grid, base_dir, writers, attrs) -> list[dict]:
    from hpctrain.config import CheckpointConfig

    rank, size = comm.Get_rank(), comm.Get_size()
    snap = synthetic_snapshot(rank, size, int(args.mib_per_rank * MiB), args.tensors, args.cols, attrs)
    mine = snapshot_bytes(snap)
    total = comm.allreduce(mine, op=MPI.SUM)
    io_dir = os.path.join(base_dir, "io")
    clean_dir(comm, io_dir)
    managers = {w: new_manager(args, CheckpointConfig(keep=1, async_=False, writer=w,
                                                      dir=os.path.join(base_dir, f"save-{w}")), grid, base_dir)
                for w in writers}
    impls = [DdImpl(io_dir, rank, mine), TorchImpl(io_dir, rank, snap)] + \
        [HpcTrainImpl(w, managers[w], io_dir, snap) for w in writers]
    if rank == 0:
        print(f"bench_checkpoint: I/O: {size} ranks x {mine / MiB:.1f} MiB ({len(snap.items)} boxes per rank), "
              f"{total / MiB:.0f} MiB per write, {args.repeats} rounds, in {base_dir}", file=sys.stderr, flush=True)
    times = defaultdict(list)
    save_phases = defaultdict(list)
    for rnd in range(args.repeats):
        k = rnd % len(impls)
        order = impls[k:] + impls[:k]
        written = {}
        for impl in order:  # writes (fsync included)
            impl.prepare(comm)
            seconds, files = timed(comm, impl.write)
            times[(impl.impl, "write")].append(seconds)
            written[impl.impl] = files
        for impl in order:  # reads from the disk
            drop_cache(written[impl.impl])
            comm.Barrier()
            seconds, result = timed(comm, impl.read)
            name = "torch.load" if impl.impl == "torch.save" else impl.impl
            times[(name, "read")].append(seconds)
            if rnd == 0 and isinstance(impl, HpcTrainImpl):
                impl.check(result)
            del result
        for writer in (writers[k % len(writers):] + writers[:k % len(writers)]) if writers else []:
            # the full protocol: what CheckpointManager.save does after the snapshot
            mgr = managers[writer]
            snap.step = rnd + 1
            seconds, _ = timed(comm, mgr.save_snapshot, snap)
            times[(f"hpctrain-{writer}", "save")].append(seconds)
            save_phases[writer].append(gather_phases(comm, mgr.last_phases))
        if rank == 0:
            done = ", ".join(f"{impl} {op} {total / statistics.median(t) / 1e9:.2f} GB/s"
                             for (impl, op), t in times.items())
            print(f"bench_checkpoint: round {rnd + 1}/{args.repeats}: {done}", file=sys.stderr, flush=True)
    records = []
    for (impl, op), t in times.items():
        runs = save_phases[impl.split("-", 1)[1]] if op == "save" else None
        records.append(record(impl, op, size, total, t, phase_runs=runs))
    for direction, ops in (("write", ("write", "save")), ("read", ("read",))):
        dd = next(r for r in records if r["impl"] == "dd" and r["op"] == direction)
        for r in records:
            if r["op"] in ops:
                r["ratio_vs_dd"] = r["GBps"] / dd["GBps"]
    for mgr in managers.values():
        mgr.close()
    return records


# --------------------------------------------------------------------------- Trainer: async stall, restart
def trainer_config(args, size, run_dir, tokens_bytes):
    from hpctrain.config import load_config

    batch = args.global_batch or 2 * size
    return load_config(None, [f"model.preset={args.model}", f"train.seq_len={args.seq_len}",
                              f"train.global_batch={batch}", f"parallel.dp={size}", "parallel.tp=1", "parallel.pp=1",
                              "parallel.zero=1", "train.steps=100000", "train.progress=false",
                              f"train.run_dir={run_dir}", f"data.max_bytes={tokens_bytes}", "checkpoint.async=true",
                              f"checkpoint.writer={args.trainer_writer}", "checkpoint.keep=2"])


def new_trainer(cfg, tokens):
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    grid = ProcessGrid.from_config(cfg, discover())
    return Trainer(cfg, grid, tokens=tokens)


def timed_step(comm, trainer) -> float:
    seconds, _ = timed(comm, trainer.train_step)
    return seconds


def run_async(args, comm, cfg, tokens) -> tuple[list[dict], object]:
    from hpctrain.checkpoint.transfer import snapshot
    from hpctrain.models.gpt import count_parameters

    size, rank = comm.Get_size(), comm.Get_rank()
    trainer = new_trainer(cfg, tokens)
    mgr = new_manager(args, cfg.checkpoint, trainer.grid, cfg.train.run_dir)
    ckpt_bytes = comm.allreduce(snapshot_bytes(snapshot(trainer.state)), op=MPI.SUM)
    if rank == 0:
        print(f"bench_checkpoint: async: Trainer {args.model} ({count_parameters(trainer.parts.model_cfg) / 1e6:.2f} M "
              f"params), ZeRO-1 over {size} ranks, {mgr.writer} writer, checkpoint {ckpt_bytes / MiB:.1f} MiB",
              file=sys.stderr, flush=True)
    for _ in range(2):  # warm-up
        timed_step(comm, trainer)
    sync_s, stall_s, base_steps, overlap_steps, bg_s, idle_s = [], [], [], [], [], []
    sync_phases, stall_phases, bg_phases = [], [], []
    timer = trainer.parts.timer  # the save's blocking part is its "checkpoint" phase; the rest: mgr.last_phases
    for rnd in range(args.async_repeats):
        base_steps += [timed_step(comm, trainer) for _ in range(args.base_steps)]
        seconds, _ = timed(comm, mgr.save, trainer.state, sync=True)
        timer.take("checkpoint")
        sync_s.append(seconds)
        sync_phases.append(gather_phases(comm, mgr.last_phases))
        timed_step(comm, trainer)  # a step between the saves (a new step number)
        seconds, _ = timed(comm, mgr.save, trainer.state)  # returns once the snapshot is taken
        stall_s.append(seconds)
        stall_phases.append(gather_phases(comm, {"stall (wait + snapshot)": timer.take("checkpoint")}))
        n = 0
        while n < args.max_overlap_steps:
            if not comm.allreduce(int(mgr.pending), op=MPI.MAX):
                break
            overlap_steps.append(timed_step(comm, trainer))
            n += 1
        mgr.wait()
        bg_s.append(comm.allreduce(mgr.last_save_s or 0.0, op=MPI.MAX))  # the background thread's whole save
        bg_phases.append(gather_phases(comm, mgr.last_phases))
        timed_step(comm, trainer)
        idle_s.append(timed(comm, lambda: (mgr.save(trainer.state), mgr.wait()))[0])  # the thread alone
        timer.take("checkpoint")
        if rank == 0:
            print(f"bench_checkpoint: async round {rnd + 1}/{args.async_repeats}: sync save {sync_s[-1]:.3f} s, "
                  f"async stall {stall_s[-1] * 1e3:.1f} ms, background save {bg_s[-1]:.3f} s over {n} steps",
                  file=sys.stderr, flush=True)
    sync = record("hpctrain", "sync save (Trainer)", size, ckpt_bytes, sync_s,
                  phase_runs=sync_phases)
    stall = record("hpctrain", "async save: stall", size, ckpt_bytes, stall_s,
                   phase_runs=stall_phases,
                   ratio=statistics.median(stall_s) / statistics.median(sync_s), ratio_to="sync save")
    stall["GBps"] = None
    bg = record("hpctrain", "async save: background write", size, ckpt_bytes, bg_s,
                phase_runs=bg_phases,
                ratio=statistics.median(bg_s) / statistics.median(sync_s), ratio_to="sync save")
    idle = record("hpctrain", "async save + wait, no training", size, ckpt_bytes, idle_s,
                  ratio=statistics.median(idle_s) / statistics.median(sync_s), ratio_to="sync save")
    base = record("hpctrain", "train step, no save pending", size, 0, base_steps)
    records = [sync, stall, bg, idle, base]
    if overlap_steps:
        records.append(record("hpctrain", "train step, save pending", size, 0, overlap_steps,
                              ratio=statistics.median(overlap_steps) / statistics.median(base_steps),
                              ratio_to="step, no save pending"))
    mgr.close()
    trainer.grid.close()
    return records, ckpt_bytes


def run_restart(args, comm, cfg, tokens, ckpt_bytes) -> list[dict]:
    size = comm.Get_size()
    build, first_fresh, resume, first_resumed = [], [], [], []
    resume_phases = []
    for rnd in range(args.repeats):
        for mode in (("fresh", "resume") if rnd % 2 == 0 else ("resume", "fresh")):
            seconds, trainer = timed(comm, new_trainer, cfg, tokens)
            build.append(seconds)
            if mode == "resume":
                mgr = new_manager(args, cfg.checkpoint, trainer.grid, cfg.train.run_dir)
                seconds, path = timed(comm, mgr.resume, trainer.state, "auto")
                if path is None:
                    raise RuntimeError("resume found no checkpoint")
                resume.append(seconds)
                resume_phases.append(gather_phases(comm, mgr.last_phases))
                first_resumed.append(timed_step(comm, trainer))
                mgr.close()
            else:
                first_fresh.append(timed_step(comm, trainer))
            trainer.grid.close()
            del trainer
    fresh_med = statistics.median(first_fresh)
    both = [a + b for a, b in zip(resume, first_resumed)]
    records = [
        record("hpctrain", "restart: build grid + Trainer", size, 0, build),
        record("hpctrain", "restart: resume (open+read+CRC+apply)", size, ckpt_bytes, resume,
               phase_runs=resume_phases),
        record("hpctrain", "restart: first step after resume", size, 0, first_resumed,
               ratio=statistics.median(first_resumed) / fresh_med, ratio_to="first step, no resume"),
        record("hpctrain", "restart: resume + first step", size, 0, both,
               ratio=statistics.median(both) / fresh_med, ratio_to="first step, no resume"),
        record("hpctrain", "first step, no resume", size, 0, first_fresh),
    ]
    startup = comm.allreduce(_STARTUP_S if _STARTUP_S is not None else -1.0, op=MPI.MAX)
    if startup >= 0:
        records.append(record("python", "startup: process start -> torch, mpi4py imported", size, 0, [startup]))
    return records


# --------------------------------------------------------------------------- main
def run(args) -> list[dict]:
    from hpctrain.checkpoint.writers import has_parallel_h5py
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.runtime.launcher import discover

    torch.set_num_threads(1)
    if args.switch_interval > 0:
        sys.setswitchinterval(args.switch_interval)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"io", "async", "restart"}
    if unknown:
        raise SystemExit(f"bench_checkpoint: unknown --parts {sorted(unknown)}")
    if args.writers == "auto":
        writers = ["shards"] + (["mpio"] if has_parallel_h5py() else [])
    else:
        writers = [w.strip() for w in args.writers.split(",") if w.strip()]
        if set(writers) - {"shards", "mpio"}:
            raise SystemExit(f"bench_checkpoint: --writers takes shards and/or mpio, got {args.writers}")
        if "mpio" in writers and not has_parallel_h5py():
            raise SystemExit("bench_checkpoint: --writers mpio needs h5py built with MPI (h5py.get_config().mpi)")
    base = None
    if rank == 0:
        if args.dir:
            os.makedirs(args.dir, exist_ok=True)
            base = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
        else:
            base = tempfile.mkdtemp(prefix="hpctrain-bench-ckpt-")
    base = comm.bcast(base, root=0)
    info = discover()
    records = []
    try:
        tokens = load_tokens_collective(comm, "builtin", "", args.max_bytes)
        cfg = trainer_config(args, size, os.path.join(base, "run"), args.max_bytes)
        if "io" in parts:
            attrs = checkpoint_attrs(cfg, tokens)
            grid = ProcessGrid.build(info, dp=size)
            records += run_io(args, comm, grid, base, writers, attrs)
            grid.close()
        if parts & {"async", "restart"}:
            ckpt_bytes = 0
            if "async" in parts:
                got, ckpt_bytes = run_async(args, comm, cfg, tokens)
                records += got
            if "restart" in parts:
                if "async" not in parts:  # a checkpoint to resume from
                    from hpctrain.checkpoint.transfer import snapshot

                    trainer = new_trainer(cfg, tokens)
                    trainer.train_step()
                    ckpt_bytes = comm.allreduce(snapshot_bytes(snapshot(trainer.state)), op=MPI.SUM)
                    mgr = new_manager(args, cfg.checkpoint, trainer.grid, cfg.train.run_dir)
                    mgr.save(trainer.state, sync=True)
                    mgr.close()
                    trainer.grid.close()
                records += run_restart(args, comm, cfg, tokens, ckpt_bytes)
    finally:
        comm.Barrier()
        if rank == 0 and not args.keep_files:
            shutil.rmtree(base, ignore_errors=True)
    return records


def targets_summary(records) -> list[str]:
    lines = []
    for r in records:
        if r["op"] == "write" and r["impl"].startswith("hpctrain-"):
            ok = r["ratio_vs_dd"] >= 0.8
            lines.append(f"{r['impl']} write >= 0.8x dd: {'MET' if ok else 'MISSED'} ({r['ratio_vs_dd']:.2f}x)")
        if r["op"] == "save" and r["impl"].startswith("hpctrain-"):
            ok = r["ratio_vs_dd"] >= 0.8
            lines.append(f"{r['impl']} full save (write+verify+publish) >= 0.8x dd: {'MET' if ok else 'MISSED'} "
                         f"({r['ratio_vs_dd']:.2f}x)")
        if r["op"] == "async save: stall":
            ok = r["ratio"] <= 0.05
            lines.append(f"async stall <= 5% of the sync save: {'MET' if ok else 'MISSED'} ({100 * r['ratio']:.1f}%)")
    return lines


def print_tables(records: list[dict], args, ranks: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    io = [r for r in records if r["op"] in ("write", "read", "save")]
    if io:
        table = Table(title=f"checkpoint I/O: {ranks} ranks x {io[0]['bytes'] / ranks / MiB:.1f} MiB, fsync included, "
                            f"reads from disk (pages dropped); median of {io[0]['repeats']}, max over ranks")
        for name in ("impl", "op", "MiB", "seconds", "min-max s", "GB/s", "vs dd"):
            table.add_column(name, justify="left" if name in ("impl", "op") else "right")
        for r in io:
            table.add_row(r["impl"], r["op"], f"{r['bytes'] / MiB:.0f}", f"{r['seconds']:.3f}",
                          f"{r['seconds_min']:.3f}-{r['seconds_max']:.3f}", f"{r['GBps']:.2f}",
                          f"{r['ratio_vs_dd']:.2f}x")
        console.print(table)
    rest = [r for r in records if r["op"] not in ("write", "read", "save")]
    if rest:
        table = Table(title="async save and restart: Trainer "
                            f"{args.model}, ZeRO-1, median, max over ranks")
        for name in ("impl", "op", "MiB", "seconds", "min-max s", "GB/s", "ratio"):
            table.add_column(name, justify="left" if name in ("impl", "op") else "right")
        for r in rest:
            ratio = f"{r['ratio']:.3f} of {r['ratio_to']}" if r["ratio"] is not None else "-"
            table.add_row(r["impl"], r["op"], f"{r['bytes'] / MiB:.1f}" if r["bytes"] else "-", f"{r['seconds']:.4f}",
                          f"{r['seconds_min']:.4f}-{r['seconds_max']:.4f}",
                          f"{r['GBps']:.2f}" if r["GBps"] else "-", ratio)
        console.print(table)
    broken = [r for r in records if r["phases"]]
    if broken:
        table = Table(title="where the time goes: seconds per phase, median over rounds; 'max' = max over ranks "
                            "(ranks overlap, so phases add up to more than the total)")
        for name in ("impl", "op", "ranks", "phases"):
            table.add_column(name, justify="left")

        def fmt(phases):
            return "  ".join(f"{k.strip()}{' (in)' if k.startswith(' ') else ''} {v:.3f}"
                             for k, v in phases.items() if v)
        for r in broken:
            table.add_row(r["impl"], r["op"], "max", fmt(r["phases"]))
            if len(r["phases_by_rank"]) > 1:
                table.add_row("", "", "rank 0", fmt(r["phases_by_rank"][0]))
                table.add_row("", "", "rank 1", fmt(r["phases_by_rank"][1]))
        console.print(table)
    for line in targets_summary(records):
        console.print(f"target: {line}")


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("repeats", "async_repeats", "tensors", "cols"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench_checkpoint: --{name.replace('_', '-')} must be >= 1")
    if args.mib_per_rank <= 0:
        raise SystemExit("bench_checkpoint: --mib-per-rank must be > 0")
    records = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print_tables(records, args, MPI.COMM_WORLD.Get_size())
        write_records(records, args.json, args.csv, FIELDS, json_columns=("phases",))
    return 0


if __name__ == "__main__":
    run_benchmark(main)
