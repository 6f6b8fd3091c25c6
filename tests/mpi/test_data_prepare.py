"""`hpctrain data` on real ranks: a corpus prepared on 3 ranks equals one prepared on 1, and trains."""
import json
import subprocess
import sys

import h5py
import numpy as np

from mpirun import ROOT, mpi_env, run_mpi


def test_prepare_in_parallel_matches_one_rank_and_trains(tmp_path):
    tok = tmp_path / "tokenizer.json"
    made = subprocess.run([sys.executable, "-m", "hpctrain.cli", "data", "train-tokenizer", "--vocab-size", "320",
                           "--max-bytes", "300000", "--out", str(tok)], capture_output=True, text=True,
                          env=mpi_env(), cwd=ROOT, timeout=120)
    assert made.returncode == 0, made.stderr
    inputs = [str(ROOT / "hpctrain" / "data"), str(ROOT / "README.md")]
    for n, out in ((1, tmp_path / "one.h5"), (3, tmp_path / "three.h5")):
        result = run_mpi(n, "hpctrain.cli", "data", "prepare", "--input", *inputs, "--tokenizer", str(tok),
                         "--out", str(out), module=True, timeout=120)
        assert f"on {n} rank(s)" in result.stdout
    with h5py.File(tmp_path / "one.h5") as a, h5py.File(tmp_path / "three.h5") as b:
        assert np.array_equal(a["tokens"][()], b["tokens"][()]) and np.array_equal(a["doc_offsets"][()],
                                                                                  b["doc_offsets"][()])
        assert a.attrs["tokenizer_sha256"] == b.attrs["tokenizer_sha256"] and a["tokens"].dtype == np.uint16
        vocab = int(a.attrs["vocab_size"])
    again = run_mpi(2, "hpctrain.cli", "data", "prepare", "--input", *inputs, "--out", str(tmp_path / "one.h5"),
                    module=True, timeout=60, check=False)
    assert again.returncode != 0 and again.stderr.count("exists: choose another --out") >= 1

    run_dir = tmp_path / "run"
    run_mpi(4, "hpctrain.cli", "train", "--config", "configs/tiny.toml", f"data.source={tmp_path / 'three.h5'}",
            f"data.tokenizer={tok}", f"model.vocab_size={vocab}", "train.steps=4", "parallel.tp=2", "parallel.pp=1",
            f"train.run_dir={run_dir}", "train.progress=false", module=True, timeout=120)
    losses = [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl") if '"event"' not in line]
    assert len(losses) == 4 and losses[0] > losses[-1]
    bad = run_mpi(2, "hpctrain.cli", "train", f"data.source={tmp_path / 'three.h5'}", f"model.vocab_size={vocab}",
                  "train.steps=1", f"train.run_dir={tmp_path / 'bad'}", module=True, timeout=60, check=False)
    assert bad.returncode == 2 and "was prepared with tokenizer 'tokenizer.json'" in bad.stderr, bad.stderr
