"""Checkpoints end to end through `hpctrain train` and `hpctrain ckpt` on real ranks and real HDF5 files.

- exact resume: N steps + resume + N steps == 2N steps (same losses, bitwise-equal parameters);
- resharding: a chain of runs, each resuming the previous in ANOTHER layout (dp, tp, pp, ZeRO, SP,
  schedule, world size 1..8), matches one uninterrupted single-process run to 1e-10 (float64);
- bad input: missing, truncated, bit-flipped, other-shape checkpoints, unwritable directory.
The writer is the default one of this environment (shards with PyPI h5py, mpio with parallel h5py);
tests/mpi/test_checkpoint_writers.py compares both writers where h5py has MPI.
"""
import json
import os
import shutil
import subprocess
import sys

import h5py
import pytest

from mpirun import ROOT, assert_refused_alike, ckpt, mpi_env, refused_inputs, run_many, run_mpi

F64 = ["data.max_bytes=300000", "train.seq_len=16", "train.global_batch=8", "model.n_heads=8", "model.n_kv_heads=4",
       "model.n_layers=4", "parallel.microbatches=2", "train.dtype=float64", "train.warmup_steps=1",
       "train.lr=1e-2", "train.steps=14", "train.lr_schedule=cosine", "train.min_lr=1e-3"]
F32 = ["data.max_bytes=300000", "train.seq_len=32", "train.global_batch=8", "model.n_layers=2", "train.steps=8",
       "parallel.microbatches=2"]


def train(nprocs, run_dir, *args, check=True, timeout=240):
    return run_mpi(nprocs, "hpctrain.cli", "train", f"train.run_dir={run_dir}", *args, module=True,
                   timeout=timeout, check=check)


def losses(run_dir):
    records = map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
    return {r["step"]: r["loss"] for r in records if "event" not in r}  # stop events are not steps


# ZeRO-3's bitwise resume: tests/mpi/test_faults.py (killed mid-step) and test_zero_stages_reshard_into_each_other
BITWISE_LAYOUTS = {
    "tp2-pp2-sp": ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
    "dp2-pp2-zero1": ["parallel.tp=1", "parallel.pp=2", "parallel.zero=1"],
    "pp2-interleaved-tied": ["parallel.tp=1", "parallel.pp=2", "parallel.schedule=interleaved",
                             "parallel.virtual_stages=2", "model.n_layers=4", "model.tie_embeddings=true"],
}


@pytest.fixture(scope="module")
def bitwise_resumes(tmp_path_factory):
    """Per layout: (``whole``, ``split``, what the resume printed). The uninterrupted runs in one launch, the
    resumes in another (a resume never shares a process with the run that wrote its checkpoint)."""
    base = tmp_path_factory.mktemp("bitwise")
    common = [*F32, "checkpoint.interval=4", "checkpoint.async=false"]
    run_many(4, [["train", f"train.run_dir={base / name / 'whole'}", *common, *layout]
                 for name, layout in BITWISE_LAYOUTS.items()])
    for name in BITWISE_LAYOUTS:
        shutil.copytree(base / name / "whole" / "checkpoints" / "step-00000004",
                        base / name / "split" / "checkpoints" / "step-00000004")
    resumed = run_many(4, [["train", f"train.run_dir={base / name / 'split'}", *common, *layout, "--resume", "auto"]
                           for name, layout in BITWISE_LAYOUTS.items()])
    return {name: (base / name / "whole", base / name / "split", out) for name, out in zip(BITWISE_LAYOUTS, resumed)}


@pytest.mark.parametrize("layout", list(BITWISE_LAYOUTS))
def test_exact_resume_is_bitwise(bitwise_resumes, layout):
    """An uninterrupted 8-step run saves (synchronously) at step 4; a new run directory holding only that
    checkpoint resumes from it and continues bitwise: the same losses at steps 5-8, bitwise-equal weights and
    optimizer state. (A resume after a stop at --max-steps: tests/mpi/test_stop.py.)"""
    whole, split, out = bitwise_resumes[layout]
    assert "resumed from" in out["stdout"] and "at step 4" in out["stdout"]
    expected = {step: loss for step, loss in losses(whole).items() if step > 4}
    assert losses(split) == expected and len(expected) == 4  # exactly equal, every step
    ckpt("diff", str(whole), str(split), "--atol", "0")


