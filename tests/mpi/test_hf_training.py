"""Hugging Face export of a multi-rank run, and training from an imported HF model (Llama, Mistral, Mixtral) in
several layouts (float64)."""
import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_helpers import float64_exact_transformers, hf_logits, random_llama, random_mistral, random_mixtral  # noqa: E402
from mpirun import run_many, run_mpi  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from hpctrain.checkpoint.weights import load_model, open_checkpoint  # noqa: E402
from hpctrain.cli import dispatch  # noqa: E402

COMMON = ["train.dtype=float64", "train.progress=false", "data.max_bytes=300000", "parallel.microbatches=1",
          "train.seq_len=32", "checkpoint.async=false"]


def train(nprocs, run_dir, *overrides, config="configs/tiny.toml", check=True):
    return run_mpi(nprocs, "hpctrain.cli", "train", "--config", str(config), *COMMON, f"train.run_dir={run_dir}",
                   *map(str, overrides), module=True, timeout=90, check=check)


def losses(run_dir):
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def command(run_dir, *overrides, config="configs/tiny.toml"):
    """``train``'s argv for scripts/train_many.py (mpirun.run_many)."""
    return ["train", "--config", str(config), *COMMON, f"train.run_dir={run_dir}", *map(str, overrides)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every run of this file that expects to succeed, one launch per world size (mpirun.run_many): a tp=2 run
    to export, and for a random Llama, Mistral and Mixtral (each imported with ``hpctrain import-hf``) a
    one-process run and runs in other layouts, from the import (--resume) or the HF directory
    (model.init_from). {model: {"dir": its folder, "hf": the transformers model}}; run ``name`` of a model
    in ``dir / name``."""
    base = tmp_path_factory.mktemp("hf")
    models = {"llama": random_llama(base / "llama" / "hf", vocab=257, kv_heads=2, num_hidden_layers=4),
              "mistral": random_mistral(base / "mistral" / "hf", window=8, vocab=257, kv_heads=2, num_hidden_layers=4),
              "mixtral": random_mixtral(base / "mixtral" / "hf", vocab=257)}
    for name in models:
        assert dispatch(["import-hf", str(base / name / "hf"), "--out", str(base / name / "ckpt")]) == 0
    layouts = {  # model: {run: overrides}, run "one" on one process, the others on 2 ranks
        "llama": {"one": ["train.steps=1", "--resume", "ckpt"], "tp2": ["train.steps=1", "parallel.tp=2", "--resume", "ckpt"],
                  "pp2": ["train.steps=1", "parallel.pp=2", "model.init_from=hf"],
                  "il": ["train.steps=1", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                         "parallel.microbatches=2", "model.init_from=hf"]},
        "mistral": {"one": ["train.steps=2", "--resume", "ckpt"],
                    "tp2": ["train.steps=2", "parallel.tp=2", "parallel.sequence_parallel=true", "--resume", "ckpt"],
                    "pp2": ["train.steps=2", "parallel.pp=2", "model.init_from=hf"],
                    "cp2": ["train.steps=2", "parallel.cp=2", "--resume", "ckpt"]},
        "mixtral": {"one": ["train.steps=2", "--resume", "ckpt"],
                    "ep2": ["train.steps=2", "parallel.ep=2", "model.init_from=hf"],
                    "tp2": ["train.steps=2", "parallel.tp=2", "parallel.sequence_parallel=true", "--resume", "ckpt"]},
    }

    def where(model, overrides):  # "ckpt" / "model.init_from=hf": that model's import / HF directory
        return [str(base / model / "ckpt") if o == "ckpt" else f"model.init_from={base / model / 'hf'}"
                if o == "model.init_from=hf" else o for o in overrides]

    one, two = [], [command(base / "export" / "run", "parallel.tp=2", "parallel.pp=1", "parallel.sequence_parallel=true",
                            "model.tie_embeddings=true", "train.steps=2", "model.vocab_size=257")]
    for model, runs in layouts.items():
        for run, overrides in runs.items():
            (one if run == "one" else two).append(command(base / model / run, *where(model, overrides),
                                                          config=base / model / "ckpt" / "model.toml"))
    run_many(1, one)
    run_many(2, two)
    return {name: {"dir": base / name, "hf": hf} for name, hf in models.items()} | {"export": {"dir": base / "export"}}


def test_a_tp2_run_exports_to_transformers_with_the_same_logits(trained, tmp_path):
    """257 tokens: 512 padded rows in the tp=2 run, 257 in the checkpoint and in the HF model."""
    run = trained["export"]["dir"] / "run"
    assert dispatch(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    reader = open_checkpoint(str(run))
    assert reader.attrs["step"] == 2 and reader.attrs["layout"]["tp"] == 2
    _, model = load_model(reader)  # hpctrain's one-process forward of the same global weights
    reader.close()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with float64_exact_transformers(), torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
        theirs, ours = hf_logits(hf, ids), model(ids).permute(1, 0, 2)
    assert theirs.dtype == torch.float64 and hf.config.tie_word_embeddings and theirs.shape == (2, 48, 257)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


def test_an_imported_model_trains_the_same_in_every_layout(trained, tmp_path):
    """A Llama with an odd vocabulary (padded at any tp): one process, tp=2, pp=2 and interleaved pp=2 (from
    the import, --resume, or the HF directory, model.init_from) take the same first step, transformers' loss."""
    hf, runs = trained["llama"]["hf"], trained["llama"]["dir"]
    model_toml = runs / "ckpt" / "model.toml"  # the [model] section of the HF model: a valid config file
    steps = ["train.steps=1"]
    first = [losses(runs / name)[0] for name in ("one", "tp2", "pp2", "il")]

    # the loss of the first step is the HF model's on the same batch
    from hpctrain.config import load_config
    from hpctrain.data.corpus import load_tokens
    from hpctrain.data.sampler import SequenceSampler

    cfg = load_config(str(model_toml), COMMON)
    tokens = load_tokens(cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes)
    inputs, targets = SequenceSampler(tokens, cfg.train.seq_len, cfg.train.seed).batch(0, cfg.train.global_batch)
    with float64_exact_transformers():
        expected = F.cross_entropy(hf_logits(hf, inputs).reshape(-1, 257), targets.reshape(-1)).item()
    assert first == pytest.approx([expected] * 4, rel=1e-10, abs=0)

    # a config whose model differs only in rope_theta (same shapes) is refused, not silently trained
    wrong = train(1, tmp_path / "wrong", *steps, "model.rope_theta=10000.0", "--resume", runs / "ckpt",
                  config=model_toml, check=False)
    assert wrong.returncode != 0 and "model.rope_theta is 500.0 there, 10000.0 here" in wrong.output


def test_an_imported_mistral_trains_the_same_on_one_rank_tp2_pp2_and_cp2(trained, tmp_path):
    """A Mistral (sliding_window 8 < train.seq_len 32, GQA): 2 steps on 1 rank, tp=2 with sequence
    parallelism (--resume of the import), pp=2 (model.init_from of the HF directory) and cp=2 (ring attention
    under the window, zig-zag chunks of 8 tokens) give the same losses
    (the first one transformers' loss on that batch) and the same trained weights, exported as a Mistral."""
    hf, trained_in = trained["mistral"]["hf"], trained["mistral"]["dir"]
    model_toml = trained_in / "ckpt" / "model.toml"
    runs = ("one", "tp2", "pp2", "cp2")
    curves = [losses(trained_in / name) for name in runs]
    assert len(curves[0]) == 2
    for curve in curves[1:]:
        assert curve == pytest.approx(curves[0], rel=1e-10, abs=0)

    from hpctrain.config import load_config
    from hpctrain.data.corpus import load_tokens
    from hpctrain.data.sampler import SequenceSampler

    cfg = load_config(str(model_toml), COMMON)
    tokens = load_tokens(cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes)
    inputs, targets = SequenceSampler(tokens, cfg.train.seq_len, cfg.train.seed).batch(0, cfg.train.global_batch)
    with float64_exact_transformers():
        expected = F.cross_entropy(hf_logits(hf, inputs).reshape(-1, 257), targets.reshape(-1)).item()
    assert curves[0][0] == pytest.approx(expected, rel=1e-10, abs=0)

    exported = []
    for name in runs:
        assert dispatch(["export", str(trained_in / name), "--format", "hf", "--out", str(tmp_path / f"hf-{name}")]) == 0
        config = json.loads((tmp_path / f"hf-{name}" / "config.json").read_text())
        assert config["model_type"] == "mistral" and config["sliding_window"] == 8
        exported.append(load_file(tmp_path / f"hf-{name}" / "model.safetensors"))
    original = load_file(trained_in / "hf" / "model.safetensors")
    assert any(not torch.equal(exported[0][k], original[k]) for k in original)  # it trained
    for other in exported[1:]:
        assert other.keys() == original.keys()
        for k in original:
            torch.testing.assert_close(other[k], exported[0][k], rtol=0, atol=1e-10)


def test_an_imported_mixtral_trains_the_same_on_one_rank_ep2_and_tp2(trained, tmp_path):
    """A Mixtral (4 experts, top 2): 2 steps on 1 rank (--resume of the import), ep=2 (model.init_from of the HF
    directory: each rank reads its 2 experts) and tp=2 with sequence parallelism (each expert's rows split)
    give the same losses (the first one transformers' token loss on that batch) and the same trained weights,
    exported as a Mixtral."""
    hf, trained_in = trained["mixtral"]["hf"], trained["mixtral"]["dir"]
    model_toml = trained_in / "ckpt" / "model.toml"
    runs = ("one", "ep2", "tp2")
    curves = [losses(trained_in / name) for name in runs]
    assert len(curves[0]) == 2
    for curve in curves[1:]:
        assert curve == pytest.approx(curves[0], rel=1e-10, abs=0)

    from hpctrain.config import load_config
    from hpctrain.data.corpus import load_tokens
    from hpctrain.data.sampler import SequenceSampler

    cfg = load_config(str(model_toml), COMMON)
    tokens = load_tokens(cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes)
    inputs, targets = SequenceSampler(tokens, cfg.train.seq_len, cfg.train.seed).batch(0, cfg.train.global_batch)
    with float64_exact_transformers():
        expected = F.cross_entropy(hf_logits(hf, inputs).reshape(-1, 257), targets.reshape(-1)).item()
    assert curves[0][0] == pytest.approx(expected, rel=1e-10, abs=0)

    exported = []
    for name in runs:
        assert dispatch(["export", str(trained_in / name), "--format", "hf", "--out", str(tmp_path / f"hf-{name}")]) == 0
        assert json.loads((tmp_path / f"hf-{name}" / "config.json").read_text())["model_type"] == "mixtral"
        exported.append(load_file(tmp_path / f"hf-{name}" / "model.safetensors"))
    original = load_file(trained_in / "hf" / "model.safetensors")
    assert any(not torch.equal(exported[0][k], original[k]) for k in original)  # it trained
    for other in exported[1:]:
        assert other.keys() == original.keys()
        for k in original:
            torch.testing.assert_close(other[k], exported[0][k], rtol=0, atol=1e-10)
