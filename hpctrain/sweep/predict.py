"""The performance model's prediction for one sweep run (``hpctrain sweep`` adds it next to the measurement).

``predict_run(cfg, row, device, profile)`` builds the run's ``Layout`` from the sweep row (ranks, dp, tp,
pp, microbatches, global_batch; cp and ep where the row has them) and the config (model and its experts,
seq_len, schedule, ZeRO, sequence parallelism, dtype, ``parallel.cp``, ``parallel.ep``), a ``Machine`` of
``row["nodes"]`` nodes (1 for local mpiexec sweeps) and asks hpctrain/plan for the step time. With a link
profile (``hpctrain bench comm --profile``) the links and, where it measured them, the device's rates come
from it; without one, the ``device`` preset (with its intra-node bandwidth) and ``DEFAULT_INTER_GBPS`` are used.
The fields it returns are the sweep CSV's ``predicted_*`` columns.
"""
from __future__ import annotations

from dataclasses import replace

from hpctrain.errors import HpcTrainError
from hpctrain.config.layout import Layout

DEFAULT_INTER_GBPS = 10.0  # 10 Gbit Ethernet


def machine_for(ranks: int, nodes: int, device: str, profile: str | None):
    """The Machine of a run of ``ranks`` ranks on ``nodes`` nodes."""
    from hpctrain.plan.machine import Machine, device_from_profile, device_preset, links_from_bandwidth, load_profile

    per_node = max(1, ranks // max(1, nodes))
    if profile:
        links = load_profile(profile)
        dev = device_from_profile(links, device if device != "auto" else "", per_node)
    else:
        dev = device_preset(device)
        links = links_from_bandwidth(dev.intra_gbps, DEFAULT_INTER_GBPS if nodes > 1 else None)
    if dev.memory_gib is None:
        dev = replace(dev, memory_gib=1e9)  # a sweep runs what it was given: do not judge host memory here
    return Machine(dev, links, max(1, nodes), per_node)


def run_options(cfg):
    """The planner's ``Options`` of run ``cfg`` (no reserve: a measurement's side has none either)."""
    from hpctrain.plan.cost import Options

    p, t = cfg.parallel, cfg.train
    return Options(dtype=t.dtype, flash_attention=True, bucket_mb=p.bucket_mb, reserve_gib=0.0,
                   zero_prefetch=p.zero_prefetch, zero_reshard_after_forward=p.zero_reshard_after_forward,
                   virtual_stages=p.virtual_stages, lora_rank=cfg.lora.rank, lora_targets=tuple(cfg.lora.targets))


def planned_activations(cfg, world_size: int) -> list[float]:
    """The planner's activation bytes at the peak of each pipeline stage's ranks (plan/memory.py
    ``activation_bytes``, index = pp rank) for run ``cfg`` on ``world_size`` ranks: what
    ``PipelineExecutor.meter_activations`` measures."""
    from hpctrain.config import resolve_model
    from hpctrain.config.moe_keys import resolve_moe
    from hpctrain.plan.memory import activation_bytes
    from hpctrain.plan.shapes import for_tp
    from hpctrain.plan.stages import stages

    layout = Layout.from_config(cfg, world_size)
    model = resolve_model(cfg.model)
    moe = resolve_moe(cfg.moe, model)
    model = for_tp(model, layout.tp_size)
    recompute = bool(getattr(cfg.train, "recompute", False))
    return [activation_bytes(model, layout, st, recompute, run_options(cfg), moe) for st in stages(model, layout, moe)]


def predict_run(cfg, row: dict, device: str = "cpu", profile: str | None = None) -> dict | None:
    """``predicted_step_s``, ``predicted_tokens_per_s``, ``predicted_compute_s``, ``predicted_comm_s``
    (tp + cp + pp + ep all-to-alls + exposed dp + optimizer's reductions), ``predicted_bubble_s`` and
    ``predicted_memory_gib`` (memory per rank of the heaviest stage, hpctrain/plan/memory.py, without the reserve) for one sweep row; None
    when the model cannot tell (an invalid layout)."""
    from hpctrain.config import resolve_model
    from hpctrain.config.moe_keys import resolve_moe
    from hpctrain.plan.planner import predict

    p, t = cfg.parallel, cfg.train
    model = resolve_model(cfg.model)
    layout = Layout(row["ranks"], row["dp"], row["pp"], row["tp"], row["microbatches"], row["global_batch"],
                    t.seq_len, p.sequence_parallel, p.zero, p.schedule, tuple(p.stage_layers), p.virtual_stages,
                    int(row.get("cp") or p.cp), int(row.get("ep") or p.ep))
    try:
        layout.validate(model)
        machine = machine_for(row["ranks"], int(row.get("nodes") or 1), device, profile)
        options = run_options(cfg)
        moe = resolve_moe(cfg.moe, model)
        if moe is not None and options.lora_rank:
            return None  # the model has LoRA on dense models only
        pred = predict(model, layout, machine, recompute=bool(getattr(t, "recompute", False)), options=options,
                       moe=moe)
    except HpcTrainError:
        return None
    parts = pred.time
    return {"predicted_step_s": parts.step_s, "predicted_tokens_per_s": pred.tokens_per_s,
            "predicted_compute_s": parts.compute_s + parts.optimizer_s,
            "predicted_comm_s": parts.tp_comm_s + parts.cp_comm_s + parts.pp_comm_s + parts.dp_comm_s
            + parts.ep_comm_s,
            "predicted_bubble_s": parts.bubble_s,
            "predicted_memory_gib": pred.memory.total_gib}  # no reserve: next to the run's peak_memory_gib