def run_chain(run_dir, reference, ref, chain, *common):
    """Train 2 steps per (ranks, layout) segment of ``chain`` in one run directory, each resuming the last;
    every step's loss equals the uninterrupted ``reference`` run's (``ref``) to 1e-10, and so do the weights."""
    for i, (ranks, layout) in enumerate(chain):
        train(ranks, run_dir, *F64, *common, *layout, "--max-steps", "2", "--resume", "auto", timeout=300)
        got = losses(run_dir)
        assert sorted(got) == list(range(1, 2 * i + 3)), f"segment {i}: steps {sorted(got)}"
        for step in (2 * i + 1, 2 * i + 2):
            assert abs(got[step] - ref[step]) <= 1e-10 * abs(ref[step]), (i, layout, step, got[step], ref[step])
    ckpt("diff", str(reference), str(run_dir), "--atol", "1e-9")


def test_reshard_chain_matches_one_process(tmp_path):
    """One chain of resumes across layouts and schedules, every segment 2 steps, like one uninterrupted
    single-process run to 1e-10 (float64). Parameter names are global (``layers.i``), so an interleaved
    checkpoint (pp=2, V=2) resumes with 1f1b and with one process, and back (also with dp=2 + ZeRO-1 and
    tp=2 + SP); tp x pp reshards both ways up to 8 ranks; GPipe and plain dp=2 (dp rank 0 writes) end it."""
    reference = tmp_path / "reference"
    train(1, reference, *F64, "train.steps=20", "parallel.pp=1", "parallel.tp=1", "parallel.microbatches=1")
    interleaved = ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.pp=2", "parallel.tp=1"]
    chain = [  # (ranks, layout) — each segment resumes the previous one's checkpoint
        (2, interleaved),
        (2, ["parallel.tp=1", "parallel.pp=2"]),  # interleaved -> 1f1b
        (2, interleaved + ["parallel.microbatches=4"]),  # 1f1b -> interleaved
        (1, ["parallel.tp=1", "parallel.pp=1"]),  # interleaved -> one process
        (4, interleaved + ["parallel.zero=1"]),  # one process -> interleaved, dp=2 + ZeRO-1
        (4, interleaved[:3] + ["parallel.tp=2", "parallel.sequence_parallel=true"]),  # tp 1 -> 2 + SP
        (8, ["parallel.tp=2", "parallel.pp=4"]),  # -> 8 ranks
        (8, ["parallel.tp=4", "parallel.pp=2", "parallel.sequence_parallel=true"]),  # (TP2, PP4) -> (TP4, PP2)
        (2, ["parallel.tp=1", "parallel.pp=2", "parallel.schedule=gpipe"]),
        (2, ["parallel.tp=1", "parallel.pp=1"]),  # dp=2, ZeRO off: dp rank 0 writes; 10 segments: 20 steps
    ]
    run_chain(tmp_path / "chain", reference, losses(reference), chain, "train.steps=20")


def test_zero_stages_reshard_into_each_other(tmp_path):
    """ZeRO 3 -> 0 -> 2 -> 3 across layouts (sharded parameters written and loaded through their pieces), and
    one process, like one uninterrupted single-process run to 1e-10 (float64)."""
    reference = tmp_path / "reference"
    train(1, reference, *F64, "train.steps=10", "parallel.microbatches=1", "model.tie_embeddings=true")
    chain = [
        (4, ["parallel.zero=3", "parallel.tp=2", "parallel.sequence_parallel=true"]),  # dp=2, SP norms whole
        (2, ["parallel.zero=0"]),  # dp=2
        (4, ["parallel.zero=2", "parallel.pp=2"]),  # dp=2
        (8, ["parallel.zero=3", "parallel.tp=2", "parallel.pp=2", "parallel.zero_reshard_after_forward=false"]),
        (1, ["parallel.zero=3"]),
    ]
    run_chain(tmp_path / "chain", reference, losses(reference), chain, "train.steps=10", "model.tie_embeddings=true")


