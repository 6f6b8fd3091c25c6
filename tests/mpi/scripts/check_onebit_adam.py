"""1-bit Adam on real ranks against a reference computed from every replica's gradients (float64).

    mpiexec -n K python -m mpi4py check_onebit_adam.py --layouts "4,1,1;2,2,1;2,1,2;2,1,1,2" [overrides]

For each layout "dp,tp,pp[,cp]" (ZeRO-1 off and on; with cp the replica group is dp x cp) train ``--steps`` steps with compression.method=onebit-adam.
At every compressed step each rank records its own main grads g_r and the momentum m before the step;
the reference (on every rank, from all replicas' g_r) is the algorithm written out plainly:

  c_r = beta1 m / p + (1 - beta1) g_r;  e_r: worker error, s_j: server error of chunk j (zero at the freeze)
  sent_r = C(c_r + e_r) chunk by chunk;  e_r = c_r + e_r - sent_r
  sum_j = sum_r sent_r[j] (rank order);  out_j = C(sum_j + s_j);  s_j = sum_j + s_j - out_j
  m' = [out_0 ... out_{p-1}] * mask (vocabulary and bucket padding masked)

with C = decompress(compress(.)) of onebit-adam's compressor (sign + a scale per 2048 values). Checked:
the committed momentum == m' bit for bit; it is the same on every rank of the replica group; exp_avg_sq is unchanged since the freeze;
the parameters are the same on every replica. With ``--overflow-at K train.dtype=float16`` the loss scale is
forced to 2^30 at step K: the float16 overflow skips steps (momentum kept, errors cleared) while the scale
halves, and later steps equal the reference again. Prints "ONEBIT-ADAM OK <n>" on world rank 0.
"""
import argparse

import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.compression.quantize import BlockOneBit
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer


def roundtrip(compressor, x):
    return compressor.decompress(compressor.compress(x), x.numel(), x.dtype)


class Reference:
    """1-bit Adam's averaged momentum from every replica's gradients, with its own error buffers."""

    def __init__(self, p, beta1):
        self.p, self.beta1, self.compressor = p, beta1, BlockOneBit(None)
        self.worker, self.server = {}, {}  # (bucket, replica rank) / (bucket, chunk) -> error

    def momentum(self, index, momentum, grads, mask, scale=1.0):
        p, n = self.p, momentum.numel()
        c = n // p
        sent = []
        for r, g in enumerate(grads):
            share = momentum * (self.beta1 / p) + g * ((1 - self.beta1) / scale)
            error = self.worker.get((index, r))
            corrected = share.clone() if error is None else share + error
            out = torch.cat([roundtrip(self.compressor, corrected[j * c:(j + 1) * c]) for j in range(p)])
            self.worker[index, r] = corrected - out
            sent.append(out)
        chunks = []
        for j in range(p):
            total = torch.zeros(c, dtype=momentum.dtype)
            for out in sent:
                total += out[j * c:(j + 1) * c]
            error = self.server.get((index, j))
            corrected = total.clone() if error is None else total + error
            out = roundtrip(self.compressor, corrected)
            self.server[index, j] = corrected - out
            chunks.append(out)
        return torch.cat(chunks) * mask


