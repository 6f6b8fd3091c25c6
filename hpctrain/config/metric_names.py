"""Every metric hpctrain exports, and how one step's record becomes samples (docs/monitoring.md).

A sample is ``(name, labels, value)``: the Prometheus sink sets its gauge or counter, the TensorBoard sink
writes the scalar ``name`` (``name/label=value`` with labels). Names carry their unit as Prometheus
recommends; every series also has the run's constant labels (``CONSTANT_LABELS`` + ``monitor.labels``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

CONSTANT_LABELS = ("run", "job_id", "layout")
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "gauge" or "counter" (a counter's name ends in _total)
    help: str
    labels: tuple[str, ...] = ()


METRICS = {m.name: m for m in (
    Metric("hpctrain_up", "gauge", "1 while the run trains; 0 once it has ended (written to the textfile at exit)"),
    Metric("hpctrain_step", "gauge", "training steps done"),
    Metric("hpctrain_last_step_timestamp_seconds", "gauge", "Unix time at which the last step ended"),
    Metric("hpctrain_loss", "gauge", "training loss of the last step (NaN when not finite)"),
    Metric("hpctrain_val_loss", "gauge", "validation loss of the last evaluation"),
    Metric("hpctrain_learning_rate", "gauge", "learning rate of the last step"),
    Metric("hpctrain_grad_norm", "gauge", "global gradient norm of the last step (before clipping)"),
    Metric("hpctrain_tokens_per_second", "gauge", "training tokens per second of the last step, all ranks"),
    Metric("hpctrain_mfu_ratio", "gauge", "model FLOPs utilisation of the last step, 0..1 (needs a known peak)"),
    Metric("hpctrain_step_seconds", "gauge", "seconds of the last step on rank 0 by phase (exclusive); "
           "phase=\"total\" is the whole step", ("phase",)),
    Metric("hpctrain_comm_bytes_total", "counter", "bytes sent by all ranks on each process group", ("group",)),
    Metric("hpctrain_checkpoint_seconds", "gauge", "seconds of the last checkpoint save by phase; phase=\"stall\" "
           "is the time training was blocked", ("phase",)),
    Metric("hpctrain_last_checkpoint_step", "gauge", "step of the last checkpoint saved"),
    Metric("hpctrain_last_checkpoint_timestamp_seconds", "gauge", "Unix time of the last checkpoint saved"),
    Metric("hpctrain_skipped_steps_total", "counter", "steps whose update was skipped (non-finite loss or gradients)"),
    Metric("hpctrain_restarts_total", "counter", "times the job was restarted by the scheduler (SLURM_RESTART_COUNT)"),
    Metric("hpctrain_rank_step_seconds", "gauge", "mean step seconds over the last monitor interval of the slowest "
           "and of the median rank", ("rank", "which")),
    Metric("hpctrain_straggler_ratio", "gauge", "slowest rank's mean step seconds / the median rank's, last interval"),
    Metric("hpctrain_moe_aux_loss", "gauge", "MoE load-balancing loss of the last step (unweighted, summed over MoE "
           "layers; 1 x top_k per layer is perfectly balanced)"),
    Metric("hpctrain_moe_z_loss", "gauge", "MoE router z-loss of the last step (mean lse^2, summed over MoE layers)"),
    Metric("hpctrain_moe_dropped_ratio", "gauge", "fraction of the last step's expert choices dropped by the capacity"),
    Metric("hpctrain_moe_tokens", "gauge", "token choices each expert of each MoE layer served in the last step",
           ("layer", "expert")),
)}


def step_samples(record: dict) -> list[tuple[str, dict, float]]:
    """Samples of one step's record (``StepMetrics.as_dict()`` + ``val_loss`` when evaluated)."""
    samples = [("hpctrain_step", {}, record["step"]), ("hpctrain_loss", {}, _number(record["loss"])),
               ("hpctrain_learning_rate", {}, record["lr"]), ("hpctrain_grad_norm", {}, _number(record["grad_norm"])),
               ("hpctrain_tokens_per_second", {}, record["tokens_per_s"]),
               ("hpctrain_step_seconds", {"phase": "total"}, record["step_time_s"])]
    if record.get("mfu") is not None:
        samples.append(("hpctrain_mfu_ratio", {}, record["mfu"]))
    if record.get("val_loss") is not None:
        samples.append(("hpctrain_val_loss", {}, _number(record["val_loss"])))
    samples += [("hpctrain_step_seconds", {"phase": phase}, seconds)
                for phase, seconds in (record.get("time_s") or {}).items()]
    if "moe_aux_loss" in record:  # a model with experts (hpctrain/models/moe.py MoeStepStats)
        samples += [("hpctrain_moe_aux_loss", {}, _number(record["moe_aux_loss"])),
                    ("hpctrain_moe_z_loss", {}, _number(record["moe_z_loss"])),
                    ("hpctrain_moe_dropped_ratio", {}, record["moe_dropped_fraction"])]
        samples += [("hpctrain_moe_tokens", {"layer": layer, "expert": str(e)}, n)
                    for layer, counts in record["moe_tokens_per_expert"].items() for e, n in enumerate(counts)]
    return samples


def _number(value) -> float:
    return float(value) if value is not None and math.isfinite(value) else float("nan")


def layout_label(sizes: dict) -> str:
    """``dp2-pp2-tp2`` (cp when > 1): the grid of the run, as a label value."""
    return "-".join(f"{axis}{sizes[axis]}" for axis in ("dp", "pp", "cp", "tp") if axis != "cp" or sizes[axis] > 1)


def parse_labels(items: list[str], where: str = "monitor.labels") -> dict[str, str]:
    """``["cluster=frontier", ...]`` -> {"cluster": "frontier"}; ValueError naming the bad item."""
    labels = {}
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not LABEL_NAME.match(name) or name.startswith("__"):
            raise ValueError(f"{where}: {item!r} is not NAME=VALUE with a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)")
        reserved = set(CONSTANT_LABELS) | {label for m in METRICS.values() for label in m.labels}
        if name in reserved or name in labels:
            raise ValueError(f"{where}: label {name!r} is {'set twice' if name in labels else 'hpctrain own'}")
        labels[name] = value.strip()
    return labels
