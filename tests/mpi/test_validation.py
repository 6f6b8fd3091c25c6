"""Validation loss (data.valid_fraction, train.eval_interval): the same in every layout, in float64."""
import json

import pytest

from mpirun import run_many

COMMON = ["--config", "configs/tiny.toml", "data.valid_fraction=0.1", "train.eval_interval=2", "train.eval_steps=2",
          "train.steps=4", "train.dtype=float64", "train.progress=false", "data.max_bytes=300000"]
LAYOUTS = [(1, ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1"]),
           (2, ["parallel.tp=1", "parallel.pp=2", "parallel.microbatches=2"]),
           (4, ["parallel.tp=2", "parallel.pp=1", "parallel.sequence_parallel=true", "parallel.zero=1",
                "parallel.microbatches=1"]),
           (4, ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=gpipe"]),
           (2, ["parallel.tp=1", "parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=interleaved",
                "parallel.virtual_stages=2"])]


def val_losses(run_dir):
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"event"' not in line]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}, records


def test_validation_loss_is_the_same_in_every_layout(tmp_path):
    """The layouts of one world size share one launch (mpirun.run_many)."""
    outputs = {}
    for size in sorted({n for n, _ in LAYOUTS}):
        mine = [i for i, (n, _) in enumerate(LAYOUTS) if n == size]
        done = run_many(size, [["train", *COMMON, *LAYOUTS[i][1], f"train.run_dir={tmp_path / str(i)}"] for i in mine],
                        timeout=300)
        outputs.update({i: run["stdout"] for i, run in zip(mine, done)})
    results = []
    for i in range(len(LAYOUTS)):
        assert "val_loss" in outputs[i]
        results.append(val_losses(tmp_path / str(i)))
    reference, records = results[0]
    assert sorted(reference) == [2, 4] and reference[4] < reference[2]
    assert all("eval" in r["time_s"] for r in records if r["step"] in (2, 4))
    for (losses, _), (n, layout) in zip(results[1:], LAYOUTS[1:]):
        assert sorted(losses) == [2, 4]
        for step in (2, 4):
            assert losses[step] == pytest.approx(reference[step], abs=1e-10, rel=0), (n, layout, losses, reference)


# train.eval_interval without held-out data: tests/mpi/test_bad_input.py