def check(cfg, world, tokens, steps, overflow_at=0):
    """``overflow_at`` K > 0 (float16): before step K the loss scale is set to 2^30, so the scaled gradients
    overflow float16 and the scaler halves the scale and skips steps until they fit: each skipped step
    must leave the momentum as it was and clear both error buffers; the steps after go on equal to the
    reference (which clears its errors too)."""
    grid = ProcessGrid.from_config(cfg, discover(world), mpi_world=world, timeout_s=120)
    trainer = Trainer(cfg, grid, tokens=tokens)
    reducer, flat = trainer.parts.reducer, trainer.parts.params.flat.parts[0]  # the dense group's
    optimizer = trainer.parts.optimizer.parts[0]
    replicas = flat.dp_comm.mpi
    reference = Reference(flat.dp_size, cfg.optim.beta1)
    seen = {}
    start = reducer._start

    def recording_start(bucket):
        if reducer.compressing:
            seen[bucket.index] = (optimizer.full_momentum[bucket.index].clone(), reducer.grads(bucket).clone(),
                                  reducer.loss_scale)
        return start(bucket)

    reducer._start = recording_start
    frozen, checks, skipped = None, 0, 0
    for step in range(steps):
        seen.clear()
        if step + 1 == overflow_at:
            trainer.parts.scaler.load_state_dict({"scale": 2.0 ** 30, "good_steps": 0})  # host and device scale
        before = {i: m.clone() for i, m in optimizer.full_momentum.items()}
        record = trainer.train_step()
        if record.skipped:
            assert seen, f"step {step + 1}: skipped before the freeze"
            assert all(torch.equal(before[i], m) for i, m in optimizer.full_momentum.items()), \
                f"step {step + 1}: a skipped step moved the momentum"
            assert not reducer.memory.residuals, \
                f"step {step + 1}: a skipped step left error feedback behind"
            reference.worker.clear()
            reference.server.clear()
            skipped += 1
            continue
        if not seen:
            assert optimizer.step_count <= cfg.compression.warmup_steps, "no compressed step after the warm-up"
            frozen = [s.exp_avg_sq.clone() for s in optimizer.owned_slices]
            continue
        for index, (momentum, grads, scale) in sorted(seen.items()):
            everyone = [torch.from_numpy(g) for g in replicas.allgather(grads.numpy())]
            want = reference.momentum(index, momentum, everyone, reducer.masks[index], scale)
            got = optimizer.full_momentum[index]
            assert torch.equal(got, want), f"step {step + 1} bucket {index}: {(got - want).abs().max()}"
            others = replicas.allgather(got.numpy().tobytes())
            assert all(o == others[0] for o in others), f"step {step + 1}: the momentum differs between replicas"
            checks += 1
        assert all(torch.equal(s.exp_avg_sq, f) for s, f in zip(optimizer.owned_slices, frozen)), "variance moved"
        params = replicas.allgather(flat.param_buffer.numpy().tobytes())
        assert all(p == params[0] for p in params), f"step {step + 1}: parameters differ between replicas"
    grid.close()
    assert not overflow_at or skipped >= 1, "the forced overflow skipped no step"
    return checks, skipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help='";"-separated "dp,tp,pp" or "dp,tp,pp,cp"')
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--overflow-at", type=int, default=0, help="float16: force an overflow at this step")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    base = ["data.max_bytes=300000", "train.global_batch=8", "train.seq_len=16", "model.n_layers=2",
            "train.dtype=float64", "parallel.microbatches=2", "train.lr=1e-2", "model.vocab_size=257",
            "compression.method=onebit-adam", "compression.warmup_steps=2", "parallel.bucket_mb=0.2"] + args.overrides
    cfg0 = load_config(None, base)
    tokens = load_tokens_collective(world, cfg0.data.source, cfg0.data.cache_dir, cfg0.data.max_bytes)
    total = 0
    for layout in args.layouts.split(";"):
        dp, tp, pp, cp = ([int(v) for v in layout.split(",")] + [1])[:4]
        for zero in (0, 1):
            cfg = load_config(None, base + [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                            f"parallel.cp={cp}", f"parallel.zero={zero}"])
            checks, skipped = check(cfg, world, tokens, args.steps, args.overflow_at)
            assert checks > 0
            total += checks
            if world.Get_rank() == 0:
                print(f"OK dp={dp} tp={tp} pp={pp} cp={cp} zero={zero}: {checks} bucket-steps equal the reference, "
                      f"{skipped} overflow steps skipped", flush=True)
    if world.Get_rank() == 0:
        print(f"ONEBIT-ADAM OK {total}")


if __name__ == "__main__":
    main()
