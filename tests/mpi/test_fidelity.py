"""Every parallel layout trains like one process (float64: relative error <= 1e-10; float32: 1e-5 on losses).

The default suite runs a representative subset; the full matrix (every layout x both schedules x
sequence parallel on/off x ZeRO-1 on/off, tied embeddings) runs with:

    .venv/bin/python -m pytest tests -m full_matrix -v

The runs of one world size share one launch (scripts/check_fidelity_many.py: one start-up of the ranks,
not one per run); each test reads its own run's output from it.
"""
import pytest

from mpirun import FidelityRuns, run_mpi

F64 = ["--param-rtol", "1e-10", "--rtol", "1e-10"]
TIED = "model.tie_embeddings=true"

# name: (world size, layouts, variants, *check_fidelity options and overrides)
RUNS = {
    "every axis and variant": (2, "2,1,1;1,2,1;1,1,2", "all", *F64),
    "interleaved V=2 and 3": (2, "1,1,2", "interleaved2/interleaved3", *F64, "model.n_layers=6",
                              "parallel.microbatches=4", TIED),
    "interleaved, explicit stage layers": (2, "1,1,2", "interleaved2,zero1", *F64, "model.n_layers=6",
                                           "parallel.microbatches=4", "parallel.stage_layers=[1,2,2,1]"),
    "every 4-rank layout": (4, "2,2,1;2,1,2;1,2,2;4,1,1;1,4,1;1,1,4", "1f1b,sp,zero1/gpipe", *F64),
    # the plain (unfused) head and vocab-parallel cross-entropy, what train.compile compiles, against the fused one
    "odd vocabulary, untied": (4, "1,4,1;2,2,1;1,2,2;2,1,2", "1f1b,sp/zero1", *F64, "model.vocab_size=257",
                               "model.tie_embeddings=false", "model.fused_head_loss=false", "--reference",
                               "model.fused_head_loss=true"),
    "odd vocabulary, tied": (4, "1,2,2;1,4,1;2,1,2", "sp,zero1/gpipe", *F64, "model.vocab_size=257", TIED),
    "float32": (4, "1,2,2;2,1,2", "1f1b,sp", "--dtype", "float32", "--rtol", "1e-5"),
    "fewer micro-batches than stages": (4, "1,1,4;1,2,2", "1f1b/gpipe,sp", *F64, "parallel.microbatches=1",
                                        "train.recompute=true"),
    "interleaved with tp, SP, ZeRO-1, dp": (4, "1,2,2;2,1,2", "interleaved2,sp,zero1/interleaved2", *F64, TIED),
    "interleaved pp=4, 4 micro-batches": (4, "1,1,4", "interleaved2,zero1", *F64, "model.n_layers=8", TIED,
                                          "parallel.microbatches=4"),
    "interleaved pp=4, 8 micro-batches": (4, "1,1,4", "interleaved2,zero1", *F64, "model.n_layers=8", TIED,
                                          "parallel.microbatches=8"),
    "gpt architecture": (4, "2,2,1;1,2,2", "1f1b/sp,zero1", *F64, "model.mlp=gelu", "model.positions=learned", TIED),
    "zero 2 and 3": (4, "4,1,1;2,2,1;2,1,2;2,1,1,2", "1f1b,sp,zero2/1f1b,sp,zero3/gpipe,zero3", *F64, TIED),
    "zero 3 interleaved, prefetch 0": (4, "2,1,2", "interleaved2,zero3/1f1b,sp,zero3", *F64, "parallel.microbatches=4",
                                       "train.recompute=true", TIED, "parallel.zero_prefetch=0"),
    "zero 3 interleaved, kept, prefetch 2": (4, "2,1,2", "interleaved2,zero3/1f1b,sp,zero3", *F64,
                                             "parallel.microbatches=4", "train.recompute=true", TIED,
                                             "parallel.zero_reshard_after_forward=false", "parallel.zero_prefetch=2"),
    "zero 3 lora": (4, "2,2,1;2,1,2", "1f1b,zero3", *F64, "lora.rank=4"),
    # (1,2,4) sends temporaries with isend: it caught buffers freed before their send completed
    "8-rank full grid": (8, "2,2,2;1,2,4;1,4,2", "1f1b,sp,zero1/gpipe", *F64, TIED),
    "8-rank interleaved": (8, "2,2,2", "interleaved2,sp,zero1", *F64, TIED, "parallel.microbatches=4",
                           "train.global_batch=16"),
    "8-rank zero 3": (8, "2,2,2", "1f1b,sp,zero3/interleaved2,zero3/gpipe,zero2", *F64, TIED),
    # the zero-bubble schedules (issue #53): an MoE model (blocks 0 and 3: the experts' batched weights get their
    # gradients in B, the dense blocks' linears in W), tied embeddings (zb-v holds both copies on rank 0)
    "zero bubble, every layout family": (4, "2,1,2|zbh1,zero1/zbv,zero2/zbh1,zero3/zbv,zero3;1,2,2|zbh1,sp/zbv,sp,"
                                            "zero1;1,1,2,2|zbv;2,1,2,1,2|zbh1,zero1", "zbh1", *F64, TIED,
                                         "parallel.microbatches=4", "moe.num_experts=4", "moe.layers=[0,3]",
                                         "moe.z_loss_coef=0.01"),
    "zero bubble, lora": (2, "1,1,2", "zbh1/zbv", *F64, "lora.rank=4"),
    # pp = 4, M = 8: zb-v's order from zb_v_table (refined offline), run for real
    "zero bubble, pp=4": (4, "1,1,4", "zbv,zero1", *F64, TIED, "model.n_layers=8", "parallel.microbatches=8",
                          "train.global_batch=8"),
    "8-rank zero bubble": (8, "2,2,2", "zbh1,sp,zero1/zbv,sp,zero3", *F64, TIED, "parallel.microbatches=4",
                           "train.global_batch=16"),
}


