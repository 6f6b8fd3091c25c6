"""The flat AdamW step, fused (``torch._fused_adamw_`` over the owned runs) against the unfused in-place ops.

One process, float32, a flat buffer of N elements laid out like a GPT's (matrices with weight decay, norm
vectors without), a clipping coefficient: the median of ``--repeats`` timed ``FlatOptimizer.step`` calls.

    OMP_NUM_THREADS=1 python benchmarks/bench_adamw.py --sizes 1.1e6,30e6
"""
import argparse
import statistics
import time

import torch
from torch import nn

from hpctrain.config import OptimConfig
from hpctrain.optim.flat import FlatOptimizer
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.slab import SlabSpec


def flat_of(n: int, d: int = 256) -> FlatParams:
    """Blocks of a [d, 4d] matrix and a [d] norm vector until about ``n`` elements."""
    params, shapes = [], []
    while sum(map(lambda s: s[0] * (s[1] if len(s) > 1 else 1), shapes)) < n:
        shapes += [(d, 4 * d), (d,)]
    for i, shape in enumerate(shapes):
        p = nn.Parameter(torch.randn(shape))
        p.spec = SlabSpec(f"p{i}", shape)
        params.append(p)
    return FlatParams(params, None)


def time_step(flat: FlatParams, fused: bool, repeats: int, device) -> float:
    opt = FlatOptimizer(flat, OptimConfig(weight_decay=0.1), fused=fused)
    flat.grad_buffer.normal_()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    opt.step(1e-4, 0.5)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        opt.step(1e-4, 0.5)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1.1e6,30e6", help="flat buffer sizes (elements), comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")
    for n in (int(float(s)) for s in args.sizes.split(",")):
        with torch.device(device):
            flat = flat_of(n)
        unfused = time_step(flat, False, args.repeats, device)
        fused = time_step(flat, True, args.repeats, device)
        print(f"{flat.param_buffer.numel():>10} elements: unfused {unfused * 1e3:8.2f} ms, fused {fused * 1e3:8.2f} ms "
              f"({unfused / fused:.2f}x)")


if __name__ == "__main__":
    main()
