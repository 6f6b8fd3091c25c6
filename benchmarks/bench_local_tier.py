#!/usr/bin/env python
"""The node-local checkpoint tier against the global HDF5 tier: how long a save blocks the step, how long a
restart takes from each tier (issue #40, docs/benchmarks.md).

    # two emulated nodes (UTS namespaces), each with its own local directory; the global tier on disk:
    mpiexec -launcher rsh -launcher-exec $PWD/tests/fake_nodes_launch.sh -hosts h1,h2 -ppn 1 -n 2 \\
        python benchmarks/bench_local_tier.py --model small --local-dir '/dev/shm/bench-local/{hostname}' \\
        --json local_tier.json --csv local_tier.csv

One MPI job, a real ``Trainer`` of ``--model`` (dp = ranks, ZeRO 0, AdamW with fp32 state) and its
``CheckpointManager``; every time is the max over ranks from a barrier (median of ``--repeats``, with the range):

Blocking time per checkpoint (what the step waits for)
    sync HDF5 save   ``manager.save(state, sync=True)``: snapshot, write, fsync, verify, publish
    async HDF5 save  ``manager.save(state)`` with ``checkpoint.async``: the wait for the previous save and the copy
                     of the RNG and reducer state; the snapshot itself runs on the save's thread during the next
                     forward and backward ("step after an async save"), the write after it (waited out of the
                     timing)
    local tier, 0/1 replicas  ``manager.local.save(state)``: the copy of the small tensors into the reused host
                     buffer; the parameters and optimizer state are copied in the background during the next
                     forward and backward (that step's update waits for it: "step after a local save" against
                     "step without"), then checksums, write and the partner's copy
Restart (a new ``Trainer`` in the same process, then ``manager.resume(state, "auto")`` and the first step)
    global           the local tier removed: the HDF5 checkpoint, its pages evicted from the page cache first
    local            every rank's own piece
    replica          rank 1's node lost its tier: its piece comes from its partner (needs 2 nodes)
Ratios: each blocking time against the sync save and the async save; each restart against the global one.
The local directory is removed at the end; the global tier lives under ``--dir`` (default $TMPDIR or /tmp).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling bench_checkpoint.py

from bench_checkpoint import drop_cache, new_trainer, record, timed  # noqa: E402

from hpctrain.bench.report import run_benchmark, write_records  # noqa: E402

FIELDS = ["impl", "op", "ranks", "bytes", "seconds", "seconds_min", "seconds_max", "repeats", "ratio", "ratio_to"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more config overrides, e.g. --set model.d_model=768 (repeatable)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="rounds of each measurement (default 3; median)")
    p.add_argument("--local-dir", default="/dev/shm/hpctrain-bench-local/{hostname}",
                   help="checkpoint.local_dir ({hostname} expanded per emulated node)")
    p.add_argument("--dir", help="where the global tier goes (default: a new directory under $TMPDIR or /tmp)")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus bytes (default 1 MB)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--csv", metavar="FILE")
    return p.parse_args(argv)


def config(args, size: int, run_dir: str, replicas: int):
    from hpctrain.config import load_config

    return load_config(None, [f"model.preset={args.model}", f"train.seq_len={args.seq_len}",
                              f"train.global_batch={2 * size}", f"parallel.dp={size}", "parallel.tp=1",
                              "parallel.pp=1", "train.steps=100000", "train.progress=false",
                              f"train.run_dir={run_dir}", f"data.max_bytes={args.max_bytes}",
                              "checkpoint.async=true", "checkpoint.keep=2", f"checkpoint.local_dir={args.local_dir}",
                              "checkpoint.local_interval=1", f"checkpoint.replicas={replicas}", *args.set])


def blocking(args, comm, cfg, tokens) -> tuple[list[dict], int]:
    """Blocking time of each kind of save, rounds interleaved; leaves a global and a local save of one step."""
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.checkpoint.local_tier import LocalTier

    trainer = new_trainer(cfg, tokens)
    mgr = CheckpointManager(cfg.checkpoint, trainer.grid, cfg.train.run_dir)
    tiers = {k: LocalTier(dataclasses.replace(cfg.checkpoint, replicas=k), trainer.grid, cfg.train.run_dir)
             for k in (0, 1)}
    times: dict[str, list[float]] = {k: [] for k in ("sync", "async", "local0", "local1", "next0", "next1", "next_async", "step")}
    background: dict[str, list[float]] = {"local0": [], "local1": []}
    trainer.train_step()
    for _ in range(args.repeats):
        trainer.train_step()
        times["sync"].append(timed(comm, mgr.save, trainer.state, sync=True)[0])
        trainer.train_step()
        times["async"].append(timed(comm, mgr.save, trainer.state)[0])
        times["next_async"].append(timed(comm, trainer.train_step)[0])  # its update waits for the snapshot
        mgr.wait()
        for k, tier in tiers.items():
            times["step"].append(timed(comm, trainer.train_step)[0])
            times[f"local{k}"].append(timed(comm, tier.save, trainer.state)[0])
            times[f"next{k}"].append(timed(comm, trainer.train_step)[0])  # its update waits for the copy
            tier.wait()
            background[f"local{k}"].append(comm.allreduce(tier.last_write_s or 0.0, op=MPI.MAX))
    trainer.train_step()
    mgr.save(trainer.state, sync=True)  # the global and local saves the restarts read: the same step
    tiers[1].save(trainer.state)
    tiers[1].wait()
    piece = tiers[1]._buffer.piece
    nbytes = comm.allreduce(piece.data.numel() if piece is not None else 0, op=MPI.SUM)
    tiers[0].close()
    tiers[1].close()
    mgr.close()
    trainer.grid.close()
    sync, asyn = statistics.median(times["sync"]), statistics.median(times["async"])
    records = [record("hdf5", "save blocking: sync", comm.Get_size(), nbytes, times["sync"]),
               record("hdf5", "save blocking: async (snapshot)", comm.Get_size(), nbytes, times["async"],
                      ratio=asyn / sync, ratio_to="sync save")]
    for k in (0, 1):
        local = statistics.median(times[f"local{k}"])
        records.append(record("local", f"save blocking: local tier, {k} replica(s)", comm.Get_size(), nbytes,
                              times[f"local{k}"], ratio=local / sync, ratio_to="sync save"))
        records.append({**record("local", f"save blocking: local tier, {k} replica(s)", comm.Get_size(), nbytes,
                                 times[f"local{k}"]), "ratio": local / asyn, "ratio_to": "async save"})
        records.append(record("local", f"background: copy + checksums + write + replicas ({k})", comm.Get_size(),
                              nbytes, background[f"local{k}"]))
        records.append(record("local", f"step after a local save ({k} replicas)", comm.Get_size(), 0,
                              times[f"next{k}"], ratio=statistics.median(times[f"next{k}"]) / statistics.median(times["step"]),
                              ratio_to="step without"))
    records.append(record("hdf5", "step after an async save", comm.Get_size(), 0, times["next_async"],
                          ratio=statistics.median(times["next_async"]) / statistics.median(times["step"]),
                          ratio_to="step without"))
    records.append(record("local", "step without a save", comm.Get_size(), 0, times["step"]))
    return records, nbytes


def restart(args, comm, cfg, tokens, nbytes: int) -> list[dict]:
    """Build + resume + first step from each tier; the tier directories are set up before each round."""
    from hpctrain.checkpoint.local_tier import expand
    from hpctrain.checkpoint.manager import CheckpointManager

    local_root = expand(args.local_dir)
    kept = local_root.rstrip("/") + ".kept"
    if os.path.isdir(local_root):
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(local_root, kept)
    times: dict[str, list[float]] = {"global": [], "local": [], "replica": []}
    resumes: dict[str, list[float]] = {"global": [], "local": [], "replica": []}
    for rnd in range(args.repeats):
        for mode in ("global", "local", "replica")[rnd % 3:] + ("global", "local", "replica")[:rnd % 3]:
            if comm.Get_size() < 2 and mode == "replica":
                continue
            shutil.rmtree(local_root, ignore_errors=True)
            if mode != "global" and not (mode == "replica" and comm.Get_rank() == 1) and os.path.isdir(kept):
                shutil.copytree(kept, local_root)
            if mode == "global":
                drop_cache(glob.glob(os.path.join(cfg.train.run_dir, "checkpoints", "*", "**"), recursive=True))
            comm.Barrier()
            start = time.perf_counter()
            trainer = new_trainer(cfg, tokens)
            mgr = CheckpointManager(cfg.checkpoint, trainer.grid, cfg.train.run_dir)
            resume_start = time.perf_counter()
            loaded = mgr.resume(trainer.state, "auto")
            resume_s = comm.allreduce(time.perf_counter() - resume_start, op=MPI.MAX)
            trainer.train_step()
            seconds = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            from_local = loaded is not None and loaded.startswith("the local tier")
            if loaded is None or from_local != (mode != "global"):
                raise RuntimeError(f"restart {mode}: resumed from {loaded!r}")
            times[mode].append(seconds)
            resumes[mode].append(resume_s)
            mgr.close()
            trainer.grid.close()
    shutil.rmtree(kept, ignore_errors=True)
    shutil.rmtree(local_root, ignore_errors=True)
    records = []
    for what, runs in (("resume", resumes), ("build + resume + first step", times)):
        base = statistics.median(runs["global"])
        records += [record("restart", f"{what}: {mode}", comm.Get_size(), nbytes, runs[mode],
                           ratio=statistics.median(runs[mode]) / base if mode != "global" else None,
                           ratio_to="global" if mode != "global" else None)
                    for mode in ("global", "local", "replica") if runs[mode]]
    return records


def run(args) -> list[dict]:
    from hpctrain.data.corpus import load_tokens_collective

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    base = None
    if comm.Get_rank() == 0:
        base = tempfile.mkdtemp(prefix="bench-local-", dir=args.dir)
    base = comm.bcast(base, root=0)
    hosts = comm.allgather(MPI.Get_processor_name())
    if len(set(hosts)) != len(hosts):
        raise SystemExit(f"bench_local_tier: one rank per node please (ranks on {hosts}); emulate nodes with "
                         f"tests/fake_nodes_launch.sh and -ppn 1 (see the usage above)")
    try:
        tokens = load_tokens_collective(comm, "builtin", "", args.max_bytes)
        cfg = config(args, comm.Get_size(), os.path.join(base, "run"), 1)
        records, nbytes = blocking(args, comm, cfg, tokens)
        records += restart(args, comm, cfg, tokens, nbytes)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(base, ignore_errors=True)
    return records


def print_table(records) -> None:
    print(f"{'op':<52} {'median s':>10} {'range s':>21} {'ratio':>7}  to")
    for r in records:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
        print(f"{r['op']:<52} {r['seconds']:>10.4f} {r['seconds_min']:>10.4f}-{r['seconds_max']:<10.4f} {ratio:>7}  "
              f"{r['ratio_to'] or ''}")


def main(argv=None) -> int:
    args = parse_args(argv)
    records = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"state: {records[0]['bytes'] / 2**20:.1f} MiB over {records[0]['ranks']} ranks (local pieces)")
        print_table(records)
        write_records(records, args.json, args.csv, FIELDS)
    return 0


if __name__ == "__main__":
    run_benchmark(main)
