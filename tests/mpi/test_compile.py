"""train.compile: compiled training (inductor's C++ backend on the CPU) equals eager in dp, tp and pp layouts;
``hpctrain train --verbose`` reports the graphs and graph breaks; bad values are one clear line.

The model is tiny (2 layers, d_model 64). The 4-rank layouts job compiles from a cold cache of its own (it also
proves that a wait on a compiling neighbour is no hang); the one-rank CLI runs share one graph shape, so inductor's
cache (default /tmp/torchinductor_<user>) serves the later ones.
"""
import json
from pathlib import Path

import pytest

from hpctrain.config import ConfigError, config_from_dict, load_config
from mpirun import run_mpi

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SHAPES = ["data.max_bytes=200000", "train.global_batch=8", "train.seq_len=32", "model.n_layers=2", "model.d_ff=128"]


def test_compiled_training_equals_eager_in_dp_tp_pp_cp_layouts_and_a_wait_on_a_compile_is_no_hang(tmp_path):
    """dp=2 x pp=2 (no break; the bucket hooks overlap the backward), and cp=2 x tp=2 with sequence parallelism
    (graph breaks at the tp collectives and at ring attention; the hooks of the dp x cp reduction still overlap).

    With a cold inductor cache and comm timeout 5 s: in the pipeline's first compiled step stage 1 waits in its
    first receive while stage 0 compiles (then 0 for 1's backward), far longer than the timeout. The watchdog
    waits for a compiling rank and says so; no hang report (the same wait without compile ends with one when a
    rank is stopped: tests/mpi/test_hang_report.py). The dp x pp layout, whose wait is the subject, runs first: its
    runs' watchdogs investigate those waits and must report nothing once their grid is closed, while the next
    layout trains (found by CI under load: docs/status.md). The cp x tp layout has a 300 s timeout."""
    result = run_mpi(4, "check_compile.py", "--layouts", "2,1,2;1,2,1,2+sp", "--rtol", "1e-5", "--timeout-s", "5;300",
                     "optim.name=sgd", "optim.momentum=0.9", timeout=420,
                     env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")})
    assert "COMPILE OK" in result.stdout and result.stdout.count("compiled = eager") == 2, result.stdout
    assert "hang report from" not in result.stderr, result.output
    notes = [line for line in result.stderr.splitlines() if "inside torch.compile" in line]
    assert notes and all("not a hang" in line for line in notes), result.stderr


def cli_losses(run_dir, *overrides, verbose=False):
    result = run_mpi(1, "hpctrain.cli", "train", *(["--verbose"] if verbose else []), *SHAPES,
                     "parallel.microbatches=2", "train.recompute=true", "train.steps=3", f"train.run_dir={run_dir}",
                     "train.progress=false", *overrides, module=True, timeout=240)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, [r["loss"] for r in records if "loss" in r]


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    """The eager one-rank run two tests compare their compiled runs against (launched once)."""
    return cli_losses(tmp_path_factory.mktemp("eager"), "train.compile=false")[1]


def test_verbose_reports_no_break_with_tp_1_and_adamw_with_recompute_equals_eager(tmp_path, eager_losses):
    """The compiled run's AdamW is the one-pass compiled update (optim.update=auto); the eager run's is
    torch._fused_adamw_: the same training within float32 rounding."""
    result, losses = cli_losses(tmp_path / "compiled", "train.compile=true", verbose=True)
    lines = [line for line in result.stdout.splitlines() if "torch.compile:" in line]
    assert len(lines) == 1 and "0 graph break(s)" in lines[0], result.stdout
    graphs = int(lines[0].split("torch.compile: ")[1].split()[0])
    assert graphs >= 1, lines  # the whole stage's (forward and backward), the update's
    assert "first step" in result.stdout and "forward" in result.stdout and "done: 3 steps" in result.stdout
    # one rank, dp = pp = tp = cp = 1: the whole stage but its head is one compiled region (issue #52 item 1), the
    # fused head's fixed-shape chunks compiled apart (item 2; the plain compiled tail: the ZeRO-3 test below)
    assert ("torch.compile of the whole stage, embedding to final norm, one region, and of each fused head + loss "
            "chunk (train.compile=true") in result.stdout, result.stdout
    assert "head: fused chunked CE (one chunk of 128 tokens, automatic, compiled)" in result.stdout, result.stdout
    eager = eager_losses
    assert len(losses) == len(eager) == 3
    assert max(abs(a - b) / b for a, b in zip(losses, eager)) <= 1e-5, (losses, eager)


def test_compiled_lora_dropout_on_packed_sft_examples_equals_eager(tmp_path):
    """Packed SFT batches (document masks, loss masks) with LoRA's input dropout: the compiled blocks draw
    the same masks from torch's generator as eager (inductor's fallback_random; its own Philox streams
    differed by 3e-6 to 7e-5 in the loss), so the losses agree to float32 rounding."""
    data = tmp_path / "sft.h5"
    run_mpi(1, "hpctrain.cli", "data", "prepare", "--format", "sft-jsonl", str(EXAMPLES / "sft" / "tiny.jsonl"),
            "--out", str(data), module=True, timeout=60)
    runs = [run_mpi(2, "hpctrain.cli", "train", f"data.source={data}", "train.seq_len=128", "train.global_batch=4",
                    "model.n_layers=2", "model.d_ff=128", "parallel.dp=2", "lora.rank=4", "lora.dropout=0.2",
                    "train.steps=3", "train.progress=false", f"train.compile={mode}", f"train.run_dir={tmp_path / mode}",
                    "optim.update=fused",  # the blocks are this test's subject; the compiled update: the CLI tests
                    module=True, timeout=240) for mode in ("false", "true")]
    assert "torch.compile of every block" in runs[1].stdout, runs[1].stdout
    losses = {mode: [json.loads(line)["loss"] for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
                     if '"loss"' in line] for mode in ("false", "true")}
    assert len(losses["true"]) == 3 and losses["true"][1] != losses["true"][0], losses
    assert max(abs(a - b) / b for a, b in zip(losses["true"], losses["false"])) <= 1e-6, losses


def test_compile_values_toml_booleans_and_overrides():
    from hpctrain.models.compile import compile_wanted

    assert [compile_wanted("auto", d) for d in ("cpu", "cuda", "cuda:1")] == [False, True, True]
    assert compile_wanted("true", "cpu") and not compile_wanted("false", "cuda")
    assert config_from_dict({"train": {"compile": True}}).train.compile == "true"
    assert config_from_dict({"train": {"compile": False}}).train.compile == "false"
    assert load_config(None, ["train.compile=auto"]).train.compile == "auto"
    assert load_config(None, []).train.compile == "false"
    with pytest.raises(ConfigError, match=r"^config: train.compile: expected one of false, true, auto, got 'fast'$"):
        load_config(None, ["train.compile=fast"])
    with pytest.raises(ConfigError, match="train.compile: expected str, got 3"):
        config_from_dict({"train": {"compile": 3}})


# a bad train.compile value, one line on every rank: tests/mpi/test_bad_input.py


def test_compiled_zero3_equals_eager_zero0(tmp_path, eager_losses):
    """ZeRO-3's gather hooks on compiled blocks run eagerly (graph breaks at each unit's edge, named as such);
    the compiled ZeRO-3 run trains as the eager ZeRO-0 one (one rank: the gathers are copies). It also runs the
    plain head's compiled tail (model.fused_head_loss=false: final norm, head and loss one region) against the
    eager fused head."""
    result, losses = cli_losses(tmp_path / "compiled", "train.compile=true", "parallel.zero=3",
                                "model.fused_head_loss=false", verbose=True)
    assert "and of the final norm, LM head and loss (train.compile=true)" in result.stdout, result.stdout
    assert "ZeRO-3 parameter gather run eagerly" in result.stdout, result.stdout
    assert "AdamW in one compiled pass over the flat float32 buffers" in result.stdout, result.stdout
    eager = eager_losses
    assert len(losses) == len(eager) == 3
    assert max(abs(a - b) / b for a, b in zip(losses, eager)) <= 1e-5, (losses, eager)
