"""``train.micro_batch_size``: gradient accumulation with one dp reduction per step, the same training as the
default micro-batching (float64, relative error <= 1e-10), in dp=2 and dp=2 x pp=2 (check_micro_batch.py)."""
import json
import re

from mpirun import run_mpi


def test_micro_batch_sizes_train_alike_and_reduce_once_per_step():
    result = run_mpi(4, "check_micro_batch.py", "--sizes", "1,2,4", timeout=300)
    out = result.stdout
    assert "MICRO-BATCH OK 6 runs" in out, out
    for layout in ("dp=2", "dp=2 x pp=2"):
        for size, count in ((1, 4), (2, 2), (4, 1)):
            assert f"OK {layout} micro_batch_size={size}: {count} micro-batch(es) of {size}," in out, out


CLI = ["--config", "configs/tiny.toml", "data.max_bytes=100000", "train.seq_len=32", "train.global_batch=8",
       "model.n_layers=2", "parallel.tp=1", "parallel.pp=2", "parallel.microbatches=1"]


def test_cli_announces_the_micro_batch_and_reports_peak_memory(tmp_path):
    result = run_mpi(2, "hpctrain.cli", "train", *CLI, "train.micro_batch_size=2", "train.steps=2",
                     f"train.run_dir={tmp_path}", module=True, timeout=120)
    assert "4 micro-batch(es) of 2 sequence(s) per replica" in result.stdout, result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    first = steps[0]
    # host run: the peak RSS of a process that imported torch and built a model: 50 MiB .. 16 GiB
    assert 0.05 < first["peak_memory_gib"] < 16 and first["peak_memory_rank"] in (0, 1)
    assert first["peak_memory_source"].startswith("peak RSS") and "peak_memory_gib" not in steps[1]
    printed = re.search(r"memory per rank after step 1: peak ([0-9.]+) GiB", result.stdout)
    assert printed and abs(float(printed.group(1)) - first["peak_memory_gib"]) <= 1e-3, result.stdout


# a train.micro_batch_size that does not divide the batch, one line on every rank: tests/mpi/test_bad_input.py
