"""LoRA on real ranks (float64): adapters on all seven targets train like one process (losses and final
global parameters 1e-10) over tp with SP, pp, dp with ZeRO-1, cp and tp x pp; the frozen base stays
bit-identical and every adapter moves (tests/mpi/scripts/check_fidelity.py checks both in every run); a
checkpoint holds the adapters, their optimizer state and the frozen base, and resumes bitwise, and in
another layout; ``model.init_from`` of a Hugging Face Llama loads the base, which checkpoints then refer to
by path and checksum; bad ``[lora]`` input is one line.
"""
import json
import shutil

import h5py
import numpy as np
import pytest
import torch

from mpirun import run_mpi
from test_checkpoint import F64, ckpt, losses, train

from hpctrain.config import load_config, resolve_model
from hpctrain.errors import HpcTrainError
from hpctrain.models.gpt import GPTStage

EXACT = ["--param-rtol", "1e-10", "--rtol", "1e-10"]
LORA = ["lora.rank=4", "lora.alpha=6", "lora.targets=[q,k,v,o,gate,up,down]"]


def fidelity(nprocs, layouts, variants, *extra, timeout=240):
    result = run_mpi(nprocs, "check_fidelity.py", "--layouts", layouts, "--variants", variants, *EXACT, *LORA,
                     *extra, timeout=timeout)
    assert "FIDELITY OK" in result.stdout, result.output
    assert result.stdout.count("LORA OK") == result.stdout.count("OK dp=") + 1  # + the one-process reference
    return result.stdout.count("OK dp=")


def test_adapters_over_tp_sp_pp_dp_zero1_and_cp_equal_one_process():
    """tp=2 with SP (column A and row B partial over tp), pp=2, dp=2 with ZeRO-1 (sharding the adapters
    only), cp=2 (ring attention)."""
    assert fidelity(2, "1,2,1;1,1,2;2,1,1;1,1,1,2", "sp,zero1") == 4


def test_adapters_over_tp_x_pp_with_recompute_and_tied_embeddings():
    """tp=2 x pp=2 with SP; the LM head's tied copy of the frozen embedding on the last stage."""
    assert fidelity(4, "1,2,2", "sp", "train.recompute=true", "model.tie_embeddings=true") == 1


def test_checkpoint_holds_adapters_their_state_and_the_base_and_resumes_bitwise_in_any_layout(tmp_path):
    """dp=2 x tp=2 with ZeRO-3 (the frozen base sharded too) and SP: the uninterrupted 6 steps save at step 3;
    a new run directory with only that checkpoint resumes it bitwise; the checkpoint has optimizer state for
    the adapters alone and the frozen base as it was initialised (written from the ranks' slices); the step-3
    checkpoint resumed on pp=2 (zero 0) goes on like the uninterrupted run (1e-10); a run without adapters
    refuses it."""
    layout = ["parallel.tp=2", "parallel.pp=1", "parallel.zero=3", "parallel.sequence_parallel=true",
              "train.steps=6", "checkpoint.async=false", "checkpoint.interval=3"]
    whole, split, moved = tmp_path / "whole", tmp_path / "split", tmp_path / "moved"
    first = train(4, whole, *F64, *LORA, *layout)
    assert "LoRA rank 4 (alpha 6) on q,k,v,o,gate,up,down: " in first.stdout and "trainable / " in first.stdout
    step3 = whole / "checkpoints" / "step-00000003"
    shutil.copytree(step3, split / "checkpoints" / step3.name)
    out = train(4, split, *F64, *LORA, *layout, "--resume", "auto")
    assert "at step 3" in out.stdout and losses(split) == {s: v for s, v in losses(whole).items() if s > 3}
    ckpt("diff", str(whole), str(split), "--atol", "0")

    train(2, moved, *F64, *LORA, "parallel.pp=2", "train.steps=6", "--resume", str(step3))
    ref, got = losses(whole), losses(moved)
    assert sorted(got) == [4, 5, 6] and all(abs(got[s] - ref[s]) <= 1e-10 * abs(ref[s]) for s in got)
    ckpt("diff", str(whole), str(moved), "--atol", "1e-9")
    other = train(2, moved, *F64, "lora.rank=0", "parallel.pp=2", "train.steps=7", "--resume", "auto", check=False)
    assert other.returncode != 0 and "lora.rank is 4 there, 0 here" in other.output, other.output

    cfg = load_config(None, [*F64, *LORA])  # the frozen base is the model as every layout initialises it
    m = resolve_model(cfg.model)
    initial = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64, seed=cfg.train.seed,
                       lora=cfg.lora)
    with h5py.File(whole / "checkpoints" / "step-00000006" / "checkpoint.h5") as f:
        assert "optim/exp_avg/layers.0.attn.wq.lora_A.weight" in f and "optim/exp_avg/layers.3.mlp.down.lora_B.weight" in f
        assert "optim/exp_avg/layers.0.attn.wq.weight" not in f and "optim/exp_avg/embed.weight" not in f
        assert f["model/layers.0.attn.wq.lora_B.weight"][()].any()  # started at zero
        assert {p.spec.name for p in initial.parameters()} == set(f["model"])
        for p in initial.parameters():
            if not p.requires_grad:
                assert np.array_equal(f[f"model/{p.spec.name}"][()], p.detach()[p.spec.valid_local()].numpy()), \
                    p.spec.name


