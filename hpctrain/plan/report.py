"""The text report of ``hpctrain plan``: the best layouts, where their time goes, why others do not fit."""
from __future__ import annotations

from hpctrain.config.arithmetic import active_parameters, adapter_parameters, count_parameters


def _layout(p: dict) -> str:
    recompute = {"full": "recompute", "selective": "selective-recompute"}.get(p["recompute"], "")
    extras = [name for name, on in ((f"zero{p['zero']}", p["zero"]), ("sp", p["sequence_parallel"]),
                                    (recompute, recompute), (f"V={p['virtual_stages']}", p["virtual_stages"] > 1))
              if on]
    cp = f" cp={p['cp']}" if p.get("cp", 1) > 1 else ""
    ep = f" ep={p['ep']}" if p.get("ep", 1) > 1 else ""
    return (f"dp={p['dp']}{cp}{ep} tp={p['tp']} pp={p['pp']} M={p['microbatches']}"
            + (f" +{'+'.join(extras)}" if extras else ""))


def print_plans(result, machine, model, name: str, global_batch: int, seq_len: int, options, top: int,
                moe=None) -> None:
    dev = machine.device
    window = getattr(model, "attention_window", 0)
    experts = (f", {active_parameters(model, moe) / 1e9:.2f}B active: {moe.num_experts} experts, top {moe.top_k}, "
               f"in {len(moe.layers)} of {model.n_layers} blocks" if moe is not None else "")
    print(f"plan: {name} ({count_parameters(model, moe) / 1e9:.2f}B parameters{experts}), global batch "
          f"{global_batch} x {seq_len} tokens{f', attention window {window}' if window else ''}, {options.dtype}")
    print(f"machine: {machine.nodes} node(s) x {machine.gpus_per_node} {dev.name} "
          f"({dev.peak(options.dtype):g} TFLOP/s peak x {dev.efficiency:.2f}, {machine.memory_gib():.0f} GiB); "
          f"links: {machine.links.source or 'given'}")
    if options.lora_rank:
        trainable = adapter_parameters(model, options.lora_rank, options.lora_targets)
        print(f"LoRA rank {options.lora_rank} on {','.join(options.lora_targets)}: {trainable / 1e6:.3g}M trainable "
              f"parameters, the base frozen (no gradients or optimizer state; no weight gradients in the backward)")
    if any(pred.candidate.layout.zero == 3 for pred in result.plans[:top]):
        print(f"ZeRO-3: {options.zero_prefetch} unit(s) prefetched, parameters "
              f"{'resharded after each forward' if options.zero_reshard_after_forward else 'kept gathered over the step'}")
    skipped = (f"; {result.tp_across_nodes_skipped} (dp, cp, tp, pp) with tp across nodes not searched "
               f"(--allow-tp-across-nodes)") if result.tp_across_nodes_skipped else ""
    print(f"evaluated {result.evaluated} layouts, {len(result.plans)} fit{skipped}\n")
    if result.plans:
        print(f"{'#':>2} {'layout':<38} {'step s':>8} {'tokens/s':>10} {'TFLOP/s/dev':>11} {'MFU':>5} "
              f"{'GiB/dev':>8} {'bubble':>6}")
        for i, pred in enumerate(result.plans[:top], 1):
            p = pred.to_dict()
            mfu = f"{p['mfu']:.0%}" if p["mfu"] is not None else "-"
            print(f"{i:>2} {_layout(p):<38} {p['predicted_step_s']:>8.3g} {p['predicted_tokens_per_s']:>10.4g} "
                  f"{p['predicted_tflops_per_device']:>11.4g} {mfu:>5} {p['memory_gib_per_device']:>8.1f} "
                  f"{p['bubble_fraction']:>6.1%}")
        warned = [(i, w) for i, pred in enumerate(result.plans[:top], 1) for w in pred.warnings()]
        for i, warning in warned:
            print(f"{i:>2} WARNING: {warning}")
        print("\nwhere the time goes (seconds per step; tp inside a node, cp next to it, pp and dp where the grid "
              "places them; cp_comm: the ring's exchange not hidden behind attention"
              + ("; ep_comm: the experts' all-to-alls" if moe is not None else "") + "):")
        for i, pred in enumerate(result.plans[:min(top, 3)], 1):
            p = pred.to_dict()
            parts = ", ".join(f"{k} {v:.3g}" for k, v in p["breakdown_s"].items() if v > 0)
            mem = ", ".join(f"{k} {v:.1f}" for k, v in p["memory_gib"].items() if v > 0)
            place = " ".join(f"{k}:{v}" for k, v in p["placement"].items())
            local = f"; local sequence {p['seq_chunk']} tokens per rank" if p.get("cp", 1) > 1 else ""
            print(f"{i:>2} {parts}\n   memory per GPU {p['memory_gib_per_device']:.1f} GiB: {mem}; micro-batch "
                  f"{p['micro_batch']} sequence(s) x {p['microbatches']} per replica; placement {place}{local}")
    else:
        print("no layout fits: see the reasons below")
    if result.infeasible:
        print("\nnot feasible:")
        for item in result.infeasible[:12]:
            lay = " ".join(f"{k}={v}" for k, v in item.layout.items())
            print(f"  {lay}: {item.reason}")
        if len(result.infeasible) > 12:
            print(f"  ... and {len(result.infeasible) - 12} more (--json lists all)")
