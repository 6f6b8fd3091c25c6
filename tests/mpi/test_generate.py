"""`hpctrain generate` and the one-process model of a checkpoint, from runs in different layouts."""
import subprocess
import sys

import torch

from hpctrain.checkpoint.weights import load_model, open_checkpoint
from hpctrain.tools.generate import generate_ids
from mpirun import ROOT, mpi_env, run_mpi

COMMON = ["--config", "configs/tiny.toml", "train.steps=3", "train.dtype=float64", "train.progress=false",
          "data.max_bytes=300000"]


def generate(path, *args):
    return subprocess.run([sys.executable, "-m", "hpctrain.cli", "generate", str(path), *args], capture_output=True,
                          text=True, env=mpi_env(), cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)


def test_any_layout_gives_the_same_model_and_text(tmp_path):
    run_mpi(1, "hpctrain.cli", "train", *COMMON, "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1",
            f"train.run_dir={tmp_path / 'one'}", module=True, timeout=120)
    run_mpi(4, "hpctrain.cli", "train", *COMMON, "parallel.zero=1", f"train.run_dir={tmp_path / 'tp2pp2'}",
            module=True, timeout=120)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for name in ("one", "tp2pp2"):
        reader = open_checkpoint(str(tmp_path / name))
        cfg, model = load_model(reader)
        assert cfg.train.steps == 3 and reader.attrs["step"] == 3
        logits.append(model(ids))
        reader.close()
    assert logits[0].shape == (24, 2, 256) and logits[0].dtype == torch.float64
    assert torch.allclose(logits[0], logits[1], rtol=0, atol=1e-10)
    assert generate_ids(model, [1, 2, 3], 8, 256, temperature=0) == generate_ids(model, [1, 2, 3], 8, 256, 0)

    texts = [generate(tmp_path / name, "--prompt", "def main(", "--max-new-tokens", "24", "--seed", "5")
             for name in ("one", "tp2pp2", "one")]
    assert all(t.returncode == 0 for t in texts), texts[0].stderr
    assert texts[0].stdout == texts[1].stdout == texts[2].stdout and texts[0].stdout.startswith("def main(")
    other_seed = generate(tmp_path / "one", "--prompt", "def main(", "--max-new-tokens", "24", "--seed", "6")
    assert other_seed.stdout != texts[0].stdout


def test_generate_errors_are_clear(tmp_path):
    missing = generate(tmp_path / "nothing", "--prompt", "x")
    assert missing.returncode != 0 and "no such checkpoint" in missing.stderr
    empty = tmp_path / "run"
    empty.mkdir()
    nothing = generate(empty, "--prompt", "x")
    assert nothing.returncode != 0 and "neither a checkpoint nor a directory" in nothing.stderr