def fidelity(nprocs, layouts, variants, *extra, timeout=400):
    result = run_mpi(nprocs, "check_fidelity.py", "--layouts", layouts, "--variants", variants, *extra,
                     timeout=timeout)
    assert "FIDELITY OK" in result.stdout
    return result.stdout


@pytest.fixture(scope="module")
def launched():
    return FidelityRuns(RUNS)


def test_two_ranks_every_axis_every_variant(launched):
    assert launched("every axis and variant").count("OK dp=") == 24


def test_four_ranks_every_layout(launched):
    assert launched("every 4-rank layout").count("OK dp=") == 12


def test_eight_ranks_full_grid_deep_pipelines_and_tied_embeddings(launched):
    assert launched("8-rank full grid").count("OK dp=") == 6


@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_an_odd_vocabulary_in_every_layout_family(launched, tied):
    """257 tokens: padded to 384 rows at tp=1 (the reference), 512 at tp=2 (rank 1 holds 1 real row) and
    tp=4 (rank 3 none); the padding rows stay exactly zero (checked by the script). Tied: across pp stages,
    and inside one stage."""
    name = f"odd vocabulary, {tied}"
    assert launched(name).count("OK dp=") == 2 * len(RUNS[name][1].split(";"))


def test_float32_losses_match(launched):
    assert launched("float32").count("OK dp=") == 2


def test_microbatches_fewer_than_stages_with_recomputation(launched):
    assert launched("fewer micro-batches than stages").count("OK dp=") == 4


def test_interleaved_two_stages_steady_state_three_chunks_and_explicit_virtual_stages(launched):
    """pp=2 with 4 micro-batches (warm-up, steady 1F1B and cool-down), V = 2 and 3, tied embeddings
    (original on rank 0 chunk 0, copy on rank 1 chunk V-1); then a hand-given split of 4 virtual stages."""
    out = launched("interleaved V=2 and 3")
    assert out.count("OK dp=") == 2 and "interleaved3" in out
    assert launched("interleaved, explicit stage layers").count("OK dp=") == 1


