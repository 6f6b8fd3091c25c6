#!/usr/bin/env python
"""Pipeline schedules in a bubble-bound case: interleaved 1F1B (V = 2, 4, ...) and the zero-bubble ZB-H1 and ZB-V
against 1F1B at the same micro-batches.

    mpiexec -n 2 python benchmarks/bench_pipeline.py --microbatches 2 --virtual 2,4 --json pipe.json --csv pipe.csv
    mpiexec -n 2 python benchmarks/bench_pipeline.py --microbatches 4 --virtual 2 --zero-bubble zb-h1,zb-v
    mpiexec -bind-to core -n 2 python benchmarks/bench_pipeline.py ...   # each rank on its own core (Open MPI:
                                                                         # --bind-to core): steadier idle times

One MPI job builds, on the same ranks (pp = the world size, dp = tp = 1), one hpctrain Trainer per schedule:
``1f1b``, ``interleaved`` with each V of ``--virtual`` that the layers allow (pp x V <= layers), and each of
``--zero-bubble`` (zb-h1; zb-v with V = 2 in the V shape), same model, data, optimizer and micro-batches (a
multiple of pp where interleaving runs). Few micro-batches make the pipeline bubble, (pp - 1) / (V M) of the
ideal step, a large part of the step: interleaving divides it by V at the price of V times more point-to-point
messages; the zero-bubble schedules fill it with the deferred weight gradients (W), zb-h1 to (pp - 1) / (3 M).
``--schedules`` keeps only the named ones (e.g. ``1f1b`` alone, for its peak RSS: ``peak_rss_mib`` is the
ranks' largest resident set since the job started, so it tells one schedule's only when the job runs one).

Method (as benchmarks/bench_train.py): ``--warmup`` untimed steps each, then ``--rounds`` rounds of ``--steps``
timed steps of every schedule in turn, the order rotated each round; a step is timed from a barrier to its
end, the max over ranks; reported: the median, min and max; ``bubble_ms`` is the time each rank is idle on
the pipeline, mean over ranks of each rank's median over the timed steps (as the step time, a median: a rank
descheduled in one step makes the others wait in that step only): the trainer's phases ``pp_wait`` (blocked in
pipeline receives and sends: the fill, and the waits inside the schedule) and ``pp_drain`` (after its last
action, waiting for the other stages to finish: the drain, where 1F1B's last stage idles while the first runs
its last backwards); ``bubble_ms_by_rank`` each rank's, ``bubble_ratio`` zb-h1's against 1f1b's and zb-v's against interleaved
V = 2's: issue #53's bubble targets. ``bubble_model_ms`` is the idle the schedule's order itself leaves at
this run's costs: each rank's idle (mean over ranks) in ``schedules.timeline`` when every forward, backward (B)
and W takes this run's mean time per action (``forward_ms`` / (V M), ...) and messages are instant; what is
measured above it is messages, noise and imbalance between the ranks, what is below the order cannot remove.
At F = B = W it is the unit-time bubble; where W is cheaper than F and B, a rank that ran a W reaches its next
receive early and waits there, so ZB-V's order idles more than one unit. ``pp_wait_*`` are the receives and sends alone, means over the timed
steps (``pp_wait_ratio``, "p2p" in the table); ``pp_drain_ms`` the drain's mean. ``bubble`` is the schedule's (pp - 1) / (V M). At F = B = W a rank of 1F1B idles 3 (pp - 1)
units, one of ZB-H1 pp - 1 (Qi et al.).
One thread per rank (OMP_NUM_THREADS=1). After the timed rounds each schedule runs one more step, metered:
``act_mib_by_rank`` each rank's peak activation memory (what autograd saves and the executor holds between
actions, a deferred W's included: ``PipelineExecutor.meter_activations``), ``act_planned_mib_by_rank`` the
planner's for its stage (hpctrain/plan/memory.py ``activation_bytes``), ``act_vs_plan`` the largest ratio;
the resident set (``peak_rss_mib``) is mostly the runtime on a CPU and cannot show them.

With ``--profile FILE`` (a link and device profile: ``mpiexec -n 2 python -m hpctrain.cli bench comm
--profile FILE``), every row also gets the performance model's step time for exactly that run
(hpctrain/sweep/predict.py ``predict_run``: the same model shape, seq_len, global batch, micro-batches, pp,
schedule and V, float32, recompute off, on ``pp`` ranks of this job's nodes): ``predicted_ms``, its bubble
``predicted_bubble_ms`` and ``prediction_error`` = predicted / measured - 1.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain.bench.report import run_benchmark, timed_rounds, timed_steps, write_records  # noqa: E402

FIELDS = ["schedule", "virtual_stages", "pp", "microbatches", "bubble", "step_ms", "step_ms_min", "step_ms_max",
          "speedup_vs_1f1b", "bubble_ms", "bubble_ms_by_rank", "bubble_ratio", "pp_wait_ms", "pp_wait_ms_max",
          "pp_wait_ms_by_rank", "pp_wait_ratio", "pp_drain_ms", "bubble_model_ms", "forward_ms",
          "backward_ms", "weight_ms",
          "act_mib_by_rank", "act_planned_mib_by_rank", "act_vs_plan", "peak_rss_mib", "tokens_per_s", "final_loss",
          "timed_steps", "n_layers", "d_model", "seq_len", "global_batch", "predicted_ms", "predicted_bubble_ms",
          "prediction_error"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=0, help="micro-batches per step (default: pp)")
    p.add_argument("--virtual", default="2,4", help="comma list of V for interleaved (default 2,4)")
    p.add_argument("--zero-bubble", default="", help="comma list of zero-bubble schedules: zb-h1, zb-v (default none)")
    p.add_argument("--schedules", default="", help="comma list: run only these of the above, by name (1f1b, "
                                                   "interleaved, zb-h1, zb-v; default all)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per schedule per round (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule first (default 2)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (schedules alternate; default 4)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes to load (default 2 MB)")
    p.add_argument("--profile", metavar="FILE",
                   help="link and device profile (`hpctrain bench comm --profile FILE`): add the performance "
                        "model's prediction of every row (predicted_ms, prediction_error)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every schedule's run, e.g. train.host_malloc=system (repeatable)")
    p.add_argument("--json", metavar="FILE", help="write records to FILE (JSON list)")
    p.add_argument("--csv", metavar="FILE", help="write records to FILE (CSV)")
    return p.parse_args(argv)


class Schedule:
    """One Trainer with ``schedule`` and ``virtual`` chunks per rank on the whole world as pp."""

    def __init__(self, args, info, tokens, total_steps, schedule: str, virtual: int, microbatches: int):
        from hpctrain.comm.grid import ProcessGrid
        from hpctrain.config import load_config
        from hpctrain.train.trainer import Trainer

        self.schedule, self.virtual, self.microbatches = schedule, virtual, microbatches
        self.name = schedule if virtual == 1 or schedule == "zb-v" else f"{schedule} V={virtual}"
        cfg = load_config(None, [
            "model.preset=custom", "model.vocab_size=256", f"model.d_model={args.d_model}",
            f"model.n_layers={args.layers}", f"model.n_heads={args.heads}", f"model.n_kv_heads={args.heads}",
            f"model.d_ff={4 * args.d_model}", f"model.max_seq_len={args.seq_len}", "model.tie_embeddings=false",
            "train.dtype=float32", f"train.seq_len={args.seq_len}", f"train.global_batch={args.global_batch}",
            "train.lr=1e-3", "train.warmup_steps=2", f"train.steps={total_steps + 1}", "train.progress=false",
            "parallel.dp=1", "parallel.tp=1", f"parallel.pp={info.size}", f"parallel.microbatches={microbatches}",
            f"parallel.schedule={schedule}", f"parallel.virtual_stages={virtual}", *args.set])
        self.cfg = cfg
        self.grid = ProcessGrid.from_config(cfg, info)
        self.trainer = Trainer(cfg, self.grid, tokens=tokens)
        self.phases, self.loss, self.active = {}, float("nan"), False
        self.idle: list[float] = []  # per timed step: this rank's pp_wait + pp_drain seconds

    def step(self) -> None:
        metrics = self.trainer.train_step()
        self.loss = metrics.loss
        if self.active:
            for name, seconds in metrics.time_s.items():
                self.phases[name] = self.phases.get(name, 0.0) + seconds
            self.idle.append(metrics.time_s.get("pp_wait", 0.0) + metrics.time_s.get("pp_drain", 0.0))

    def activations(self, world) -> tuple[list[float], list[float]]:
        """One more step, metered (untimed: the hooks cost time): each rank's peak activation bytes
        (``PipelineExecutor.meter_activations``) and the planner's for its stage, in MiB, over the ranks."""
        from hpctrain.sweep.predict import planned_activations

        executor, loss = self.trainer.parts.executor, self.loss
        meter = executor.meter_activations()
        self.trainer.train_step()
        executor.meter, self.loss = None, loss
        planned = planned_activations(self.cfg, world.Get_size())[executor.rank]
        return world.allgather(meter.peak / 2**20), world.allgather(planned / 2**20)

    def close(self) -> None:
        self.grid.close()


