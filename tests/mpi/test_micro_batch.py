"""``train.micro_batch_size``: gradient accumulation with one dp reduction per step, the same training as the
default micro-batching (float64, relative error <= 1e-10), in dp=2 and dp=2 x pp=2 (check_micro_batch.py)."""
from mpirun import run_mpi


def test_micro_batch_sizes_train_alike_and_reduce_once_per_step():
    result = run_mpi(4, "check_micro_batch.py", "--sizes", "1,2,4", timeout=300)
    out = result.stdout
    assert "MICRO-BATCH OK 6 runs" in out, out
    for layout in ("dp=2", "dp=2 x pp=2"):
        for size, count in ((1, 4), (2, 2), (4, 1)):
            assert f"OK {layout} micro_batch_size={size}: {count} micro-batch(es) of {size}," in out, out
