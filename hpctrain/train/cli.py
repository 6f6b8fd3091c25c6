"""``hpctrain train --config FILE.toml [section.key=value ...]``: run training on the launched ranks."""
from __future__ import annotations

import json
import os


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT with data, tensor and pipeline parallelism",
                       description="Train on the ranks started by mpiexec/srun. Any config key can be "
                                   "overridden as section.key=value (e.g. parallel.tp=2 train.steps=10).")
    p.add_argument("--config", help="TOML config (default: built-in defaults, tiny GPT)")
    p.add_argument("--resume", default=None, metavar="auto|PATH|none",
                   help="auto: newest complete checkpoint of the run (default under a batch scheduler); "
                        "PATH: a checkpoint directory; none: start fresh (default otherwise)")
    p.add_argument("--max-steps", type=int, default=0, metavar="N",
                   help="run at most N steps in this invocation, checkpoint and exit (job chains); 0 = no limit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.set_defaults(func=run)


BATCH_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "FLUX_JOB_ID")


def default_resume() -> str:
    """``auto`` inside a batch job (a requeued job must continue), ``none`` elsewhere."""
    return "auto" if any(v in os.environ for v in BATCH_JOB_VARIABLES) else "none"


def run(args) -> int:
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import config_to_dict, load_config
    from hpctrain.runtime.device import describe, select_device
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.metrics import MetricsLog
    from hpctrain.train.trainer import Trainer

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(args.config, args.overrides)  # identical on every rank: errors are raised everywhere
    info = discover()
    device = select_device(cfg.train.device, info)
    p = cfg.parallel
    grid = ProcessGrid.from_config(cfg, info)
    trainer = Trainer(cfg, grid, device=device)
    is_root = info.rank == 0
    if is_root:
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        with open(os.path.join(cfg.train.run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config_to_dict(cfg), f, indent=1)
        layout = " x ".join(f"{a}={grid.sizes[a]}" for a in ("dp", "pp", "tp"))
        bubble = f", pipeline bubble {trainer.bubble:.0%}" if grid.sizes["pp"] > 1 else ""
        print(f"hpctrain train: {info.size} ranks on {info.num_nodes} node(s), {layout}, schedule "
              f"{p.schedule}, {p.microbatches} micro-batches{bubble}, sequence parallel "
              f"{'on' if p.sequence_parallel else 'off'}, ZeRO-{p.zero}, {cfg.train.dtype}, device "
              f"{describe(device)}" + (f", GPU collectives backend {trainer.backends['dp']}"
                                       if device.type == "cuda" else ""), flush=True)
    checkpoints = CheckpointManager(cfg.checkpoint, grid, cfg.train.run_dir)
    resumed = checkpoints.resume(trainer, args.resume or default_resume())
    if is_root and resumed:
        print(f"hpctrain train: resumed from {resumed} at step {trainer.step} "
              f"(sample {trainer.batches.consumed})", flush=True)
    log = MetricsLog(cfg.train.run_dir, cfg.train.steps, enabled=is_root, progress=cfg.train.progress,
                     log_interval=cfg.train.log_interval)
    interval = cfg.checkpoint.interval
    stop = cfg.train.steps if args.max_steps <= 0 else min(cfg.train.steps, trainer.step + args.max_steps)
    try:
        while trainer.step < stop:
            log.log(trainer.train_step().as_dict())
            if interval and trainer.step % interval == 0 and trainer.step < stop:
                checkpoints.save(trainer)
        if trainer.step not in checkpoints.saved_steps and (resumed is None or trainer.step > 0):
            checkpoints.save(trainer)  # the final state; close() below flushes an async save
        checkpoints.close()
    finally:
        summary = log.close()
    if is_root and summary:
        with open(os.path.join(cfg.train.run_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    grid.close()
    return 0
