"""The node-local checkpoint tier (checkpoint.local_dir) on two emulated nodes (UTS namespaces, each with its own
``{hostname}`` directory): a run killed mid-step resumes from it bitwise; a lost node's pieces come from the
replicas; a flipped byte falls back to the replica, then to the global tier, each in one line; another layout
skips it. One killed run serves every case (its files are put back before each)."""
import json
import re
import shutil

import pytest

from mpirun import ckpt, run_mpi

HOSTS = ["h1", "h2"]
ARGS = ["--config", "configs/tiny.toml", "data.max_bytes=300000", "train.seq_len=32", "model.n_layers=2",
        "train.dtype=float64", "parallel.pp=1", "parallel.tp=1", "train.steps=12", "checkpoint.interval=6"]


def train(run_dir, *extra, resume="auto", env=None, check=True):
    return run_mpi(2, "hpctrain.cli", "train", *ARGS, f"train.run_dir={run_dir}", f"--resume={resume}", *extra,
                   module=True, fake_nodes=HOSTS, env=env, check=check, timeout=120)


def losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def flip_byte(path, at=100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(data)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """An uninterrupted reference run, and a run whose rank 1 was killed in step 11 (local saves at 4 and 8,
    global at 6): its run directory and both nodes' tiers, kept aside to be put back before each case."""
    base = tmp_path_factory.mktemp("local")
    ref = base / "ref"
    train(ref, resume="none")
    run, local = base / "run", base / "local"
    tier = [f"checkpoint.local_dir={local}/{{hostname}}", "checkpoint.local_interval=4", "checkpoint.replicas=1"]
    out = train(run, *tier, resume="none", env={"HPCTRAIN_FAULT": "rank=1,step=11,phase=forward,action=kill"},
                check=False)
    assert out.returncode != 0
    shutil.copytree(run, base / "run.kept")
    shutil.copytree(local, base / "local.kept")
    yield {"ref": losses(ref), "ref_dir": ref, "run": run, "local": local, "base": base, "tier": tier}


def put_back(k):
    for name in ("run", "local"):
        shutil.rmtree(k[name], ignore_errors=True)
        shutil.copytree(k["base"] / f"{name}.kept", k[name])
    return k["run"]


def step8(k, host):
    (tier,) = (k["local"] / host).iterdir()
    return tier / "step-00000008"


def resumed(k, out, step: int):
    """The run went on from ``step`` to the end, every loss from there bitwise the reference's."""
    assert f"at step {step} " in out.stdout, out.output[-3000:]
    got = losses(k["run"])
    assert max(got) == 12 and all(got[s] == k["ref"][s] for s in range(step + 1, 13)), (got, k["ref"])


def test_a_lost_node_is_rebuilt_from_the_replicas_and_the_run_goes_on_bitwise(killed):
    run = put_back(killed)
    shutil.rmtree(killed["local"] / "h2")  # the node and its local disk are gone
    out = train(run, *killed["tier"])
    assert "resumed from the local tier" in out.stdout and "rank(s) 1 rebuilt from replicas" in out.stdout, out.output
    resumed(killed, out, 8)  # newer than the global step 6
    diff = ckpt("diff", str(run), str(killed["ref_dir"]), check=False)
    assert diff.returncode == 0, diff.output


def test_a_flipped_byte_falls_back_to_the_replica_then_to_the_global_tier_in_one_line(killed):
    run = put_back(killed)
    flip_byte(step8(killed, "h1") / "rank-00000.bin")
    listed = run_mpi(1, "hpctrain.cli", "ckpt", "list", str(run), "--local-dir", str(killed["local"] / "h1"), "--json",
                     module=True)
    # step 8's pieces; step 4's may still be there: its pruning runs after step 8 is written everywhere, in the
    # background, which the kill in step 11 can cut short on a loaded machine (then the older step stays: safe)
    local = [r for r in json.loads(listed.stdout) if r.get("tier") == "local" and r["step"] == 8]
    assert [(r["step"], r["rank"], r["kind"]) for r in local] == [(8, 0, "own"), (8, 1, "replica")], local
    bad = ckpt("verify", str(step8(killed, "h1") / "rank-00000.json"), check=False)
    assert bad.returncode == 2 and "is corrupt: tensor range0/params: checksum mismatch" in bad.stderr, bad.output
    good = ckpt("verify", str(step8(killed, "h2") / "replica-00000.json"))
    assert ": OK (" in good.stdout
    out = train(run, *killed["tier"])
    warnings = [line for line in out.stderr.splitlines() if "local tier:" in line]
    assert len(warnings) == 1 and "rank 0 at step 8" in warnings[0] and "checksum mismatch" in warnings[0] \
        and "trying its replica" in warnings[0], out.stderr
    assert "rank(s) 0 rebuilt from replicas" in out.stdout
    resumed(killed, out, 8)

    run = put_back(killed)  # now its replica too: the global tier (step 6), never NaN, never a loop
    flip_byte(step8(killed, "h1") / "rank-00000.bin")
    flip_byte(step8(killed, "h2") / "replica-00000.bin", at=5000)
    out = train(run, *killed["tier"])
    warnings = [line for line in out.stderr.splitlines() if "local tier:" in line]
    assert len(warnings) == 2 and "no replica left: resuming from the global tier" in warnings[1], out.stderr
    assert "resumed from the local tier" not in out.stdout
    resumed(killed, out, 6)


def test_another_layout_skips_the_local_tier_in_one_line(killed):
    run = put_back(killed)
    out = train(run, *killed["tier"], "parallel.tp=2")
    assert "step 8 was written for another layout: parallel.dp 2 there, 1 here; parallel.tp 1 there, 2 here" \
        in out.stderr, out.stderr
    assert "at step 6 " in out.stdout and "local tier (" not in out.stdout
    # another lineage from here: the old pieces (own and replicas) are gone from both nodes; step 8 is new
    pieces = [json.loads(p.read_text()) for host in HOSTS for p in (killed["local"] / host).glob("*/step-*/*.json")]
    assert len(pieces) == 4 and all(p["layout"]["tp"] == 2 and p["step"] == 8 for p in pieces), pieces


def test_bad_local_tier_keys_are_refused_in_one_line(tmp_path):
    """(checkpoint.local_interval without checkpoint.local_dir: tests/mpi/test_bad_input.py)"""
    blocked = tmp_path / "file"
    blocked.write_text("a file where the local directory should be")
    failed = tmp_path / "failed-nodes"
    out = run_mpi(2, "hpctrain.cli", "train", *ARGS, f"train.run_dir={tmp_path / 'run'}", "--resume=none",
                  f"checkpoint.local_dir={blocked}/{{hostname}}", "checkpoint.local_interval=2", module=True,
                  fake_nodes=HOSTS, check=False, timeout=60, env={"HPCTRAIN_NODE_FAILURE_FILE": str(failed)})
    said = [line for line in out.stderr.splitlines() if "is not usable" in line]
    # the nodes are the problem (exit 5: a relaunch without them can go on), named for slurm/train.sbatch
    assert out.returncode == 5 and len(said) == 1, out.output
    assert failed.read_text().split() == ["h1", "h2"], out.output
    assert "checkpoint.local_dir=" in said[0] and "rank 0 on h1" in said[0] and "rank 1 on h2" in said[0], said
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and blocked.read_text().startswith("a file")


def test_a_full_local_disk_costs_the_local_pieces_only(killed, tmp_path):
    """/dev/shm too small for a piece (a real 1 MiB tmpfs): one warning per rank, the run trains on unchanged
    and ends with its global checkpoint."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        run = tmp_path / "run"
        out = train(run, f"checkpoint.local_dir={small}/{{hostname}}", "checkpoint.local_interval=2",
                    "checkpoint.replicas=1", resume="none")
        said = re.findall(r"WARNING: rank (\d): local checkpoint of step \d+ not written \(([^)]*)\); training goes on",
                          out.stderr)  # the two ranks' lines may interleave
        assert sorted(rank for rank, _ in said) == ["0", "1"], out.stderr
        assert all(why.endswith(": No space left on device") for _, why in said), said
        assert losses(run) == killed["ref"]
        assert (run / "checkpoints" / "step-00000012").is_dir()
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_local_pieces_that_cannot_be_used_with_no_global_checkpoint_never_start_over(tmp_path):
    """Only the local tier holds the run (checkpoint.interval=0) and it was written for another layout: exit 2
    naming both tiers, the pieces and the run's files untouched (never a silent restart from step 0)."""
    run, local = tmp_path / "run", tmp_path / "local"
    tier = [f"checkpoint.local_dir={local}/{{hostname}}", "checkpoint.local_interval=2", "checkpoint.replicas=1",
            "checkpoint.interval=0"]
    out = train(run, *tier, resume="none", env={"HPCTRAIN_FAULT": "rank=1,step=5,phase=forward,action=kill"},
                check=False)
    assert out.returncode != 0 and not (run / "checkpoints" / "latest").exists()
    pieces = sorted(p.relative_to(local) for p in local.rglob("*.bin"))
    before = (run / "metrics.jsonl").read_text()
    out = train(run, *tier, "parallel.tp=2", check=False)
    assert out.returncode == 2 and "holds steps of this run but none could be resumed" in out.stderr, out.output
    assert sorted(p.relative_to(local) for p in local.rglob("*.bin")) == pieces and pieces
    assert (run / "metrics.jsonl").read_text() == before


def test_unreadable_pieces_and_nothing_else_are_named_and_the_run_starts_over_announced(killed, tmp_path):
    """The local tier holds the only state of the run (checkpoint.interval=0) and every index file of it is damaged
    after a kill -9: each is named in one line (host, file, why), never treated as absent; the run starts over
    from step 0 saying so, the pieces moved aside (kept), the killed run's files set aside, and it trains like an
    uninterrupted run (issue #55)."""
    run, local = tmp_path / "run", tmp_path / "local"
    tier = [f"checkpoint.local_dir={local}/{{hostname}}", "checkpoint.local_interval=2", "checkpoint.replicas=0",
            "checkpoint.interval=0"]
    out = train(run, *tier, resume="none", env={"HPCTRAIN_FAULT": "rank=1,step=5,phase=forward,action=kill"},
                check=False)
    assert out.returncode != 0
    indexes = sorted(local.rglob("step-*/*.json"))
    pieces = sorted(p.name for p in local.rglob("step-*/*.bin"))
    assert len(indexes) >= 2 and pieces, indexes  # step 4 on both nodes (step 2 where its removal was cut short)
    for path in indexes:
        path.write_text('{"step": 4, "damaged')
    out = train(run, *tier)
    assert out.returncode == 0, out.output
    named = [line for line in out.stderr.splitlines() if "cannot be read" in line]
    assert len(named) == len(indexes) and {line.split("local tier: ")[1].split(":")[0] for line in named} == set(HOSTS), named
    assert "starting over from step 0" in out.stderr and "resumed" not in out.stdout, out.output
    kept = sorted(p.name for p in local.rglob("unusable-*/step-*/*.bin"))
    assert kept == pieces, (kept, pieces)
    assert list(run.glob("superseded/*/metrics.jsonl"))  # the killed run's metrics, set aside, not appended to
    assert losses(run) == killed["ref"], (losses(run), killed["ref"])


def test_one_bit_adam_resumes_from_the_local_tier_bitwise(tmp_path):
    """1-bit Adam commits its averaged momentum into the optimizer state before the update: the background copy
    of a local save must be done before that (TrainState.before_next_update), or the piece mixes two steps."""
    onebit = ["compression.method=onebit-adam", "compression.warmup_steps=2", "checkpoint.interval=0"]
    train(tmp_path / "ref", *onebit, resume="none")
    tier = [f"checkpoint.local_dir={tmp_path / 'local'}/{{hostname}}", "checkpoint.local_interval=2"]
    out = train(tmp_path / "run", *onebit, *tier, resume="none", check=False,
                env={"HPCTRAIN_FAULT": "rank=1,step=9,phase=forward,action=kill"})
    assert out.returncode != 0
    out = train(tmp_path / "run", *onebit, *tier)
    at = int(re.search(r"resumed from the local tier \(\S+\) at step (\d+)", out.stdout).group(1))
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "run")
    assert at >= 4 and max(got) == 12 and all(got[s] == ref[s] for s in range(at + 1, 13)), (at, got, ref)


