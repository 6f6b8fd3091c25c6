"""SFT data on real ranks: `data prepare --format sft-jsonl` under mpiexec, then the masked loss over packed
examples trains like one process in every layout (float64: losses and final parameters 1e-10) and
resumes exactly."""
import json
import shutil

import h5py
import numpy as np
import pytest

from mpirun import ROOT, FidelityRuns, run_mpi

EXAMPLE = str(ROOT / "examples" / "sft" / "tiny.jsonl")
EXACT = ["--param-rtol", "1e-10", "--rtol", "1e-10"]


@pytest.fixture(scope="module")
def sft_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "sft.h5"
    result = run_mpi(2, "hpctrain.cli", "data", "prepare", "--format", "sft-jsonl", EXAMPLE, "--out", str(out),
                     module=True, timeout=120)
    assert result.stdout.count("prepared 40 SFT examples") == 1  # rank 0 prints
    with h5py.File(out) as f:
        assert f.attrs["format"] == "hpctrain-sft-v1" and int(f["loss_mask"][()].sum()) == f.attrs["counted_tokens"]
        assert 0 < f.attrs["counted_tokens"] < f.attrs["num_tokens"] / 3
    again = run_mpi(2, "hpctrain.cli", "data", "prepare", "--format", "sft-jsonl", EXAMPLE, "--out", str(out),
                    module=True, timeout=60, check=False)
    assert again.returncode == 2 and again.stderr.count("exists: choose another --out") == 1
    bad = out.parent / "bad.jsonl"
    bad.write_text('{"prompt": "p", "response": "r"}\n{"prompt": "no answer"}\n')
    refused = run_mpi(2, "hpctrain.cli", "data", "prepare", "--format", "sft-jsonl", str(bad), "--out",
                      str(out.parent / "bad.h5"), module=True, timeout=60, check=False)
    assert refused.returncode == 2 and refused.stderr.count(f'{bad}:2: no "response"') == 1, refused.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["bad.jsonl", "sft.h5"]  # nothing written
    return str(out)


def test_masked_loss_in_every_layout_equals_one_process(sft_corpus):
    """dp=2 (each rank half the batch, the loss over the global count) with ZeRO-1; tp=2 with SP; pp=2 (the
    mask travels to the last stage); cp=2 (ring attention inside the examples); 3 steps of 4 packed
    sequences of 257 tokens, 2-4 examples each. Both runs in one launch (mpirun.FidelityRuns)."""
    data = [*EXACT, f"data.source={sft_corpus}", "train.seq_len=256", "train.global_batch=4"]
    runs = FidelityRuns({
        "every layout": (2, "2,1,1;1,2,1;1,1,2;1,1,1,2", "1f1b,sp,zero1", *data),
        # learned positions restart per example (each cp rank its zig-zag rows), a window, recomputation
        "learned positions": (2, "1,1,1,2;1,1,2", "gpipe,sp", *data, "model.positions=learned", "model.mlp=gelu",
                              "model.attention_window=40", "train.recompute=true"),
    })
    assert runs("every layout").count("OK dp=") == 4
    assert runs("learned positions").count("OK dp=") == 2


def test_sft_run_resumes_exactly(sft_corpus, tmp_path):
    def train(run_dir, *args):
        return run_mpi(2, "hpctrain.cli", "train", f"train.run_dir={run_dir}", f"data.source={sft_corpus}",
                       "train.seq_len=256", "train.global_batch=4", "train.steps=4", "parallel.tp=1",
                       "parallel.pp=2", "train.progress=false", "data.valid_fraction=0.2", "train.eval_interval=2",
                       "train.eval_steps=1", *args, module=True, timeout=120)

    def records(run_dir):
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"event"' not in line]

    # the uninterrupted run saves at step 2; a new run directory with only that checkpoint resumes from it
    train(tmp_path / "whole", "checkpoint.interval=2", "checkpoint.async=false")
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-00000002",
                    tmp_path / "split" / "checkpoints" / "step-00000002")
    assert "at step 2 (sample 8)" in train(tmp_path / "split", "--resume", "auto").stdout
    whole, split = records(tmp_path / "whole"), records(tmp_path / "split")
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in whole[2:]] == \
           [(r["step"], r["loss"], r.get("val_loss")) for r in split] and len(split) == 2
    assert np.isfinite([r["val_loss"] for r in whole if "val_loss" in r]).all() and len(whole) == 4
