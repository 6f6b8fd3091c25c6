"""benchmarks/bench_gpu_train.py on the CPU (its smoke mode): both implementations run in their own
processes, report every field, and train the same model on the same batches to the same loss (float32,
constant learning rate), so the GPU session measures two loops that do the same work."""
import json
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, mpi_env


def test_bench_gpu_train_smoke_on_cpu_trains_both_loops_to_the_same_loss(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "benchmarks/bench_gpu_train.py", "--device", "cpu", "--presets", "tiny", "--seq-len", "32",
           "--micro-batch", "2", "--global-batch", "4", "--warmup", "2", "--steps", "2", "--compile", "false",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=mpi_env(), timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"hpctrain", "torch"}
    hp, peer = rows["hpctrain"], rows["torch"]
    assert peer["ratio"] == 1.0 and hp["ratio"] == pytest.approx(hp["tokens_per_s"] / peer["tokens_per_s"])
    assert hp["params"] == peer["params"] > 0 and hp["micro_batch"] == 2 and hp["global_batch"] == 4
    assert hp["final_loss"] == pytest.approx(peer["final_loss"], rel=1e-4), (hp, peer)  # 4 steps of the same AdamW
    assert 0 < hp["peak_memory_gib"] < 8 and hp["mfu"] is None  # no GPU peak on the CPU
    no_gpu = subprocess.run([sys.executable, "benchmarks/bench_gpu_train.py", "--presets", "tiny"], capture_output=True,
                            text=True, cwd=ROOT, env=mpi_env(), timeout=120, stdin=subprocess.DEVNULL)
    assert no_gpu.returncode == 2 and "needs a CUDA GPU" in no_gpu.stderr
