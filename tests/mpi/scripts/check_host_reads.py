"""No host read of a device value inside a deferred training step, in every layout given.

    mpiexec -n 4 python -m mpi4py check_host_reads.py "dp=2 pp=2:parallel.zero=1" ... [section.key=value ...]

Each case is "dp=A tp=B pp=C cp=D[:extra overrides separated by spaces]" (sizes left out are 1). A Trainer
takes one step, then ``--steps`` steps ``train_step(defer=True)`` (the training loop's call) under
``HostReadAudit`` (hpctrain/profiling/host_reads.py): every ``.item()``, ``bool(tensor)``, data-shaped op
or blocking device-to-host copy that hpctrain's code makes inside them is a site where the host would
wait for a GPU; on CUDA, torch's own sync debug mode ("warn") is on as well and each "called a synchronizing
CUDA operation" warning it gives is a site too (``sync_warnings``; not the mode's one-time notice). World rank 0 prints each case's sites over all ranks and "HOST READS OK" when none.
"""
import argparse
import warnings

import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.profiling.host_reads import HostReadAudit, sync_warnings
from hpctrain.runtime.device import select_device
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer


def audited_steps(cfg, world, tokens, steps: int) -> list[str]:
    info = discover(world)
    device = select_device(cfg.train.device, info)  # as `hpctrain train` picks it (cuda: this rank's GPU)
    grid = ProcessGrid.from_config(cfg, info, mpi_world=world, timeout_s=120)
    trainer = Trainer(cfg, grid, tokens=tokens, device=device)
    assert cfg.train.device != "cuda" or trainer.device.type == "cuda", trainer.device
    trainer.train_step(defer=True)  # the first step builds what later steps reuse
    cuda = trainer.device.type == "cuda"
    if cuda:  # before recording: its one-time "prototype feature" notice is no host read
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with HostReadAudit() as audit, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                trainer.train_step(defer=True)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    trainer.read_pending()
    assert trainer.diverged is None and len(trainer.finished_steps()) == steps + 1
    grid.close()
    return audit.lines() + [f"cuda sync debug: {text}" for text in sync_warnings(caught)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help='"dp=2 pp=2[:key=value ...]"')
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    base = ["data.max_bytes=200000", "train.global_batch=8", "train.seq_len=32", "model.n_layers=2",
            "model.d_ff=128", "train.warmup_steps=1", "train.progress=false"]
    cfg0 = load_config(None, base)
    tokens = load_tokens_collective(world, cfg0.data.source, cfg0.data.cache_dir, cfg0.data.max_bytes)
    clean = True
    for case in args.cases:
        sizes, _, extra = case.partition(":")
        keys = [f"parallel.{kv}" for kv in sizes.split()] + extra.split()
        sites = world.gather(audited_steps(load_config(None, base + keys), world, tokens, args.steps), root=0)
        if world.Get_rank() == 0:
            found = sorted({line for rank_lines in sites for line in rank_lines})
            clean = clean and not found
            print(f"{case}: {len(found)} host read site(s){''.join(chr(10) + '  ' + s for s in found)}", flush=True)
    if world.Get_rank() == 0 and clean:
        print("HOST READS OK", flush=True)


if __name__ == "__main__":
    main()
