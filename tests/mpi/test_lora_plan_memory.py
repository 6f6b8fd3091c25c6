"""The planner's LoRA memory (hpctrain/plan/lora.py, memory.lora_state_bytes) against the engine: the model
state a LoRA run keeps per rank between steps (metrics.jsonl ``model_state_bytes``: the frozen base, the
adapters, their gradients and AdamW state) equals the planner's, byte for byte, in float32 and bfloat16, at
zero 0 (dp), 1 and 3 (dp x tp: column and row targets split over tp, the factors partial over tp kept whole),
and 3 over dp x pp with a tied embedding (frozen: sharded on both stages)."""
import json

import pytest

from mpirun import run_mpi
from hpctrain.config import load_config, resolve_model
from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Options
from hpctrain.plan.devices import DTYPE_BYTES
from hpctrain.plan.lora import unit_adapter_parameters
from hpctrain.plan.memory import gathered_parameters, state_bytes, zero3_units
from hpctrain.plan.shapes import for_tp
from hpctrain.plan.stages import in_flight, stages


def planned_kept(overrides: list[str], ranks: int, rank: int) -> dict[str, int]:
    """The planner's state on world rank ``rank``'s stage, less what it holds only during a step at zero 3 (the
    gathered units and one unit's full gradient): what the engine keeps between steps."""
    cfg = load_config(None, overrides)
    lay = Layout.from_config(cfg, ranks)
    t, lora = lay.tp_size, cfg.lora
    model = for_tp(resolve_model(cfg.model), t)
    options = Options(dtype=cfg.train.dtype, lora_rank=lora.rank, lora_targets=tuple(lora.targets))
    stage = stages(model, lay)[rank // t % lay.pp_size]  # the grid's order: tp fastest, then pp (cp 1)
    params, grads, optimizer = state_bytes(model, stage, lay, options)
    if lay.zero == 3:
        nb, gb = DTYPE_BYTES[cfg.train.dtype], max(4, DTYPE_BYTES[cfg.train.dtype])
        unit = unit_adapter_parameters(model, t, lora.rank, lora.targets)
        held = in_flight(lay, stage, 1) > 1
        gathered = gathered_parameters(zero3_units(model, stage, lay, 1, None, unit, frozen=True), 1, True, held)
        params, grads = params - gathered * nb, grads - unit * gb
    return {"params": int(params), "grads": int(grads), "optimizer": int(optimizer)}


@pytest.mark.parametrize("ranks, overrides", [
    (2, ["parallel.zero=0", "train.dtype=float32"]),
    (4, ["parallel.zero=1", "parallel.tp=2", "train.dtype=float32"]),
    (4, ["parallel.zero=3", "parallel.tp=2", "train.dtype=bfloat16"]),
    (4, ["parallel.zero=3", "parallel.pp=2", "parallel.microbatches=2", "model.tie_embeddings=true",
         "train.dtype=float32"]),
], ids=["zero0-dp2", "zero1-dp2-tp2", "zero3-dp2-tp2-bf16", "zero3-dp2-pp2-tied"])
def test_the_planned_lora_state_is_what_the_engine_keeps(tmp_path, ranks, overrides):
    overrides = overrides + ["lora.rank=8", "lora.targets=[q,v,o,down]"]
    run_mpi(ranks, "hpctrain.cli", "train", f"train.run_dir={tmp_path}", "train.steps=1", "train.progress=false",
            *overrides, module=True, timeout=120)
    record = next(r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "model_state_bytes" in r)
    measured = record["model_state_bytes"]  # of the rank with the highest peak
    assert measured == planned_kept(overrides, ranks, record["peak_memory_rank"]), (measured, record["peak_memory_rank"])