def add_prediction(record: dict, cfg, info, profile: str) -> None:
    """The performance model's step time of ``record``'s run (``cfg``: its config; pp = the world, dp = tp =
    1, on this job's nodes) and its error against the measured median; None where the model cannot tell."""
    from hpctrain.sweep.predict import predict_run

    row = {"ranks": info.size, "dp": 1, "tp": 1, "pp": record["pp"], "microbatches": record["microbatches"],
           "global_batch": record["global_batch"], "nodes": info.num_nodes}
    pred = predict_run(cfg, row, device="auto", profile=profile)
    step_s = pred["predicted_step_s"] if pred else None
    record["predicted_ms"] = step_s * 1e3 if step_s else None
    record["predicted_bubble_ms"] = pred["predicted_bubble_s"] * 1e3 if pred else None
    record["prediction_error"] = step_s * 1e3 / record["step_ms"] - 1 if step_s else None


def run(args) -> list[dict]:
    from hpctrain.data.corpus import load_tokens_collective
    import resource

    from hpctrain.parallel.schedules import schedule_bubble
    from hpctrain.runtime.launcher import discover

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    info = discover()
    pp = info.size
    m = args.microbatches or pp
    zero_bubble = [k.strip() for k in args.zero_bubble.split(",") if k.strip()]
    only = {k.strip() for k in args.schedules.split(",") if k.strip()}
    if pp < 2 or m < pp or (m % pp and (not only or "interleaved" in only)):
        raise SystemExit(f"bench_pipeline: needs >= 2 ranks and --microbatches >= pp={pp} (a multiple of it for "
                         f"interleaved), got {m}")
    if any(k not in ("zb-h1", "zb-v") for k in zero_bubble) or (not zero_bubble and only & {"zb-h1", "zb-v"}):
        raise SystemExit(f"bench_pipeline: --zero-bubble takes zb-h1 and zb-v, got {args.zero_bubble!r}")
    if args.profile:  # a bad profile: one line now, before any rank builds a model
        from hpctrain.sweep.predict import machine_for

        machine_for(pp, info.num_nodes, "auto", args.profile)
    tokens = load_tokens_collective(world, "builtin", "", args.max_bytes)
    total = args.warmup + args.rounds * args.steps
    wanted = [1] + [int(v) for v in args.virtual.split(",") if v.strip() and pp * int(v) <= args.layers]
    kinds = [("1f1b" if v == 1 else "interleaved", v) for v in wanted] + [(k, 2 if k == "zb-v" else 1)
                                                                          for k in zero_bubble]
    impls = [Schedule(args, info, tokens, total, kind, v, m) for kind, v in kinds if not only or kind in only]
    if info.rank == 0:
        print(f"bench_pipeline: pp={pp}, {m} micro-batches, schedules {[i.name for i in impls]}, {args.warmup} "
              f"warm-up + {args.rounds} x {args.steps} timed steps each", file=sys.stderr, flush=True)
    for impl in impls:
        timed_steps(impl, args.warmup, world)
    times = timed_rounds(impls, args.rounds, args.steps, world, lambda impl, on: setattr(impl, "active", on))
    records, timed = [], args.rounds * args.steps
    for impl in impls:
        act, planned = impl.activations(world)
        t = times[impl.name]
        phase = {name: world.allreduce(impl.phases.get(name, 0.0)) / pp / timed * 1e3
                 for name in ("pp_wait", "pp_drain", "forward", "backward", "weight")}
        by_rank = [w / timed * 1e3 for w in world.allgather(impl.phases.get("pp_wait", 0.0))]
        bubble_by_rank = [w * 1e3 for w in world.allgather(statistics.median(impl.idle))]
        median = statistics.median(t)
        records.append({"schedule": impl.schedule, "virtual_stages": impl.virtual, "pp": pp, "microbatches": m,
                        "bubble": schedule_bubble(impl.schedule, pp, m, impl.virtual), "step_ms": median * 1e3,
                        "step_ms_min": min(t) * 1e3, "step_ms_max": max(t) * 1e3, "speedup_vs_1f1b": None,
                        "bubble_ms": sum(bubble_by_rank) / pp, "bubble_ms_by_rank": bubble_by_rank,
                        "bubble_ratio": None, "pp_wait_ms": phase["pp_wait"], "pp_wait_ms_max": max(by_rank),
                        "pp_wait_ms_by_rank": by_rank, "pp_wait_ratio": None, "pp_drain_ms": phase["pp_drain"],
                        "bubble_model_ms": model_idle_ms(impl.schedule, pp, m, impl.virtual, phase),
                        "forward_ms": phase["forward"],
                        "backward_ms": phase["backward"], "weight_ms": phase["weight"],
                        "act_mib_by_rank": act, "act_planned_mib_by_rank": planned,
                        "act_vs_plan": max(a / p for a, p in zip(act, planned)),
                        "peak_rss_mib": world.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                                                        op=MPI.MAX) / 1024,
                        "tokens_per_s": args.global_batch * args.seq_len / median,
                        "final_loss": impl.loss, "timed_steps": len(t), "n_layers": args.layers,
                        "d_model": args.d_model, "seq_len": args.seq_len, "global_batch": args.global_batch,
                        "predicted_ms": None, "predicted_bubble_ms": None, "prediction_error": None})
        if args.profile:
            add_prediction(records[-1], impl.cfg, info, args.profile)
    base = next((r for r in records if r["schedule"] == "1f1b"), None)
    interleaved = next((r for r in records if r["schedule"] == "interleaved" and r["virtual_stages"] == 2), None)
    for r in records:
        r["speedup_vs_1f1b"] = base["step_ms"] / r["step_ms"] if base else None
        # the bubble targets of issue #53: zb-h1's bubble against 1f1b's, zb-v's against interleaved V=2's
        ref = interleaved if r["schedule"] == "zb-v" else base if r["schedule"] == "zb-h1" else None
        r["bubble_ratio"] = r["bubble_ms"] / ref["bubble_ms"] if ref and ref["bubble_ms"] > 0 else None
        r["pp_wait_ratio"] = r["pp_wait_ms"] / ref["pp_wait_ms"] if ref and ref["pp_wait_ms"] > 0 else None
    for impl in impls:
        impl.close()
    return records