def test_a_background_copy_that_raises_on_one_rank_stops_every_rank_within_a_step_naming_it(tmp_path):
    """Rank 1's background copy of its step-4 piece raises (as a CUDA error would): every rank stops at the
    same step within a step or two, with one agreed error naming rank 1 and its host, exit 5 (a node failure:
    `--restarts` relaunches without h2, named in $HPCTRAIN_NODE_FAILURE_FILE); no partner waits for its piece."""
    run, failed_nodes = tmp_path / "run", tmp_path / "failed-nodes"
    out = train(run, f"checkpoint.local_dir={tmp_path}/local/{{hostname}}", "checkpoint.local_interval=4",
                "checkpoint.replicas=1", resume="none", check=False,
                env={"HPCTRAIN_FAULT": "rank=1,step=4,phase=copy,action=raise",
                     "HPCTRAIN_NODE_FAILURE_FILE": str(failed_nodes)})
    assert out.returncode == 5, out.output[-3000:]
    assert "local checkpoint of step 4 failed in the background: rank 1 on h2: RuntimeError: injected error" \
        in out.output, out.output[-3000:]
    assert max(losses(run)) <= 6, losses(run)  # agreed in the step after the copy, read one step late
    assert failed_nodes.read_text().split() == ["h2"]


def test_a_local_dir_shared_between_nodes_and_too_many_replicas_are_refused_in_one_line(tmp_path):
    """A checkpoint.local_dir that both emulated nodes see (no {hostname}: one shared file system) and
    checkpoint.replicas above nodes - 1: one line naming the keys, exit 2, nothing written."""
    shared = train(tmp_path / "run", f"checkpoint.local_dir={tmp_path}/shared", "checkpoint.local_interval=2",
                   resume="none", check=False)
    said = [line for line in shared.stderr.splitlines() if "hpctrain: error" in line]
    assert shared.returncode == 2 and len(said) == 1 and "is shared between nodes (h1, h2" in said[0], shared.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert [p.name for p in (tmp_path / "shared").iterdir()] and not any(
        p.name.startswith(".probe") for tier in (tmp_path / "shared").iterdir() for p in tier.iterdir())
    many = train(tmp_path / "run2", f"checkpoint.local_dir={tmp_path}/local/{{hostname}}", "checkpoint.local_interval=2",
                 "checkpoint.replicas=2", resume="none", check=False)
    said = [line for line in many.stderr.splitlines() if "hpctrain: error" in line]
    assert many.returncode == 2 and len(said) == 1 and "checkpoint.replicas=2 needs 3 nodes" in said[0], many.output
    assert not (tmp_path / "run2" / "metrics.jsonl").exists() and not (tmp_path / "local").exists()