def test_interleaved_with_tp_sp_zero1_dp_and_four_stages(launched):
    """micro-batches == pp (every rank warms up fully, as Megatron), with tp + SP + ZeRO-1, dp, tied
    embeddings; then pp=4 x V=2 over 8 layers with 4 and 8 micro-batches."""
    assert launched("interleaved with tp, SP, ZeRO-1, dp").count("OK dp=") == 4
    for microbatches in (4, 8):
        assert launched(f"interleaved pp=4, {microbatches} micro-batches").count("OK dp=") == 1


def test_interleaved_eight_ranks_full_grid(launched):
    assert launched("8-rank interleaved").count("OK dp=") == 1


@pytest.mark.full_matrix
@pytest.mark.parametrize("nprocs,layouts", [
    (2, "2,1,1;1,2,1;1,1,2"),
    (4, "2,2,1;2,1,2;1,2,2;4,1,1;1,4,1;1,1,4"),
    (8, "2,2,2;1,2,4;1,4,2"),
])
@pytest.mark.parametrize("tied", ["false", "true"])
def test_full_matrix(nprocs, layouts, tied):
    fidelity(nprocs, layouts, "all", *F64, f"model.tie_embeddings={tied}", timeout=1200)


def test_gpt_architecture_gelu_mlp_and_learned_positions_in_every_layout_family(launched):
    # learned positions: replicated over tp, each SP rank adds its chunk's rows (partial grad summed over tp),
    # the table on the first pipeline stage only; tied embeddings as GPT's
    assert launched("gpt architecture").count("OK dp=") == 4


def test_zero_two_and_three_in_every_layout_family(launched):
    """ZeRO-2 (sliced gradients) and ZeRO-3 (units gathered around forward and backward) over dp, dp x tp (SP
    norm weights stay whole), dp x pp, dp x cp, GPipe and 1F1B, with tied embeddings across stages and inside
    one; every freed storage is filled with NaN first (check_fidelity.py), so a read after a free fails."""
    out = launched("zero 2 and 3")
    assert out.count("OK dp=") == 12 and out.count("zero=3") == 8


def test_zero_three_interleaved_recomputed_and_kept_across_micro_batches(launched):
    """Interleaved 1F1B with recomputation (a block re-runs its forward inside backward: it stays gathered),
    4 micro-batches, resharding on and off, prefetch 0 and 2; then LoRA adapters sharded, the base frozen."""
    for name in ("zero 3 interleaved, prefetch 0", "zero 3 interleaved, kept, prefetch 2"):
        assert launched(name).count("OK dp=") == 2
    assert launched("zero 3 lora").count("LORA OK") == 3  # the one-process reference, and each layout


def test_zero_three_on_the_full_grid(launched):
    assert launched("8-rank zero 3").count("OK dp=") == 3


def test_zero_bubble_in_every_layout_family(launched):
    """zb-h1 and zb-v against one process: dp x pp with ZeRO-1/2/3, tp x pp with SP, cp x pp, ep x pp, 4
    micro-batches (zb-h1 defers rank 1's Ws by one backward; ZeRO-3 releases a unit once its B has passed it;
    every freed storage is NaN first, so a read after a free shows); LoRA x pp (the frozen base has no W; its
    weights stay bit-identical); 8 ranks dp x tp x pp; pp = 4 with zb-v's refined order of 8 micro-batches."""
    out = launched("zero bubble, every layout family")
    assert out.count("OK dp=") == 8 and out.count("zb-v2") == 4 and out.count("zero=3") == 2 and "ep=2" in out
    out = launched("zero bubble, lora")
    assert out.count("OK dp=") == 2 and out.count("LORA OK") == 3
    assert launched("8-rank zero bubble").count("OK dp=") == 2
    assert launched("zero bubble, pp=4").count("OK dp=1 tp=1 pp=4 zb-v2") == 1