def model_idle_ms(kind: str, pp: int, microbatches: int, virtual: int, phase: dict) -> float:
    """Each rank's idle in ``kind``'s order (mean over ranks, ms) when its actions take this run's mean time per
    action (``phase``: ms per step, means over ranks) and messages are instant (``schedules.timeline``, in us)."""
    from hpctrain.parallel.schedules import idle_per_rank, timeline
    from hpctrain.parallel.zero_bubble import ZERO_BUBBLE_SCHEDULES

    actions = microbatches * virtual  # of each kind, per rank and step
    us = {name: max(1, round(phase[name] * 1e3 / actions)) for name in ("forward", "backward", "weight")}
    rows = timeline(kind, pp, microbatches, virtual, us["forward"], us["backward"],
                    us["weight"] if kind in ZERO_BUBBLE_SCHEDULES else None)
    return sum(idle_per_rank(rows)) / len(rows) / 1e3


def print_table(records: list[dict]) -> None:
    r0 = records[0]
    predicted = any(r["predicted_ms"] is not None for r in records)
    print(f"pipeline schedules: pp={r0['pp']}, {r0['microbatches']} micro-batches, GPT d_model={r0['d_model']} x "
          f"{r0['n_layers']} layers, seq {r0['seq_len']}, global batch {r0['global_batch']}, float32; median of "
          f"{r0['timed_steps']} steps")
    print(f"{'schedule':<16} {'bubble':>7} {'step ms':>8} {'min-max ms':>12} {'vs 1f1b':>8} {'idle ms':>8} "
          f"{'ratio':>6} {'per rank':>13} {'model':>6} {'p2p':>6} {'fwd':>7} {'bwd':>7} {'W':>7} {'act MiB':>11} {'/plan':>6} "
          f"{'RSS MiB':>8} {'loss':>8}"
          + (f" {'pred ms':>8} {'error':>7}" if predicted else ""))
    for r in records:
        name = r["schedule"] if r["schedule"] != "interleaved" else f"interleaved V={r['virtual_stages']}"
        speedup = f"{r['speedup_vs_1f1b']:>7.2f}x" if r["speedup_vs_1f1b"] is not None else f"{'-':>8}"
        print(f"{name:<16} {r['bubble']:>7.1%} {r['step_ms']:>8.1f} "
              f"{r['step_ms_min']:>5.0f}-{r['step_ms_max']:<6.0f} {speedup} "
              f"{r['bubble_ms']:>8.1f} {_ratio(r['bubble_ratio']):>6} "
              f"{'/'.join(f'{w:.0f}' for w in r['bubble_ms_by_rank']):>13} {r['bubble_model_ms']:>6.0f} "
              f"{_ratio(r['pp_wait_ratio']):>6} "
              f"{r['forward_ms']:>7.1f} {r['backward_ms']:>7.1f} "
              f"{r['weight_ms']:>7.1f} {'/'.join(f'{a:.0f}' for a in r['act_mib_by_rank']):>11} "
              f"{r['act_vs_plan']:>5.2f}x {r['peak_rss_mib']:>8.0f} {r['final_loss']:>8.4f}"
              + (_prediction(r) if predicted else ""))


