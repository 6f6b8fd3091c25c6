"""How ``train.micro_batch_size`` and ``parallel.microbatches`` set the micro-batches (rules.resolve_microbatches,
Layout.from_config), their one-line errors, and the planner's reading of a TOML's micro-batch."""
import pytest

from hpctrain.config import load_config
from hpctrain.errors import HpcTrainError
from hpctrain.config.layout import Layout
from hpctrain.config.rules import LayoutError, resolve_microbatches

BASE = ["parallel.tp=1", "parallel.pp=1", "train.global_batch=16", "train.seq_len=32"]


def layout(world, *overrides):
    return Layout.from_config(load_config(None, BASE + list(overrides)), world)


@pytest.mark.parametrize("world, overrides, microbatches, micro_batch", [
    (2, [], 1, 8),  # micro_batch_size 0 (default): parallel.microbatches (default 1)
    (2, ["parallel.microbatches=4"], 4, 2),
    (2, ["train.micro_batch_size=2"], 4, 2),
    (2, ["train.micro_batch_size=2", "parallel.microbatches=4"], 4, 2),  # consistent: accepted
    (4, ["train.micro_batch_size=1", "parallel.pp=2"], 8, 1),  # dp = 2
    (4, ["train.micro_batch_size=2", "parallel.cp=2"], 4, 2),  # cp: micro-batches of sequences, dp = 2
    (4, ["train.micro_batch_size=2", "parallel.pp=2", "parallel.schedule=interleaved",
         "parallel.virtual_stages=2"], 4, 2),  # the interleaved rule checked on the derived count
])
def test_micro_batch_size_derives_the_micro_batches(world, overrides, microbatches, micro_batch):
    lay = layout(world, *overrides)
    assert (lay.microbatches, lay.micro_batch) == (microbatches, micro_batch)
    assert lay.micro_batch * lay.microbatches * lay.dp_size == lay.global_batch


@pytest.mark.parametrize("world, overrides, fragment", [
    (2, ["train.micro_batch_size=3"], "train.global_batch=16 is not divisible by dp x train.micro_batch_size = "
                                      "2 x 3 = 6"),
    (2, ["train.micro_batch_size=2", "parallel.microbatches=2"],
     "parallel.microbatches=2 contradicts train.micro_batch_size=2: global_batch / (dp x micro_batch_size) = "
     "16 / (2 x 2) = 4 micro-batches"),
    (4, ["train.micro_batch_size=8", "parallel.pp=2", "parallel.schedule=interleaved",
         "parallel.virtual_stages=2"], "parallel.microbatches=1 must be a multiple of parallel.pp=2 with the "
                                       "interleaved schedule"),
])
def test_inconsistent_batch_keys_are_one_line_naming_them(world, overrides, fragment):
    with pytest.raises(LayoutError) as info:
        layout(world, *overrides)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert "train.micro_batch_size" in str(info.value)


def test_resolution_without_a_config():
    assert resolve_microbatches(64, 4, 1, 0) == 1 and resolve_microbatches(64, 4, 3, 0) == 3
    assert resolve_microbatches(64, 4, 1, 2) == 8 and resolve_microbatches(64, 4, 8, 2) == 8
    with pytest.raises(HpcTrainError):
        resolve_microbatches(64, 4, 1, 5)


def test_plan_uses_the_tomls_micro_batch_size(tmp_path, capsys):
    from hpctrain.cli import dispatch as main

    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "gpt2-small"\n[parallel]\ndp = 4\ntp = 2\n'
                    '[train]\nglobal_batch = 64\nseq_len = 1024\nmicro_batch_size = 4\ndtype = "bfloat16"\n')
    assert main(["plan", "--model", str(toml), "--nodes", "1", "--gpus-per-node", "8", "--device", "h100",
                 "--json"]) == 0
    plans = __import__("json").loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["micro_batch"] == 4 and p["microbatches"] == 4 for p in plans)
    assert all(p["memory_gib_per_device"] > 0 for p in plans)
    assert main(["plan", "--config", str(toml), "--nodes", "1", "--gpus-per-node", "8", "--device", "h100"]) == 0
    text = capsys.readouterr().out
    assert "micro-batch 4" in text and "memory per GPU" in text


def test_sweep_rows_carry_the_measured_and_predicted_memory(tmp_path):
    import json

    from hpctrain.sweep.predict import predict_run
    from hpctrain.sweep.runs import SweepRun, summarize

    records = [{"step": i, "loss": 5.0, "step_time_s": 0.1, "tokens_per_s": 100.0, "time_s": {}} for i in (1, 2)]
    records[0]["peak_memory_gib"] = 0.25
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    assert summarize(SweepRun(2, 1, 1, 2, 1, 8), str(tmp_path), warmup=0)["peak_memory_gib"] == 0.25
    cfg = load_config("configs/tiny.toml")
    row = {"ranks": 4, "dp": 1, "tp": 2, "pp": 2, "microbatches": 4, "global_batch": 8}
    small, large = predict_run(cfg, row), predict_run(cfg, {**row, "microbatches": 1})
    assert 0 < small["predicted_memory_gib"] < large["predicted_memory_gib"]  # micro-batch 2 < 8 sequences
