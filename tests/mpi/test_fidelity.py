"""Every parallel layout trains like one process (float64: relative error <= 1e-10; float32: 1e-5 on losses).

The default suite runs a representative subset; the full matrix (every layout x both schedules x
sequence parallel on/off x ZeRO-1 on/off, tied embeddings) runs with:

    .venv/bin/python -m pytest tests -m full_matrix -v
"""
import pytest

from mpirun import run_mpi

F64 = ["--param-rtol", "1e-10", "--rtol", "1e-10"]


def fidelity(nprocs, layouts, variants, *extra, timeout=400):
    result = run_mpi(nprocs, "check_fidelity.py", "--layouts", layouts, "--variants", variants, *extra,
                     timeout=timeout)
    assert "FIDELITY OK" in result.stdout
    return result.stdout


def test_two_ranks_every_axis_every_variant():
    out = fidelity(2, "2,1,1;1,2,1;1,1,2", "all", *F64)
    assert out.count("OK dp=") == 24


def test_four_ranks_every_layout():
    out = fidelity(4, "2,2,1;2,1,2;1,2,2;4,1,1;1,4,1;1,1,4", "1f1b,sp,zero1/gpipe", *F64)
    assert out.count("OK dp=") == 12


def test_eight_ranks_full_grid_deep_pipelines_and_tied_embeddings():
    # (1,2,4) sends temporaries with isend: it caught buffers freed before their send completed
    out = fidelity(8, "2,2,2;1,2,4;1,4,2", "1f1b,sp,zero1/gpipe", *F64, "model.tie_embeddings=true")
    assert out.count("OK dp=") == 6


@pytest.mark.parametrize("tied, layouts, variants", [
    ("false", "1,4,1;2,2,1;1,2,2;2,1,2", "1f1b,sp/zero1"),
    ("true", "1,2,2;1,4,1;2,1,2", "sp,zero1/gpipe"),  # tied across pp stages, and inside one stage
])
def test_an_odd_vocabulary_in_every_layout_family(tied, layouts, variants):
    """257 tokens: padded to 384 rows at tp=1 (the reference), 512 at tp=2 (rank 1 holds 1 real row) and
    tp=4 (rank 3 none); the padding rows stay exactly zero (checked by the script)."""
    out = fidelity(4, layouts, variants, *F64, "model.vocab_size=257", f"model.tie_embeddings={tied}")
    assert out.count("OK dp=") == 2 * len(layouts.split(";"))


def test_float32_losses_match():
    fidelity(4, "1,2,2;2,1,2", "1f1b,sp", "--dtype", "float32", "--rtol", "1e-5")


def test_microbatches_fewer_than_stages_with_recomputation():
    fidelity(4, "1,1,4;1,2,2", "1f1b/gpipe,sp", *F64, "parallel.microbatches=1", "train.recompute=true")


def test_interleaved_two_stages_steady_state_three_chunks_and_explicit_virtual_stages():
    """pp=2 with 4 micro-batches (warm-up, steady 1F1B and cool-down), V = 2 and 3, tied embeddings
    (original on rank 0 chunk 0, copy on rank 1 chunk V-1); then a hand-given split of 4 virtual stages."""
    out = fidelity(2, "1,1,2", "interleaved2/interleaved3", *F64, "model.n_layers=6", "parallel.microbatches=4",
                   "model.tie_embeddings=true")
    assert out.count("OK dp=") == 2 and "interleaved3" in out
    out = fidelity(2, "1,1,2", "interleaved2,zero1", *F64, "model.n_layers=6", "parallel.microbatches=4",
                   "parallel.stage_layers=[1,2,2,1]")
    assert out.count("OK dp=") == 1


def test_interleaved_with_tp_sp_zero1_dp_and_four_stages():
    """micro-batches == pp (every rank warms up fully, as Megatron), with tp + SP + ZeRO-1, dp, tied
    embeddings; then pp=4 x V=2 over 8 layers with 4 and 8 micro-batches."""
    out = fidelity(4, "1,2,2;2,1,2", "interleaved2,sp,zero1/interleaved2", *F64, "model.tie_embeddings=true")
    assert out.count("OK dp=") == 4
    for microbatches in (4, 8):
        out = fidelity(4, "1,1,4", "interleaved2,zero1", *F64, "model.n_layers=8", "model.tie_embeddings=true",
                       f"parallel.microbatches={microbatches}")
        assert out.count("OK dp=") == 1


def test_interleaved_eight_ranks_full_grid():
    out = fidelity(8, "2,2,2", "interleaved2,sp,zero1", *F64, "model.tie_embeddings=true",
                   "parallel.microbatches=4", "train.global_batch=16")
    assert out.count("OK dp=") == 1


@pytest.mark.full_matrix
@pytest.mark.parametrize("nprocs,layouts", [
    (2, "2,1,1;1,2,1;1,1,2"),
    (4, "2,2,1;2,1,2;1,2,2;4,1,1;1,4,1;1,1,4"),
    (8, "2,2,2;1,2,4;1,4,2"),
])
@pytest.mark.parametrize("tied", ["false", "true"])
def test_full_matrix(nprocs, layouts, tied):
    fidelity(nprocs, layouts, "all", *F64, f"model.tie_embeddings={tied}", timeout=1200)


def test_gpt_architecture_gelu_mlp_and_learned_positions_in_every_layout_family():
    # learned positions: replicated over tp, each SP rank adds its chunk's rows (partial grad summed over tp),
    # the table on the first pipeline stage only; tied embeddings as GPT's
    out = fidelity(4, "2,2,1;1,2,2", "1f1b/sp,zero1", *F64, "model.mlp=gelu", "model.positions=learned",
                   "model.tie_embeddings=true")
    assert out.count("OK dp=") == 4


def test_zero_two_and_three_in_every_layout_family():
    """ZeRO-2 (sliced gradients) and ZeRO-3 (units gathered around forward and backward) over dp, dp x tp (SP
    norm weights stay whole), dp x pp, dp x cp, GPipe and 1F1B, with tied embeddings across stages and inside
    one; every freed storage is filled with NaN first (check_fidelity.py), so a read after a free fails."""
    out = fidelity(4, "4,1,1;2,2,1;2,1,2;2,1,1,2", "1f1b,sp,zero2/1f1b,sp,zero3/gpipe,zero3", *F64,
                   "model.tie_embeddings=true")
    assert out.count("OK dp=") == 12 and out.count("zero=3") == 8


def test_zero_three_interleaved_recomputed_and_kept_across_micro_batches():
    """Interleaved 1F1B with recomputation (a block re-runs its forward inside backward: it stays gathered),
    4 micro-batches, resharding on and off, prefetch 0 and 2; then LoRA adapters sharded, the base frozen."""
    for extra in (["parallel.zero_prefetch=0"], ["parallel.zero_reshard_after_forward=false", "parallel.zero_prefetch=2"]):
        out = fidelity(4, "2,1,2", "interleaved2,zero3/1f1b,sp,zero3", *F64, "parallel.microbatches=4",
                       "train.recompute=true", "model.tie_embeddings=true", *extra)
        assert out.count("OK dp=") == 2
    out = fidelity(4, "2,2,1;2,1,2", "1f1b,zero3", *F64, "lora.rank=4")
    assert out.count("LORA OK") == 3  # the one-process reference, and each layout


def test_zero_three_on_the_full_grid():
    out = fidelity(8, "2,2,2", "1f1b,sp,zero3/interleaved2,zero3/gpipe,zero2", *F64, "model.tie_embeddings=true")
    assert out.count("OK dp=") == 3