def _ratio(ratio: float | None) -> str:
    """A "ratio" or "p2p" cell: zb-h1's against 1f1b's, zb-v's against interleaved V=2's, else "-"."""
    return f"{ratio:.2f}x" if ratio is not None else "-"


def _prediction(r: dict) -> str:
    """The table's "pred ms" and "error" cells of record ``r``."""
    if r["predicted_ms"] is None:
        return f" {'-':>8} {'-':>7}"
    return f" {r['predicted_ms']:>8.1f} {r['prediction_error']:>+7.1%}"


def print_profile_device(path: str) -> None:
    """One line: the profile's device rate the predictions scale with (and a warning where the block's
    efficiency hit its cap of 1: the matmul rate was measured under a load the block was not)."""
    from hpctrain.plan.machine import load_profile

    dev = load_profile(path).device
    rate, eff = dev.get("matmul_tflops") or dev.get("peak_tflops") or 0.0, dev.get("efficiency") or 0.0
    print(f"predictions from {path}: device {dev.get('name', '?')} {rate * 1e3:.1f} GFLOP/s matmul x efficiency "
          f"{eff:.2f} per rank, {dev.get('ranks_per_node', '?')} ranks busy")
    if eff >= 1.0:
        print("warning: the profile's block efficiency is capped at 1.0 (its matmul rate was measured slower than "
              "its transformer block runs: a disturbed profile); profile again on a quiet machine")


def main(argv=None) -> int:
    args = parse_args(argv)
    records = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print_table(records)
        if args.profile:
            print_profile_device(args.profile)
        write_records(records, args.json, args.csv, FIELDS, json_columns=("bubble_ms_by_rank", "pp_wait_ms_by_rank",
                                                                               "act_mib_by_rank",
                                                                               "act_planned_mib_by_rank"))
    return 0


if __name__ == "__main__":
    run_benchmark(main)
