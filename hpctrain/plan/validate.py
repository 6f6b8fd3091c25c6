"""The planner against the published runs of ``published.py``: predicted vs published throughput, and
where the published layout ranks when ``hpctrain plan`` searches the run's own GPUs, batch and sequence.

    python -m hpctrain.plan.validate          # or: hpctrain plan --validate published
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Options
from hpctrain.plan.devices import device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.planner import SearchSpace, plan, predict
from hpctrain.plan.published import RUNS, Run
from hpctrain.plan.shapes import for_tp, megatron_flops_per_token

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Check:
    run: Run
    predicted_tflops: float  # in the run's metric
    rank: int  # of the published (tp, pp) among the searched (tp, pp) pairs, 1 = best; 0: not feasible
    best: tuple[int, int]  # (tp, pp) the planner ranks first

    @property
    def error(self) -> float:
        return self.predicted_tflops / self.run.published_tflops - 1


def machine(run: Run) -> Machine:
    intra, inter = run.links
    return Machine(device_preset(run.device), links_from_bandwidth(intra, inter), run.gpus // GPUS_PER_NODE,
                   GPUS_PER_NODE)


def options(run: Run) -> Options:
    return Options(flash_attention=run.attention == "fused", virtual_stages=run.virtual_stages,
                   pp_scatter_gather=run.scatter_gather, zero_reshard_after_forward=run.zero_reshard_after_forward,
                   megatron_activations=True)


def metric_tflops(run: Run, tp: int, tokens_per_s: float) -> float:
    """Per-GPU TFLOP/s of ``tokens_per_s`` in the run's published convention (published.py)."""
    kind = run.recompute if run.metric == "hfu" else "model"
    return megatron_flops_per_token(for_tp(run.model, tp), run.seq_len, kind) * tokens_per_s / run.gpus / 1e12


def predict_run(run: Run):
    """The planner's Prediction for the run's own layout."""
    m = run.global_batch // run.dp // run.micro_batch
    layout = Layout(run.gpus, run.dp, run.pp, run.tp, m, run.global_batch, run.seq_len, run.sequence_parallel,
                    run.zero)
    return predict(run.model, layout, machine(run), run.recompute, options(run))


def rank_run(run: Run) -> tuple[int, tuple[int, int]]:
    """(rank of the published tp x pp among the (tp, pp) pairs by their best plan, the first pair):
    ``hpctrain plan`` over every layout of the run's GPUs with its batch, sequence and techniques."""
    space = SearchSpace(cp=1, zero=(run.zero,), sequence_parallel=(run.sequence_parallel,),
                        recompute=(run.recompute,))
    pairs: list[tuple[int, int]] = []
    for p in plan(run.model, machine(run), run.global_batch, run.seq_len, options(run), space).plans:
        pair = (p.candidate.layout.tp_size, p.candidate.layout.pp_size)
        if pair not in pairs:
            pairs.append(pair)
    published = (run.tp, run.pp)
    return (pairs.index(published) + 1 if published in pairs else 0), (pairs[0] if pairs else (0, 0))


def check(run: Run) -> Check:
    pred = predict_run(run)
    rank, best = rank_run(run)
    return Check(run, metric_tflops(run, run.tp, pred.tokens_per_s), rank, best)


def summary(checks: list[Check]) -> dict[str, float]:
    errors = [abs(c.error) for c in checks]
    return {"runs": len(checks), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "top3": sum(1 <= c.rank <= 3 for c in checks), "first": sum(c.rank == 1 for c in checks)}


def main() -> None:
    checks = [check(r) for r in RUNS]
    print("| run | set | device | GPUs | tp x pp x dp (V) | recompute | metric | published | predicted | error "
          "| rank of published tp x pp | plan's first |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in checks:
        r = c.run
        print(f"| {r.name} | {'calibration' if r.calibration else 'held out'} | {r.device} | {r.gpus} | "
              f"{r.tp} x {r.pp} x {r.dp} ({r.virtual_stages}) | {r.recompute} | {r.metric} | "
              f"{r.published_tflops:.0f} | {c.predicted_tflops:.0f} | {c.error:+.1%} | {c.rank or 'infeasible'} | "
              f"{c.best[0]} x {c.best[1]} |")
    for label, subset in (("held out", [c for c in checks if not c.run.calibration]),
                          ("calibration", [c for c in checks if c.run.calibration])):
        s = summary(subset)
        print(f"\n{label}: {s['runs']} runs, median |error| {s['median_abs_error']:.1%}, max "
              f"{s['max_abs_error']:.1%}; published layout first in {s['first']}, in the top 3 in {s['top3']}")


if __name__ == "__main__":
    main()
