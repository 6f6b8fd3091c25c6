#!/usr/bin/env python
"""The last stage's LM head + cross-entropy, forward and backward, on the CPU: the plain path (logits
[tokens, vocab] in the training dtype, then the float32 vocab-parallel cross-entropy of
hpctrain/parallel/tensor_parallel.py) against the fused chunked one (hpctrain/parallel/head_loss.py,
``model.fused_head_loss``), for a GPT-2-small-like head.

    python benchmarks/bench_head_loss.py --tokens 8192 --dtypes float32,bfloat16 --repeats 3 --out head_loss

Each (dtype, path) runs in a fresh process (this script again, ``--child``): inputs h [tokens, hidden] and the
head W [padded vocab, hidden] (the vocabulary padded to a multiple of 128 as ``model.vocab_multiple``), then
``--repeats`` timed steps of loss = sum(per-token loss) / tokens; loss.backward() (dh and dW). Per row:
- ``time_s``: median seconds of a step (``min``/``max``: the range over the repeats); ``cpu_s``: the same in
  the process's CPU time (what a shared machine's other jobs disturb less);
- ``peak_mib``: the process's peak resident memory during the steps (VmHWM of /proc/self/status, reset through
  /proc/self/clear_refs first) less its resident memory before them (torch, the inputs): what the step
  allocates at its peak (its own dh and dW included);
- ``saved_mib``: the bytes autograd saves for backward in the step (storages counted once, h and W not;
  the fused path's dh and dW, formed in forward, are counted).
One torch thread (``--threads``); ``--chunks``: extra fused rows with fixed ``model.loss_chunk_tokens``.
Writes <out>.csv and <out>.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

FIELDS = ["dtype", "path", "chunk", "tokens", "hidden", "vocab", "time_s", "min_s", "max_s", "cpu_s", "cpu_min_s",
          "cpu_max_s", "peak_mib", "saved_mib", "loss"]


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def child(args) -> dict:
    """One (dtype, path) in this process; returns its row."""
    import torch
    import torch.nn.functional as F

    from hpctrain.parallel.head_loss import chunk_tokens, fused_head_cross_entropy
    from hpctrain.parallel.tensor_parallel import vocab_parallel_cross_entropy

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    padded = -(-args.vocab // 128) * 128
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(padded, args.hidden, generator=g) * 0.02).to(dtype)
    weight[args.vocab:] = 0
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    chunk = chunk_tokens(args.chunk, args.tokens, padded) if args.path == "fused" else args.tokens

    def step():
        if args.path == "fused":  # the summed loss; dh and dW formed in forward
            total = fused_head_cross_entropy(h, weight, targets, None, 0, args.vocab, chunk)
        else:
            total = vocab_parallel_cross_entropy(F.linear(h, weight)[:, :args.vocab], targets, None, 0).sum()
        loss = total / args.tokens
        loss.backward()
        return float(loss)

    inputs = {h.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    saved, seen = [0], set(inputs)

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            saved[0] += t.untyped_storage().nbytes()
        return t

    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current RSS
    times, cpu = [], []
    for _ in range(args.repeats):
        h.grad = weight.grad = None
        saved[0], seen = 0, set(inputs)  # what this step saves
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"dtype": args.dtype, "path": args.path, "chunk": chunk, "tokens": args.tokens, "hidden": args.hidden,
            "vocab": args.vocab, "time_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "cpu_s": statistics.median(cpu), "cpu_min_s": min(cpu), "cpu_max_s": max(cpu),
            "peak_mib": (_status_kib("VmHWM") - base) / 1024, "saved_mib": saved[0] / 2**20, "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257, help="true vocabulary (padded to a multiple of 128)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--chunks", default="", help="extra fused rows with these chunk sizes (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="head_loss", help="writes <out>.csv and <out>.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="fused", help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    common = [f"--tokens={args.tokens}", f"--hidden={args.hidden}", f"--vocab={args.vocab}",
              f"--repeats={args.repeats}", f"--threads={args.threads}"]
    runs = [("plain", 0), ("fused", 0)] + [("fused", int(c)) for c in args.chunks.split(",") if c]
    rows = []
    print(f"{'dtype':9} {'path':6} {'chunk':>6} {'wall s (min-max)':>22} {'CPU s (min-max)':>22} {'peak MiB':>9} "
          f"{'saved MiB':>10} {'loss':>10}")
    for dtype in args.dtypes.split(","):
        for path, chunk in runs:
            out = subprocess.run([sys.executable, __file__, "--child", f"--dtype={dtype}", f"--path={path}",
                                  f"--chunk={chunk}", *common], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            wall = f"{row['time_s']:.2f} ({row['min_s']:.2f}-{row['max_s']:.2f})"
            cpu = f"{row['cpu_s']:.2f} ({row['cpu_min_s']:.2f}-{row['cpu_max_s']:.2f})"
            print(f"{dtype:9} {path:6} {row['chunk']:>6} {wall:>22} {cpu:>22} {row['peak_mib']:>9.0f} "
                  f"{row['saved_mib']:>10.1f} {row['loss']:>10.6f}", flush=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    with open(args.out + ".csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
