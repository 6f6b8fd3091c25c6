"""``model.residual_dtype = "float32"`` in bfloat16 on 4 ranks: dp x tp with sequence parallelism (the
all-gathers and reduce-scatters act on the sublayers' bfloat16 inputs and outputs), dp x pp (the pipeline's
activation buffers are float32: a bfloat16 buffer stops the run with MPI's "message truncated") and dp x cp
(ring attention), with ZeRO-1, tied embeddings and recomputation, each against a one-process run of the
same config. One launch (tests/mpi/scripts/check_fidelity.py); the one-process checks: tests/unit/test_residual_dtype.py.

Tolerance: relative 1e-2 on every step's loss. The runs are not equal in bfloat16: tp reduces partial
sums of bfloat16 outputs, the layouts accumulate 2 micro-batches where the reference takes 1, so each
weight may round differently (bfloat16: 8 bits of mantissa, up to 2^-9 = 0.2% per value); measured over 4
steps: 1.1e-3 (tp), 1.7e-4 (pp), 1.3e-3 (cp). A layout that computes something else (a missed reduction,
a shifted stage) is off by far more. Parameters are not compared: AdamW turns a gradient's rounding noise
near zero into a full-size step of either sign, so single weights differ by up to lr per step.
"""
from test_fidelity import fidelity


def test_bfloat16_with_a_float32_residual_matches_one_process_with_tp_sp_pp_cp():
    out = fidelity(4, "2,2,1;2,1,2;2,1,1,2", "1f1b,sp,zero1", "--dtype", "bfloat16", "--rtol", "1e-2", "--steps", "4",
                   "model.residual_dtype=float32", "model.tie_embeddings=true", "train.recompute=true")
    assert out.count("OK dp=") == 3 and "cp=2" in out
