"""Mixtures of experts on real ranks (float64): every layout family trains like one process, with expert
parallelism (experts split over ep ranks of the replica group, rows dispatched by Alltoallv) and without;
checkpoints reshard across ep sizes; a killed rank resumes bitwise; a stopped rank inside the dispatch
is named by the hang report. The layer itself against a loop over tokens: tests/unit/test_moe_layer.py."""
import json
import os
import re
import signal

import pytest

from mpirun import FidelityRuns, ckpt, run_mpi

F64 = ["--param-rtol", "1e-10", "--rtol", "1e-10"]
MOE = ["moe.num_experts=4", "moe.layers=[0,2,3]", "moe.z_loss_coef=0.01"]
# the CLI runs: 4 MoE blocks of 4 experts, capacity that drops choices, float64
RUN = ["data.max_bytes=300000", "train.seq_len=16", "train.global_batch=8", "model.n_heads=8", "model.n_kv_heads=4",
       "model.n_layers=4", "train.dtype=float64", "train.warmup_steps=1", "train.lr=1e-2", "train.steps=8",
       "parallel.tp=1", "parallel.pp=1", "train.progress=false", "moe.num_experts=4", "moe.capacity_factor=1.0",
       "moe.z_loss_coef=0.01"]


BOTH = "|1f1b,sp,zero2/1f1b,sp,zero3"
SGD = ["optim.name=sgd", "optim.momentum=0.9", "moe.num_experts=4", "moe.layers=[0,1]", "moe.z_loss_coef=0.01"]
# name: (world size, layouts, variants, *options and overrides) of scripts/check_fidelity.py; one launch per
# world size (tests/mpirun.py: FidelityRuns)
RUNS = {
    "every layout family": (4, f"4,1,1,1,4;4,1,1,1,2{BOTH};2,2,1,1,2{BOTH};2,1,2,1,2{BOTH};1,1,1,4,2;1,2,2",
                            "1f1b,sp,zero2", *F64, *MOE, "moe.capacity_factor=1.0", "moe.shared_experts=1"),
    "lora": (4, "2,2,1,1,2;4,1,1,1,4;1,2,2;4,1,1,1,2|1f1b,sp,zero3", "1f1b,sp,zero1", *F64, *MOE,
             "moe.shared_experts=1", "lora.rank=4", "lora.targets=[q,v,gate,down]", "comm.alltoall_by_peer_kib=0"),
    # float16 starts at loss scale 1024: at the default 65536 the first step's gradients sit at the edge of
    # float16's range, where whether a partial sum overflows (and the step is skipped) depends on how the layout
    # groups the sum, so one process and the layout may skip different steps (seen with the counter-based init)
    "bfloat16": (4, "4,1,1,1,4;2,2,1,1,2", "1f1b,sp,zero1", "--dtype", "bfloat16", "--rtol", "1e-3",
                 "--param-rtol", "1e-2", *SGD),
    "float16": (4, "2,1,2,1,2", "1f1b,sp,zero1", "--dtype", "float16", "--rtol", "1e-3", "--param-rtol", "2e-3",
                *SGD, "train.loss_scale=1024"),
    "8 ranks": (8, "2,2,2,1,2", "interleaved2,sp,zero1", *F64, *MOE, "model.tie_embeddings=true"),
}


@pytest.fixture(scope="module")
def launched():
    return FidelityRuns(RUNS)


def train(nprocs, run_dir, *args, check=True, env=None, timeout=240):
    return run_mpi(nprocs, "hpctrain.cli", "train", f"train.run_dir={run_dir}", *RUN, *args, module=True,
                   timeout=timeout, check=check, env=env)


def records(run_dir):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "event" not in r]


