"""The performance model against Megatron-LM's PTD-P weak-scaling table (Narayanan et al., SC21, Table 1).

``python -m hpctrain.plan.ptdp`` prints the side-by-side table of docs/scaling.md: for each published
row, the model's TFLOP/s per GPU on the paper's own layout, and the layout ``hpctrain plan`` picks when
restricted to what Megatron-LM had then (no ZeRO, no sequence parallelism, full recomputation).

Layouts, batch sizes and virtual stages: NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh``; published
TFLOP/s per GPU: the paper's Table 1. Machine: Selene, DGX A100 80 GB nodes of 8 GPUs, NVSwitch (2400
Gbit/s per GPU), 8 HDR InfiniBand NICs per node (200 Gbit/s per GPU). Megatron's attention then was
unfused (full score matrix, no causal skipping) and it scattered/gathered stage-boundary tensors over tp.
Model shapes: the paper's (GELU MLP of 4 d, learned positions, tied embeddings, vocabulary 51200), built
here (``SHAPES``) so that the table does not depend on how the ``gpt-*`` presets are spelled. This table
is the CALIBRATION set of the ``a100`` preset (devices.py); ``published.py`` holds the runs it is
checked on without tuning.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.layout import Layout
from hpctrain.plan.cost import Options
from hpctrain.plan.devices import device_preset
from hpctrain.plan.machine import Machine, links_from_bandwidth
from hpctrain.plan.planner import SearchSpace, plan, predict
from hpctrain.plan.shapes import gpt_shape


@dataclass(frozen=True)
class PtdpRow:
    preset: str
    tp: int
    pp: int
    micro_batch: int
    global_batch: int
    gpus: int
    virtual_stages: int
    published_tflops: float


TABLE_1 = (
    PtdpRow("gpt-1.7b", 1, 1, 16, 512, 32, 1, 137), PtdpRow("gpt-3.6b", 2, 1, 16, 512, 64, 1, 138),
    PtdpRow("gpt-7.5b", 4, 1, 16, 512, 128, 1, 142), PtdpRow("gpt-18b", 8, 1, 8, 1024, 256, 1, 135),
    PtdpRow("gpt-39b", 8, 2, 4, 1536, 512, 1, 138), PtdpRow("gpt-76b", 8, 4, 2, 1792, 1024, 3, 140),
    PtdpRow("gpt-145b", 8, 8, 2, 2304, 1536, 2, 148), PtdpRow("gpt-310b", 8, 16, 1, 2160, 1920, 2, 155),
    PtdpRow("gpt-530b", 8, 35, 1, 2520, 2520, 3, 163), PtdpRow("gpt-1t", 8, 64, 1, 3072, 3072, 1, 163),
)
SEQ_LEN = 2048
MEGATRON_2021 = SearchSpace(cp=1, zero=(0,), sequence_parallel=(False,), recompute=("full",))
# (d_model, n_layers, n_heads) of Table 1; vocabulary 51200 (GPT-2's BPE padded by Megatron)
SHAPES = {"gpt-1.7b": (2304, 24, 24), "gpt-3.6b": (3072, 30, 32), "gpt-7.5b": (4096, 36, 32),
          "gpt-18b": (6144, 40, 48), "gpt-39b": (8192, 48, 64), "gpt-76b": (10240, 60, 80),
          "gpt-145b": (12288, 80, 96), "gpt-310b": (16384, 96, 128), "gpt-530b": (20480, 105, 128),
          "gpt-1t": (25600, 128, 160)}


def shape(row: PtdpRow):
    return gpt_shape(*SHAPES[row.preset], vocab_size=51200, seq_len=SEQ_LEN)


def selene(gpus: int) -> Machine:
    return Machine(device_preset("a100"), links_from_bandwidth(2400, 200), gpus // 8, 8)


def options(row: PtdpRow) -> Options:
    return Options(flash_attention=False, virtual_stages=row.virtual_stages, pp_scatter_gather=True,
                   megatron_activations=True)


def predict_row(row: PtdpRow):
    """The model's Prediction for the paper's own layout of ``row``."""
    model = shape(row)
    dp = row.gpus // (row.tp * row.pp)
    layout = Layout(row.gpus, dp, row.pp, row.tp, row.global_batch // dp // row.micro_batch, row.global_batch,
                    SEQ_LEN)
    return predict(model, layout, selene(row.gpus), recompute="full", options=options(row))


def plan_row(row: PtdpRow, space: SearchSpace = MEGATRON_2021):
    """``hpctrain plan``'s ranking for ``row``'s model, GPUs and batch (PlanResult)."""
    return plan(shape(row), selene(row.gpus), row.global_batch, SEQ_LEN, options(row), space)


def main() -> None:
    print("| model | GPUs | paper tp x pp | published TFLOP/s | predicted | error | plan picks (tp x pp) "
          "| its TFLOP/s | paper's layout vs best |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in TABLE_1:
        mine = predict_row(row).tflops_per_device
        best = plan_row(row).plans[0]
        lay = best.candidate.layout
        print(f"| {row.preset} | {row.gpus} | {row.tp} x {row.pp} | {row.published_tflops:.0f} | {mine:.0f} | "
              f"{mine / row.published_tflops - 1:+.1%} | {lay.tp_size} x {lay.pp_size} | "
              f"{best.tflops_per_device:.0f} | {mine / best.tflops_per_device - 1:+.1%} |")


if __name__ == "__main__":
    main()
