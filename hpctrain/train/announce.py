"""What ``hpctrain train`` says on rank 0 as it starts: the layout, schedule, precision, device, attention
kernel, compile, LoRA and where the run starts from (``announce``; the resolved config goes to
<run_dir>/config.json), and with ``--verbose`` the first step's phases and torch.compile's graphs
(``first_step_report``)."""
from __future__ import annotations

import json
import os
import sys

from hpctrain.comm.staging import staged_bytes, staging_warning
from hpctrain.config import config_to_dict
from hpctrain.models.compile import compile_report
from hpctrain.models.lora import describe as describe_lora
from hpctrain.parallel.head_loss import describe_head
from hpctrain.parallel.schedules import bubble_formula
from hpctrain.config.rules import padded_vocab
from hpctrain.runtime.device import describe
from hpctrain.train.metrics import describe_state, model_state_bytes


def announce(cfg, grid, trainer, device, resumed, verbose: bool = False) -> None:
    info, p, parts = grid.info, cfg.parallel, trainer.parts
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    with open(os.path.join(cfg.train.run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_to_dict(cfg), f, indent=1)
    layout = " x ".join(f"{a}={grid.sizes[a]}" for a in ("dp", "pp", "cp", "tp") if a != "cp" or grid.sizes[a] > 1)
    layout += f" x ep={p.ep}" if p.ep > 1 else ""  # experts split over ep ranks of the replica group
    schedule = p.schedule + (f" (virtual_stages={p.virtual_stages})" if p.schedule == "interleaved" else "")
    formula = bubble_formula(p.schedule)
    bubble = (f", pipeline bubble {formula} = {parts.bubble:.1%} of "
              f"the ideal step" if grid.sizes["pp"] > 1 else "")
    m, tp = parts.model_cfg, grid.sizes["tp"]  # the last stage's tokens per micro-batch, its vocabulary slab
    head = describe_head(m.fused_head_loss, m.loss_chunk_tokens, parts.layout.micro_batch * cfg.train.seq_len //
                         grid.sizes["cp"], padded_vocab(m, tp) // tp,
                         compiled=any(s.head_chunks is not None for s in parts.stages))
    if parts.head_kernel.name != "hpctrain":  # model.head_kernel: another library's kernel won its trial
        head = f"head kernel {parts.head_kernel.name} (trial)"
    dp_route = grid.intra_node + grid.intra_node_routes.note()  # auto: what its measured table sends through shm
    residual = " (float32 residual)" if parts.executor.act_dtype != parts.dtype else ""  # model.residual_dtype
    print(f"hpctrain train: {info.size} ranks on {info.num_nodes} node(s), {layout}, schedule "
          f"{schedule}, {parts.layout.microbatches} micro-batch(es) of {parts.layout.micro_batch} sequence(s) per "
          f"replica{bubble}, sequence parallel "
          f"{'on' if p.sequence_parallel else 'off'}, ZeRO-{p.zero}, dp reduction {dp_route}, "
          f"{cfg.train.dtype}{residual}, device {describe(device)}, attention {parts.sdpa.name}, {head}"
          + (f", GPU collectives backend {parts.backends['dp']}" if device.type == "cuda" else ""), flush=True)
    staging = host_staging_warning(cfg, grid, parts) if device.type == "cuda" else ""
    if staging:  # CuPy missing, NCCL unavailable: its cause and cost per step, once
        print(f"hpctrain: WARNING: {staging}", file=sys.stderr, flush=True)
    replicas = grid.sizes["dp"] * grid.sizes["cp"]
    print(f"hpctrain train: model state on rank 0: {describe_state(model_state_bytes(parts))} (ZeRO-{p.zero} over "
          f"{replicas} replica(s)" + (f", units gathered with prefetch {p.zero_prefetch}, reshard after forward "
          f"{'on' if p.zero_reshard_after_forward else 'off'}" if p.zero == 3 else "") + f"), built in "
          f"{parts.build_s:.1f} s (only this rank's parameter bytes created)",
          flush=True)
    if p.zero and replicas == 1:
        print(f"hpctrain: WARNING: parallel.zero={p.zero} with one replica (dp x cp = 1): nothing to shard",
              file=sys.stderr, flush=True)
    elif p.zero and p.ep > 1 and replicas // p.ep == 1:
        print(f"hpctrain: WARNING: parallel.zero={p.zero} with parallel.ep={p.ep} = dp x cp: each expert lives on one "
              f"rank (its replica group has one rank), so the experts' state is not sharded; only the dense "
              f"parameters' is", file=sys.stderr, flush=True)
    if parts.sdpa.warning:  # the same on every rank: said once
        print(f"hpctrain: WARNING: {parts.sdpa.warning}", file=sys.stderr, flush=True)
    if parts.sdpa.note:  # a fast kernel that raised in its trial, or cuDNN missing: what runs instead
        print(f"hpctrain train: {parts.sdpa.note}", flush=True)
    if verbose and parts.sdpa.timings:  # each SDPA kernel's trial, forward + backward
        print(f"hpctrain train: attention kernel trials (forward + backward): {parts.sdpa.timings}", flush=True)
    if parts.head_kernel.note:  # a head kernel asked for or tried that does not run: why, and what runs instead
        print(f"hpctrain train: {parts.head_kernel.note}", flush=True)
    if verbose and parts.host_malloc:  # train.host_malloc: whether freed host memory is kept for reuse
        print(f"hpctrain train: {parts.host_malloc}", flush=True)
    if verbose and parts.head_kernel.timings:  # each head kernel's trial, forward + backward
        print(f"hpctrain train: head kernel trials (forward + backward): {parts.head_kernel.timings}", flush=True)
    fp8 = trainer.fp8  # train.fp8 (hpctrain/models/fp8.py): the recipe, the linears it covers, any fallback
    for line in fp8.lines if fp8 is not None else ():
        print(f"hpctrain train: {line}", flush=True)
    for line in fp8.warnings if fp8 is not None else ():
        print(f"hpctrain: WARNING: {line}", file=sys.stderr, flush=True)
    # the fused head's compiled chunks (not when the start-up trial picked a library's kernel)
    chunks = any(s.head_chunks is not None for s in parts.stages) and parts.head_kernel.fn is None
    chunk_words = ", and of each fused head + loss chunk" + (", two calls around the tp all-gather"
                                                              if parts.layout.tp_size > 1 else "")
    if parts.compiled and any(s.compiled_whole is not None or s.compiled_hidden is not None for s in parts.stages):
        what = "embedding to final norm, one region" + chunk_words if chunks else "embedding to loss, one region"
        print(f"hpctrain train: torch.compile of the whole stage, {what} (train.compile="
              f"{cfg.train.compile}; dp = pp = tp = cp = 1: no reduction for per-block regions to overlap)", flush=True)
    elif parts.compiled:
        tail = ""
        if any(s.compiled_tail is not None for s in parts.stages):  # the last stage's, under tp too
            tail = ", and of the final norm, LM head and loss" + (" (broken at the tp collectives)"
                                                                   if parts.layout.tp_size > 1 else "")
        elif chunks:
            tail = ", the final norm" + chunk_words
        print(f"hpctrain train: torch.compile of every block{tail} (train.compile={cfg.train.compile})", flush=True)
    if parts.optimizer.update_kind == "compiled":
        print(f"hpctrain train: AdamW in one compiled pass over the flat float32 buffers, the parameters written "
              f"by it (optim.update={cfg.optim.update})", flush=True)
    if hasattr(parts.data.sampler, "describe"):  # packed SFT examples (hpctrain/data/packing.py)
        print(f"hpctrain train: {parts.data.sampler.describe()}", flush=True)
    if cfg.lora.rank:
        print(f"hpctrain train: {describe_lora(parts.model_cfg, cfg.lora, cfg.train.dtype, cfg.optim)}", flush=True)
        reference = trainer.state.base_reference
        why = "lora.checkpoint_base=copy" if cfg.lora.checkpoint_base == "copy" else "no model.init_from base to refer to"
        print(f"hpctrain train: checkpoints refer to the frozen base {reference['path']} (checksum "
              f"{reference['checksum'][:16]}, checked on resume)" if reference else
              f"hpctrain train: checkpoints copy the frozen base weights ({why})", flush=True)
    if resumed:
        print(f"hpctrain train: resumed from {resumed} at step {trainer.step} "
              f"(sample {parts.data.batches.consumed})", flush=True)
    elif cfg.model.init_from:
        print(f"hpctrain train: weights initialised from {cfg.model.init_from} (model.init_from)", flush=True)


def first_step_report(record: dict, since: dict | None, setting: str) -> list[str]:
    """``hpctrain train --verbose``: the first step's time by phase (a StepMetrics dict) and what
    torch.compile made of the model since the reading ``since`` (None: compile off, ``train.compile=setting``)."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in sorted(record["time_s"].items(), key=lambda kv: -kv[1]) if v >= 5e-4)
    lines = [f"first step {record['step_time_s']:.3f} s (s by phase: {phases})"]
    if since is None:
        return lines + [f"torch.compile off (train.compile={setting})"]
    return lines + compile_report(since)


def host_staging_warning(cfg, grid, parts) -> str:
    """The warning of a CUDA run whose groups stage their collectives through host memory
    (hpctrain/comm/staging.py), "" when none does."""
    cost = staged_bytes(grid.sizes, grad_params=sum(p.numel() for p in parts.local_model.parameters()
                                                    if p.requires_grad),
                        local_layers=sum(len(stage.layers) for stage in parts.stages),
                        tokens=parts.layout.micro_batch * cfg.train.seq_len // grid.sizes["cp"],
                        d_model=parts.model_cfg.d_model, act_bytes=parts.executor.act_dtype.itemsize,
                        microbatches=parts.layout.microbatches)
    return staging_warning(parts.backends, {axis: grid.comm(axis).staged_because for axis in parts.backends}, cost)
