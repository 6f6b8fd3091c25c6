"""One AdamW update of one float32 buffer (1.1 M and 30 M elements) three ways: ``torch._fused_adamw_``
(with a device grad_scale), ``torch._foreach_*`` ops, and a ``torch.compile``'d update; median ms.

    OMP_NUM_THREADS=1 python benchmarks/bench_adamw_variants.py
"""
import time, statistics, torch
torch.manual_seed(0)
def bench(fn, reps):
    fn(); fn()
    ts = []
    for _ in range(reps):
        s = time.perf_counter(); fn(); ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e3
b1, b2, eps, lr, wd, step = 0.9, 0.95, 1e-8, 1e-4, 0.1, 3
bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
def compiled_update(p, g, m, v, coef):
    g = g * coef
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.mul_(1 - lr * wd)
    p.sub_(lr / bc1 * m / (v.sqrt() / bc2 ** 0.5 + eps))
cu = torch.compile(compiled_update)
for N in (1_100_000, 30_000_000):
    reps = 20 if N < 2e6 else 5
    p, g, m, v = (torch.randn(N) for _ in range(4)); v.abs_()
    st = torch.tensor(float(step)); gs = torch.tensor(2.0)
    fused = bench(lambda: torch._fused_adamw_([p], [g], [m], [v], [], [st], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False, grad_scale=gs), reps)
    P, G, M, V = [p], [g], [m], [v]
    def foreach():
        gg = torch._foreach_mul(G, 0.5)
        torch._foreach_lerp_(M, gg, 1 - b1)
        torch._foreach_mul_(V, b2); torch._foreach_addcmul_(V, gg, gg, value=1 - b2)
        torch._foreach_mul_(P, 1 - lr * wd)
        d = torch._foreach_sqrt(V); torch._foreach_div_(d, bc2 ** 0.5); torch._foreach_add_(d, eps)
        torch._foreach_addcdiv_(P, M, d, value=-lr / bc1)
    fe = bench(foreach, reps)
    c0 = time.perf_counter(); cu(p, g, m, v, 0.5); ct = time.perf_counter() - c0
    comp = bench(lambda: cu(p, g, m, v, 0.5), reps)
    print(f"N={N}: fused {fused:.2f} ms, foreach {fe:.2f} ms, torch.compile {comp:.2f} ms (first call {ct:.1f} s), threads {torch.get_num_threads()}", flush=True)