def test_reshard_an_odd_vocabulary_with_tied_embeddings(tmp_path):
    """257 tokens (padded in memory: 384 rows at tp=1, 512 at tp=2 and tp=4, where the last rank holds no
    real row; 258 with vocab_multiple=1) save and resume across tp=2 -> 1 -> 4 -> 2 with ZeRO -> pp=2 (the
    tied copy on the last stage) like one process; the checkpoint holds the true vocabulary."""
    odd = [*F64, "train.steps=10", "model.vocab_size=257", "model.tie_embeddings=true"]
    reference = tmp_path / "reference"
    train(1, reference, *odd, "parallel.microbatches=1")
    ref = losses(reference)
    chain = [(2, ["parallel.tp=2"]), (1, []), (4, ["parallel.tp=4", "parallel.sequence_parallel=true"]),
             (4, ["parallel.tp=2", "parallel.zero=1", "model.vocab_multiple=1"]), (2, ["parallel.pp=2"])]
    run_dir = tmp_path / "chain"
    for i, (ranks, layout) in enumerate(chain):
        train(ranks, run_dir, *odd, *layout, "--max-steps", "2", "--resume", "auto", timeout=300)
        got = losses(run_dir)
        for step in (2 * i + 1, 2 * i + 2):
            assert abs(got[step] - ref[step]) <= 1e-10 * abs(ref[step]), (i, layout, step, got[step], ref[step])
        with h5py.File(sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "checkpoint.h5", "r") as f:
            assert f["model/embed.weight"].shape == (257, 64) and f["optim/exp_avg/embed.weight"].shape == (257, 64)
    ckpt("diff", str(reference), str(run_dir), "--atol", "1e-9")


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run with checkpoints at steps 2 and 4 (2 ranks, tp=2)."""
    run_dir = tmp_path_factory.mktemp("good")
    train(2, run_dir, *F32, "parallel.tp=2", "parallel.pp=1", "--max-steps", "4", "checkpoint.interval=2")
    return run_dir


def _copy(run_dir, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def _all_ranks_fail(result, nprocs, message):
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    # an agreed error: every rank exits with it, rank 0 prints it once
    assert len(errors) == 1 and errors[0].startswith(f"hpctrain: error: all {nprocs} ranks: "), result.stderr
    assert message in errors[0], result.stderr


def _state(run_dir):
    return {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


@pytest.fixture(scope="module")
def refused(two_checkpoints, tmp_path_factory):
    """Every refused resume of the tests below, in ONE 2-rank launch (scripts/check_bad_inputs.py runs each
    ``hpctrain train`` in-process on both ranks): {case: (run directory, [each rank's (error type, raised
    alike, message, ...)], its files' mtimes before, after)}. Each case works on its own copy of
    two_checkpoints (or a new directory)."""
    base = tmp_path_factory.mktemp("refused")
    good = two_checkpoints / "checkpoints"

    def copy(name):
        target = base / name
        shutil.copytree(two_checkpoints, target)
        return target

    truncated = copy("truncated")
    master = truncated / "checkpoints" / "step-00000004" / "checkpoint.h5"
    os.truncate(master, master.stat().st_size // 3)
    unreadable = copy("unreadable")
    for step in ("00000004", "00000002"):
        with h5py.File(unreadable / "checkpoints" / f"step-{step}" / "checkpoint.h5", "r+") as f:
            del f.attrs["sampler"]  # a KeyError while reading (it used to end every rank with exit 1)
    blocker = base / "a-file"
    blocker.write_text("not a directory")
    cases = {  # case: (run directory, overrides after F32)
        "truncated": (truncated, ["parallel.tp=2", "--resume", str(master.parent)]),
        "missing": (base / "x", ["--resume", str(base / "nope")]),
        "other shape": (base / "y", ["model.d_ff=512", "--resume", str(good / "step-00000004")]),
        "other window": (base / "other", ["parallel.tp=2", "model.attention_window=8", "--resume",
                                          str(good / "step-00000002")]),
        "auto, other model": (copy("auto"), ["model.d_ff=512", "--resume", "auto"]),
        "unwritable": (copy("unwritable"), ["parallel.tp=2", f"checkpoint.dir={blocker}/ckpt", "--max-steps", "1"]),
        "none readable": (unreadable, ["parallel.tp=2", "--resume", "auto"]),
        "seed": (copy("seed"), ["parallel.tp=2", "train.seed=99", "--resume", "auto"]),
    }
    before = {case: _state(run_dir) if run_dir.exists() else {} for case, (run_dir, _) in cases.items()}
    commands = [["train", f"train.run_dir={run_dir}", *F32, *overrides] for run_dir, overrides in cases.values()]
    found = refused_inputs(2, base / "unused", commands, timeout=300)
    return {case: (run_dir, ranks, before[case], _state(run_dir) if run_dir.exists() else {})
            for (case, (run_dir, _)), ranks in zip(cases.items(), found)}


def _refused_alike(refused, case, message):
    """The case failed on both ranks with the same user error, marked as raised everywhere (the CLI prints it
    once, as "all 2 ranks: ...", exit 2: tests/mpi/test_bad_input.py), naming ``message``; returns the line."""
    return assert_refused_alike(refused[case][1], 2, message, case)


def test_ckpt_list_inspect_verify(two_checkpoints):
    records = json.loads(ckpt("list", str(two_checkpoints), "--json").stdout)
    assert [(r["step"], r["complete"], r["latest"]) for r in records] == [(2, True, False), (4, True, True)]
    assert set(records[0]) == {"step", "path", "complete", "latest"}
    info = json.loads(ckpt("inspect", records[-1]["path"], "--json").stdout)
    assert info["step"] == 4 and info["layout"]["tp"] == 2
    names = {t["name"]: t for t in info["tensors"]}
    assert names["model/embed.weight"]["shape"] == [256, 64] and names["model/embed.weight"]["boxes"] == 2
    assert "OK" in ckpt("verify", records[-1]["path"]).stdout
    cli = subprocess.run([sys.executable, "-m", "hpctrain.cli", "ckpt", "verify", records[-1]["path"]],
                         capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)  # as its own process
    assert cli.returncode == 0 and "OK" in cli.stdout, cli.stdout + cli.stderr


def test_flipped_byte_is_detected_and_resume_falls_back(two_checkpoints, tmp_path):
    run_dir = _copy(two_checkpoints, tmp_path)
    step4 = run_dir / "checkpoints" / "step-00000004"
    shard = sorted((step4 / "shards").glob("*.h5"))[0] if (step4 / "shards").exists() and \
        list((step4 / "shards").glob("*.h5")) else step4 / "checkpoint.h5"
    with h5py.File(shard, "r") as f:  # the file offset of one dataset's raw data
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and o.size > 100
                     and n != "manifest" else None)
        name = next(n for n in names if f[n].id.get_offset())
        offset = f[name].id.get_offset() + 17
    with open(shard, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    bad = ckpt("verify", str(step4), check=False)
    assert bad.returncode != 0 and "checksum mismatch" in bad.stderr and "dataset " in bad.stderr
    out = train(2, run_dir, *F32, "parallel.tp=2", "parallel.pp=1", "--resume", "auto", "--max-steps", "1")
    assert "step-00000004 is unusable" in out.stderr and "checksum mismatch" in out.stderr
    assert "at step 2" in out.stdout  # fell back to the previous complete checkpoint


def test_resume_reads_each_byte_once_and_checks_it(two_checkpoints, tmp_path):
    """read_checked (the resume path) serves requests in ANOTHER layout from whole manifest boxes: the
    result equals a plain read, every stored byte is read exactly once, every box's CRC is checked on
    those bytes, and a flipped byte shows up as a problem (without raising)."""
    from hpctrain.checkpoint.format import Box
    from hpctrain.checkpoint.reader import CheckpointReader

    path = two_checkpoints / "checkpoints" / "step-00000004"
    with CheckpointReader(str(path)) as reader:
        plain = {name: reader.read(name, Box((0,) * len(reader.shape(name)), reader.shape(name)))
                 for name in reader.manifest}
        before = reader.bytes_read
        for name, whole in plain.items():  # two requests per dataset, split along the LAST dimension
            cut = whole.shape[-1] // 2 if whole.ndim else 0
            for lo, hi in ((0, cut), (cut, whole.shape[-1] if whole.ndim else 0)):
                if whole.ndim == 0 or hi == lo:
                    continue
                box = Box((0,) * (whole.ndim - 1) + (lo,), whole.shape[:-1] + (hi - lo,))
                assert (reader.read_checked(name, box) == whole[..., lo:hi]).all(), name
        assert reader.bytes_read - before == sum(a.nbytes for a in plain.values())  # once each, no second pass
        assert reader.checked == set(range(len(reader.boxes()))) and reader.problems == []
        assert reader.verify(skip=reader.checked) == []
    damaged = _copy(two_checkpoints, tmp_path) / "checkpoints" / "step-00000004"
    name, box, _ = CheckpointReader(str(damaged)).boxes()[0]
    with h5py.File(damaged / "checkpoint.h5", "r+") as f:  # through the virtual dataset when shards
        f[name][box.slices()] = f[name][box.slices()] + 1
    with CheckpointReader(str(damaged)) as reader:
        reader.read_checked(name, box)
        assert any("checksum mismatch" in p and name in p for p in reader.problems), reader.problems


def test_truncated_file_is_a_clear_error(refused):
    _refused_alike(refused, "truncated", "step-00000004")
    run_dir = refused["truncated"][0]
    out = train(2, run_dir, *F32, "parallel.tp=2", "--resume", "auto", "--max-steps", "1")
    assert "unusable" in out.stderr and "at step 2" in out.stdout


def test_missing_checkpoint_and_other_model_shape(refused):
    _refused_alike(refused, "missing", "no such checkpoint file")
    _refused_alike(refused, "other shape", "model.d_ff is 256 there, 512 here")


def test_a_resume_into_another_model_is_refused_naming_every_key_and_changes_nothing(two_checkpoints, refused,
                                                                                    tmp_path):
    """Slurm's automatic resume (no --resume) of a run whose config now has fewer layers and another
    rope_theta and norm_eps (every parameter of that model is in the checkpoint, shaped alike) is refused in one
    line naming each key with both values: exit 2, nothing written, pruned or moved. The newest checkpoint has
    no fingerprint (as written before it existed: derived from its config); an explicit --resume of one that
    has it refuses another attention_window. `ckpt inspect` prints the fingerprint."""
    run_dir = _copy(two_checkpoints, tmp_path)
    step4 = run_dir / "checkpoints" / "step-00000004"
    arch = json.loads(ckpt("inspect", str(step4), "--json").stdout)["architecture"]
    assert arch["recorded"] and arch["keys"]["n_layers"] == 2 and len(arch["fingerprint"]) == 16
    assert f"architecture: fingerprint {arch['fingerprint']}: vocab_size=256, d_model=64, n_layers=2, " \
           in ckpt("inspect", str(step4)).stdout
    with h5py.File(step4 / "checkpoint.h5", "r+") as f:
        del f.attrs["architecture"]
    assert json.loads(ckpt("inspect", str(step4), "--json").stdout)["architecture"] == {**arch, "recorded": False}
    state = {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    result = run_mpi(2, "hpctrain.cli", "train", f"train.run_dir={run_dir}", *F32, "parallel.tp=2", "train.steps=12",
                     "checkpoint.interval=2", "checkpoint.keep=1", "model.n_layers=1", "model.rope_theta=500000",
                     "model.norm_eps=1e-6", module=True, timeout=240, check=False,
                     env={"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "1"})
    assert result.returncode == 2, result.output[-3000:]
    _all_ranks_fail(result, 2, "model.n_layers is 2 there, 1 here")
    line = next(x for x in result.stderr.splitlines() if x.startswith("hpctrain: error: "))
    assert "model.rope_theta is 10000.0 there, 500000.0 here" in line and "Nothing was changed" in line
    assert "model.norm_eps is 1e-05 there, 1e-06 here" in line and "Traceback" not in result.stderr
    assert {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*")} == state
    # an explicit --resume of a checkpoint with a fingerprint (step 2 of the same run, in the shared launch)
    _refused_alike(refused, "other window", "model.attention_window is 0 there, 8 here")
    assert not list(refused["other window"][0].rglob("step-*"))


def test_resume_auto_with_another_model_is_an_error_that_changes_nothing(refused):
    """A config typo must not start the run over and prune its trained checkpoints."""
    _refused_alike(refused, "auto, other model", "Nothing was changed")
    _, _, before, after = refused["auto, other model"]
    assert after == before and before


def test_unwritable_checkpoint_dir_fails_on_every_rank_and_keeps_the_good_ones(refused):
    run_dir, _, before, after = refused["unwritable"]
    blocker = run_dir.parent / "a-file"
    _refused_alike(refused, "unwritable", f"checkpoint.dir={blocker}/ckpt is inside {blocker}, which is a regular file")
    assert not (run_dir / "metrics.jsonl").read_text().count('"step": 5')  # refused before training
    names = sorted(k.parts[1] for k in before if len(k.parts) == 2 and k.parts[0] == "checkpoints")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == names and "step-00000004" in names
    assert {k: v for k, v in after.items() if k.parts[0] == "checkpoints"} == \
           {k: v for k, v in before.items() if k.parts[0] == "checkpoints"}
    assert "OK" in ckpt("verify", str(run_dir)).stdout


def test_any_read_error_falls_back_together_and_unreadable_checkpoints_never_restart_from_zero(
        two_checkpoints, refused, tmp_path):
    """A KeyError while reading step 4 (its sampler state deleted: it used to end every rank with exit 1) falls
    back to step 2 on every rank; with both steps so damaged (the shared launch of ``refused``), the run is
    refused and nothing changes."""
    run_dir = _copy(two_checkpoints, tmp_path)
    with h5py.File(run_dir / "checkpoints" / "step-00000004" / "checkpoint.h5", "r+") as f:
        del f.attrs["sampler"]
    out = train(2, run_dir, *F32, "parallel.tp=2", "--resume", "auto", "--max-steps", "1")
    assert "unusable" in out.stderr and "KeyError" in out.stderr and "at step 2" in out.stdout
    line = _refused_alike(refused, "none readable", "none of the 2 complete checkpoint(s)")
    assert "--resume none" in line
    _, _, before, after = refused["none readable"]
    assert after == before and before  # nothing changed


def test_a_sampler_mismatch_is_found_before_anything_is_applied(refused):
    _refused_alike(refused, "seed", "seed mismatch")


def test_stopping_right_after_a_resume_saves_nothing_twice(two_checkpoints, tmp_path):
    run_dir = _copy(two_checkpoints, tmp_path)
    newest = run_dir / "checkpoints" / "step-00000004" / "COMPLETE"
    before = newest.stat().st_mtime_ns
    train(2, run_dir, *F32, "parallel.tp=2", "train.steps=4", "--resume", "auto")  # nothing left to train
    assert newest.stat().st_mtime_ns == before  # not saved again (it used to go through step-N.replaced)
    assert not list((run_dir / "checkpoints").glob("*.replaced"))


def test_a_rollback_moves_the_newer_checkpoints_aside(two_checkpoints, tmp_path):
    run_dir = _copy(two_checkpoints, tmp_path)
    ckpts = run_dir / "checkpoints"
    out = train(2, run_dir, *F32, "parallel.tp=2", "--resume", str(ckpts / "step-00000002"), "--max-steps", "1")
    assert "step-00000004 were moved to" in out.stdout, out.stdout[-2000:]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000003"]
    (aside,) = (ckpts / "superseded").iterdir()
    assert (aside / "step-00000004" / "COMPLETE").exists()  # kept, out of the lineage being trained
    assert (ckpts / "latest").read_text().strip() == "step-00000003"


def test_gpt_architecture_reshards_exactly_and_another_mlp_is_refused(tmp_path):
    """GELU + learned positions + tied: the position table is one global dataset like every parameter
    (written once, whatever the tp/SP/pp/ZeRO layout); a run with another model.mlp (whose GELU up/down would
    fit SwiGLU's shapes) or other positions is refused by name, changing nothing."""
    gpt = [*F64, "model.mlp=gelu", "model.positions=learned", "model.tie_embeddings=true", "train.steps=4"]
    reference = tmp_path / "reference"
    train(1, reference, *gpt, "parallel.microbatches=1")
    run_dir = tmp_path / "chain"
    for ranks, layout in ((4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
                          (2, ["parallel.zero=1"])):  # dp=2
        train(ranks, run_dir, *gpt, *layout, "--max-steps", "2", "--resume", "auto", timeout=300)
    ref, got = losses(reference), losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    assert all(abs(got[s] - ref[s]) <= 1e-10 * abs(ref[s]) for s in got), (got, ref)
    ckpt("diff", str(reference), str(run_dir), "--atol", "1e-9")
    latest = json.loads(ckpt("list", str(run_dir), "--json").stdout)[-1]["path"]
    tensors = {t["name"]: t for t in json.loads(ckpt("inspect", latest, "--json").stdout)["tensors"]}
    assert tensors["model/pos_embed.weight"]["shape"] == [256, 64]  # tiny's max_seq_len x d_model
    assert not any(".mlp.gate." in name for name in tensors)
    for other, key in (("model.mlp=swiglu", "model.mlp is 'gelu' there, 'swiglu' here"),
                       ("model.positions=rope", "model.positions is 'learned' there, 'rope' here")):
        result = train(2, run_dir, *gpt, other, "--resume", "auto", check=False)
        _all_ranks_fail(result, 2, key)