def test_checkpoints_refer_to_their_hugging_face_base_by_path_and_checksum(tmp_path):
    """model.init_from of an HF directory into a tp=2 LoRA run: its checkpoints hold the adapters and a
    reference to the base (path + a CRC-32 per tensor), not the base; a resume (here on dp=2 at ZeRO-3: each
    rank reads its slices of the base) reads the base back bit for bit and trains like a run that copies it
    (1e-10; that one starts at ZeRO-3 from the HF directory). A base that moved stops the resume with one
    line until model.init_from says where it is; a changed base is refused naming the tensor; nothing is
    written by a refused resume; export reads the base through the reference (peft needs none)."""
    pytest.importorskip("transformers")
    import shutil
    import zlib

    from hf_helpers import random_llama
    from safetensors.torch import load_file, save_file

    from hpctrain.cli import dispatch
    from hpctrain.interop.hf import hf_name
    from hpctrain.interop.sources import load_run_model

    random_llama(tmp_path / "hf", vocab=257, kv_heads=2, num_hidden_layers=2)
    assert dispatch(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    common = ["--config", str(tmp_path / "ckpt" / "model.toml"), "train.dtype=float64", "data.max_bytes=300000",
              "train.seq_len=32", "train.steps=4", "parallel.microbatches=1", "checkpoint.async=false",
              "checkpoint.interval=2", "lora.rank=2", "lora.targets=[q,v,down]"]
    copy, ref = tmp_path / "copy", tmp_path / "ref"

    def run(run_dir, *args, check=True):
        return run_mpi(2, "hpctrain.cli", "train", *common, f"train.run_dir={run_dir}", *args, module=True,
                       timeout=120, check=check)

    run(copy, "parallel.zero=3", "lora.checkpoint_base=copy", f"model.init_from={tmp_path / 'hf'}")
    first = run(ref, "parallel.tp=2", f"model.init_from={tmp_path / 'hf'}", "--max-steps", "2")
    assert f"checkpoints refer to the frozen base {tmp_path / 'hf'} (checksum" in first.stdout, first.stdout
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    step2 = ref / "checkpoints" / "step-00000002"
    with h5py.File(step2 / "checkpoint.h5") as f:
        assert sorted(f["model"]) == sorted(n for n in f["model"] if ".lora_" in n) and len(f["model"]) == 12
        reference = json.loads(f.attrs["lora_base"])
    assert reference["path"] == str(tmp_path / "hf") and len(reference["tensors"]) == len(hf)
    assert reference["tensors"]["embed.weight"] == zlib.crc32(hf["model.embed_tokens.weight"].numpy().tobytes())
    with h5py.File(copy / "checkpoints" / "step-00000002" / "checkpoint.h5") as f:
        assert "model/embed.weight" in f  # lora.checkpoint_base=copy
    assert f"frozen base: {len(hf)} tensors referred to at {tmp_path / 'hf'}" in ckpt("inspect", str(step2)).stdout

    (tmp_path / "hf").rename(tmp_path / "moved")
    gone = run(ref, "parallel.zero=3", "--resume", "auto", check=False)
    errors = [line for line in gone.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    assert gone.returncode != 0 and len(errors) == 1 and "which is gone" in errors[0], gone.stderr
    assert "set model.init_from to where it is now" in errors[0] and "Traceback" not in gone.stderr
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "moved", changed)
    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] += 1e-12
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    refused = run(ref, "parallel.zero=3", "--resume", "auto", f"model.init_from={changed}", check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr
    assert "not the base its adapters were trained on" in errors[0] and "layers.1.mlp.up.weight" in errors[0]
    assert sorted(p.name for p in (ref / "checkpoints").glob("step-*")) == ["step-00000002"]

    resumed = run(ref, "parallel.zero=3", "--resume", "auto", f"model.init_from={tmp_path / 'moved'}")
    assert "at step 2" in resumed.stdout and f"refer to the frozen base {tmp_path / 'moved'}" in resumed.stdout
    want, got = losses(copy), losses(ref)
    assert sorted(got) == [1, 2, 3, 4] and all(abs(got[s] - want[s]) <= 1e-10 * abs(want[s]) for s in got)
    with h5py.File(ref / "checkpoints" / "step-00000004" / "checkpoint.h5") as f:
        assert json.loads(f.attrs["lora_base"])["path"] == str(tmp_path / "moved")
    _, model, _ = load_run_model(str(ref))
    for name, p in model.named_parameters():  # the base, read through the reference: HF's, bit for bit
        if ".lora_" not in name:
            assert torch.equal(p.detach()[p.spec.valid_local()], hf[hf_name(name)]), name
    (tmp_path / "moved").rename(tmp_path / "again")
    assert dispatch(["export", str(ref), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    with pytest.raises(HpcTrainError, match="which is gone"):
        dispatch(["export", str(ref), "--format", "hf", "--merge-lora", "--out", str(tmp_path / "merged")])
    assert not (tmp_path / "merged").exists()
    assert dispatch(["export", str(ref), "--format", "hf", "--merge-lora", "--out", str(tmp_path / "merged"),
                     "--base", str(tmp_path / "again")]) == 0


def test_a_base_step_another_run_refers_to_is_kept_by_its_pruning(tmp_path, capsys):
    """A LoRA run from model.init_from=RUN_DIR refers to that run's step 2 and marks it; the base run goes on with
    checkpoint.keep=1 and keeps step 2 (saying so once), so the LoRA run resumes. Once the step is gone anyway,
    export/generate say so, naming it (not "another base"), and --format peft writes base_model_name_or_path
    null with a warning (an hpctrain base, not a PEFT-loadable one) unless --base-model names one."""
    import shutil

    from hpctrain.cli import dispatch

    base, lora = tmp_path / "base", tmp_path / "lora"
    keep = ["checkpoint.async=false", "checkpoint.interval=2", "checkpoint.keep=1", "parallel.pp=1"]
    train(2, base, *F64, *keep, "train.steps=2")
    first = train(2, lora, *F64, *keep, *LORA, "train.steps=2", f"model.init_from={base}")
    (marker,) = (base / "checkpoints" / "references").glob("*.json")
    assert json.loads(marker.read_text()) == {"step": "step-00000002", "by": str(lora / "checkpoints")}
    assert f"{marker} keeps it for this run" in first.stdout, first.stdout
    more = train(2, base, *F64, *keep, "train.steps=6", "--resume", "auto")
    assert more.stdout.count("keeping ") == 1 and f"the run of {lora / 'checkpoints'} refers to it" in more.stdout
    assert sorted(p.name for p in (base / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000006"]
    again = train(2, lora, *F64, *keep, *LORA, "train.steps=4", f"model.init_from={base}", "--resume", "auto")
    assert "at step 2" in again.stdout and "keeps it for this run" not in again.stdout

    shutil.rmtree(base / "checkpoints" / "step-00000002")
    gone = f"{base / 'checkpoints' / 'step-00000002'}, which is gone"
    for command in (["export", str(lora), "--format", "hf", "--merge-lora", "--out", str(tmp_path / "merged")],
                    ["generate", str(lora), "--prompt", "a", "--max-new-tokens", "1"]):
        with pytest.raises(HpcTrainError, match="which is gone") as err:
            dispatch(command)
        assert gone in str(err.value) and "not the base its adapters were trained on" in str(err.value), err.value
    capsys.readouterr()
    assert dispatch(["export", str(lora), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert "WARNING: base_model_name_or_path is null" in capsys.readouterr().err
    assert dispatch(["export", str(lora), "--format", "peft", "--out", str(tmp_path / "named"), "--base-model",
                     str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(tmp_path / "hf")


# a bad lora.rank on every rank: tests/mpi/test_bad_input.py; every bad [lora] value: tests/unit/test_lora_adapters.py
