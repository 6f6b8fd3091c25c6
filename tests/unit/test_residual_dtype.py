"""``model.residual_dtype = "float32"`` (Megatron's --fp32-residual-connection): a bfloat16 model whose residual
stream (the embedding's output, what every block takes and returns, the pipeline's activation buffers, the final
norm's input) is float32 while every sublayer computes in bfloat16 (the norms' outputs, q/k/v and their rotary
tables, the logits); float32/float64 models are never narrowed. One process (the 2- and 4-rank layouts:
tests/mpi/test_residual_layouts.py)."""
import math

import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config, resolve_model
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.models.gpt import GPTStage, residual_dtype
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer

BASE = ["data.source=builtin", "data.max_bytes=60000", "train.seq_len=16", "train.global_batch=4",
        "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
        "train.warmup_steps=1", "train.lr=1e-2", "data.valid_fraction=0.1", "train.eval_steps=1"]


@pytest.fixture(scope="module")
def tokens():
    return load_tokens_collective(None, "builtin", None, 60000)


def forward_dtypes(stage: GPTStage, ids: torch.Tensor) -> dict:
    """{what: set of dtypes} seen in one forward of ``stage``: block inputs/outputs, the norms' outputs (the
    sublayers' inputs), the logits."""
    seen: dict = {"block in": set(), "block out": set(), "norm out": set()}

    def block(_, args, out) -> None:
        seen["block in"].add(args[0].dtype)
        seen["block out"].add(out.dtype)

    def norm(_, args, out) -> None:
        seen["norm out"].add(out.dtype)
    hooks = [b.register_forward_hook(block) for b in stage.layers.values()]
    hooks += [m.register_forward_hook(norm) for name, m in stage.named_modules() if name.endswith("norm")]
    seen["logits"] = stage(ids).dtype
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_blocks_carry_a_float32_residual_and_compute_in_bfloat16(positions):
    m = resolve_model(load_config(None, BASE + ["model.residual_dtype=float32", f"model.positions={positions}"]).model)
    stage = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (2, 16))
    seen = forward_dtypes(stage, ids)
    assert seen == {"block in": {torch.float32}, "block out": {torch.float32}, "norm out": {torch.bfloat16},
                    "logits": torch.bfloat16}, seen
    x = torch.zeros(16, 2, 32, dtype=torch.float32)
    tables = stage._rotary_tables(x, None)  # built once per forward from the (float32) hidden state
    assert positions == "learned" or {t.dtype for t in tables} == {torch.bfloat16}
    auto = GPTStage(resolve_model(load_config(None, BASE + [f"model.positions={positions}"]).model), (0, m.n_layers),
                    is_first=True, is_last=True, dtype=torch.bfloat16)
    assert forward_dtypes(auto, ids)["block out"] == {torch.bfloat16}  # the default: bfloat16 throughout


def test_float32_and_float64_models_are_never_narrowed():
    m = load_config(None, BASE + ["model.residual_dtype=float32"]).model
    assert residual_dtype(m, torch.float64) == torch.float64 and residual_dtype(m, torch.float32) == torch.float32
    assert residual_dtype(m, torch.float16) == torch.float32 and residual_dtype(m, torch.bfloat16) == torch.float32
    assert residual_dtype(load_config(None, BASE).model, torch.bfloat16) == torch.bfloat16


def train(tokens, steps: int, *overrides):
    cfg = load_config(None, BASE + list(overrides))
    grid = ProcessGrid.from_config(cfg, discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=60)
    try:
        trainer = Trainer(cfg, grid, tokens=tokens)
        losses = [trainer.train_step().loss for _ in range(steps)]
        return trainer.parts.executor.act_dtype, losses, trainer.evaluate()
    finally:
        grid.close()


def test_bfloat16_with_a_float32_residual_trains_like_float32(tokens):
    act32, ref, ref_eval = train(tokens, 6, "train.dtype=float32")
    act, losses, valid = train(tokens, 6, "train.dtype=bfloat16", "model.residual_dtype=float32")
    assert act32 == torch.float32 and act == torch.float32  # the pipeline's activation buffers
    assert all(math.isfinite(v) for v in losses + [valid]), losses
    # bfloat16 weights and sublayers: within 1% of float32 (measured: 0.05% at most over these 6 steps, 0.04% on
    # the validation loss; bfloat16 keeps 8 bits of mantissa, a rounding of 0.4% at most per value);
    # the loss fell by over 1.5 nats, so a run that does not train fails
    worst = max(abs(a - b) / b for a, b in zip(losses, ref))
    assert worst < 1e-2 and abs(valid - ref_eval) / ref_eval < 1e-2, (losses, ref, valid, ref_eval)
    assert losses[-1] < losses[0] - 1.0, losses
    assert train(tokens, 1, "train.dtype=bfloat16")[0] == torch.bfloat16  # auto: the training dtype