def planned_kept(overrides: list[str], ranks: int, rank: int) -> dict[str, int]:
    """The planner's model state (hpctrain/plan/memory.py) on world rank ``rank``'s stage of a run with experts,
    less what it holds only during a step at zero 3 (the gathered units, one unit's full gradient): what the
    engine keeps between steps (metrics.jsonl ``model_state_bytes``)."""
    from hpctrain.config import load_config, resolve_model
    from hpctrain.config.layout import Layout
    from hpctrain.config.moe_keys import resolve_moe
    from hpctrain.plan.cost import Options
    from hpctrain.plan.devices import DTYPE_BYTES
    from hpctrain.plan.memory import gathered_parameters, state_bytes, unit_gradient, zero3_units
    from hpctrain.plan.shapes import for_tp
    from hpctrain.plan.stages import in_flight, stages

    cfg = load_config(None, overrides)
    lay = Layout.from_config(cfg, ranks)
    model = for_tp(resolve_model(cfg.model), lay.tp_size)
    moe = resolve_moe(cfg.moe, model)
    stage = stages(model, lay, moe)[rank // lay.tp_size % lay.pp_size]
    params, grads, optimizer = state_bytes(model, stage, lay, Options(dtype=cfg.train.dtype), moe)
    if lay.zero == 3:
        nb = DTYPE_BYTES[cfg.train.dtype]
        units = zero3_units(model, stage, lay, 1, moe)
        params -= gathered_parameters(units, 1, True, in_flight(lay, stage, 1) > 1) * nb
        grads -= max(unit_gradient(u) for chunk in units for u in chunk) * max(4, nb)
    return {"params": int(params), "grads": int(grads), "optimizer": int(optimizer)}


def test_every_layout_family_trains_like_one_process_with_and_without_expert_parallelism(launched):
    """dp=4 over ep=4 (one expert per rank, no expert reduction), dp=4 over ep=2 (each expert's gradients and
    state sharded over its two replicas), dp x tp (SP) with ep=2, dp x pp with ep=2, cp=4 with ep=2 (capacity
    over the whole zig-zag sequence), and tp x pp without ep: with a capacity that drops choices, the z-loss and
    a shared expert, ZeRO-2 (the experts' group reduce-scattered per micro-batch like the dense one), to 1e-10
    of one process. ZeRO-3 with ep (each unit's experts gathered over their replicas, the ep_replica group,
    around its forward and backward, their gradients reduce-scattered there): dp=4 over ep=2, and ep=2 with
    dp x tp (SP) and with dp x pp (there one replica holds each expert: only the dense part is sharded).
    ZeRO-1 with ep: the LoRA, mixed-precision and 8-rank tests below."""
    out = launched("every layout family")
    assert out.count("OK dp=") == 9 and out.count(" ep=2 ") == 7 and " ep=4 " in out, out
    assert out.count("zero=3 ") == 3 and "OK dp=4 tp=1 pp=1 ep=2 1f1b sp=True zero=3" in out, out
    assert "EXPERTS SHARDED over 2 rank(s)" in out, out


def test_lora_on_the_experts_and_the_shared_expert_in_ep_tp_and_pp_layouts(launched):
    """lora.targets gate and down adapt every routed expert (batched factors, split over ep and tp like their
    weights) and the shared expert's SwiGLU; q and v the attention. Only the adapters train (the frozen weights
    stay bit-identical: checked by the script), like one process. Every ep all-to-all here goes one
    Isend/Irecv per peer (comm.alltoall_by_peer_kib=0), the other tests' through one Alltoallv. At ZeRO-3 with
    dp=4 over ep=2 the frozen experts are sharded over their two replicas (ep_replica), the rest over dp."""
    out = launched("lora")
    # 44 = q, v (A, B) in 4 blocks + gate, down of the dense block 1 + gate, down of the experts and of the
    # shared expert in the 3 MoE blocks
    assert out.count("OK dp=") == 4 and out.count("LORA OK 44 adapters trained") == 5, out  # and the reference
    assert "OK dp=4 tp=1 pp=1 ep=2 1f1b sp=True zero=3" in out and "FROZEN SHARDED" in out, out


def test_mixed_precision_and_compile_with_expert_parallelism(launched):
    """bfloat16 with ep=4 and ep x tp (SP), float16 (dynamic loss scaling: the auxiliary losses' gradients are
    scaled with the loss) with ep x pp, each follow one process in the same precision (SGD, whose updates are
    linear in the gradients: measured loss 2e-5 / 5e-6, parameters one bfloat16 ulp / 4e-4); and
    train.compile (the MoE layer eager, a graph break by design) equals eager with ep x tp (SP)."""
    for dtype in ("bfloat16", "float16"):
        assert launched(dtype).count(f"zero=1 {dtype}") == RUNS[dtype][1].count(";") + 1
    compiled = run_mpi(4, "check_compile.py", "--layouts", "2,2,1,1,2+sp", "--rtol", "1e-5", *SGD[:3], "moe.layers=[1]",
                       timeout=300)
    assert "COMPILE OK" in compiled.stdout and "ep=2 sp: compiled = eager" in compiled.stdout, compiled.stdout


def test_eight_ranks_expert_parallel_with_tp_interleaved_pipeline_and_zero1_dropless(launched):
    assert launched("8 ranks").count("OK dp=") == 1


def test_checkpoints_reshard_across_ep_sizes_like_one_process(tmp_path):
    """Saved at ep=4 (dp=4), resumed at ep=2 x ZeRO-3 on dp=4 (each expert's parameters born as slices over
    its two replicas), then at ep=2 with tp=2 x ZeRO-3 (one replica per expert: a warning naming the keys),
    then ep=1 on one process, then ep=2 x ZeRO-1 on dp=2: the losses of every segment equal one uninterrupted
    process to 1e-10, and the experts of the checkpoint are global [E, F, D] tensors. The ZeRO-3 x ep run keeps
    the model state ``hpctrain plan`` predicts, byte for byte."""
    import h5py

    steps = "train.steps=10"
    reference = tmp_path / "reference"
    train(1, reference, steps)
    ref = {r["step"]: r["loss"] for r in records(reference)}
    run_dir = tmp_path / "chain"
    chain = [(4, ["parallel.ep=4"]), (4, ["parallel.ep=2", "parallel.zero=3"]),
             (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=3"]),
             (1, []), (2, ["parallel.ep=2", "parallel.zero=1"])]
    for i, (ranks, layout) in enumerate(chain):
        out = train(ranks, run_dir, steps, *layout, "--max-steps", "2", "--resume", "auto", "checkpoint.interval=2")
        warned = "WARNING: parallel.zero=3 with parallel.ep=2 = dp x cp: each expert lives on one rank" in out.stderr
        assert warned == (i == 2), (layout, out.stderr[-2000:])
        if i == 1:  # ZeRO-3 x ep: the planner's model state is the engine's, byte for byte
            first = next(r for r in records(run_dir) if r["step"] == 3 and "model_state_bytes" in r)
            assert first["model_state_bytes"] == planned_kept(RUN + [steps] + layout, ranks, first["peak_memory_rank"])
        got = {r["step"]: r["loss"] for r in records(run_dir)}
        for step in (2 * i + 1, 2 * i + 2):
            assert abs(got[step] - ref[step]) <= 1e-10 * abs(ref[step]), (layout, step, got[step], ref[step])
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "checkpoint.h5"
    with h5py.File(newest, "r") as f:
        assert f["model/layers.1.moe.experts.down"].shape == (4, 64, 256)
        assert f["optim/exp_avg/layers.1.moe.experts.gate"].shape == (4, 256, 64)


def test_a_killed_rank_resumes_bitwise_and_a_stopped_one_is_named_in_the_dispatch(tmp_path):
    """dp=4 x ep=2: rank 1 SIGKILLed in step 6 (checkpoint at 4) resumes to the same losses and parameters as
    an uninterrupted run, bitwise; the uninterrupted run's metrics hold the experts' load and its trace every
    layer's dispatch and combine. Then rank 3 SIGSTOPped at step 3: its ep peer waits in the dispatch (the
    all-gather of the expert counts or an all-to-all) on group 'ep', and the hang report names rank 3."""
    ep = ["parallel.ep=2", "checkpoint.interval=4", "checkpoint.async=false"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    out = train(4, whole, *ep, "train.trace=true")
    spans = [e["name"] for e in json.loads((whole / "trace" / "rank00001.json").read_text())["traceEvents"]
             if e.get("cat") == "span"]
    for layer in range(4):  # each layer's dispatch and combine, forward and backward, named in the trace
        for what in ("dispatch", "combine", "dispatch (backward)", "combine (backward)"):
            assert f"layers.{layer}.moe {what}" in spans, spans
    last = records(whole)[-1]
    assert last["moe_aux_loss"] > 0 and 0 < last["moe_dropped_fraction"] < 1, last
    assert sum(map(sum, last["moe_tokens_per_expert"].values())) == \
        round(4 * 8 * 16 * 2 * (1 - last["moe_dropped_fraction"])), last  # 4 layers x 128 tokens x top 2, kept
    assert "ep" in last["groups"], last["groups"]
    dead = train(4, killed, *ep, env={"HPCTRAIN_FAULT": "rank=1,step=6,phase=forward,action=kill"}, check=False)
    assert dead.returncode != 0 and "fault injection" in dead.stderr, dead.stdout[-2000:] + dead.stderr[-2000:]
    out = train(4, killed, *ep, "--resume", "auto")
    assert "at step 4" in out.stdout, out.stdout
    assert {r["step"]: r["loss"] for r in records(killed)} == {r["step"]: r["loss"] for r in records(whole)}
    diff = ckpt("diff", str(whole), str(killed), "--atol", "0", check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr

    stopped = train(4, tmp_path / "stopped", "parallel.ep=2", "comm.timeout_s=8", "train.steps=30",
                    env={"HPCTRAIN_FAULT": "rank=3,step=3,phase=forward,action=stop"}, check=False, timeout=150)
    err = stopped.stderr
    for pid in re.findall(r"pid (\d+)\)", err):  # never leave the stopped rank behind
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    assert stopped.returncode == 3 and err.count("hpctrain: hang report from") == 1, err[-3000:]
    assert re.search(r"  cause: rank 3 \(node 0 \S+, pid \d+\): .*stopped \(SIGSTOP", err), err[-3000:]
    assert re.search(r"waits in (allgather|alltoallv) #\d+ of \d+ bytes on group 'ep'", err), err[-3000:]
