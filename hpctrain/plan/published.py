"""Published large-model training runs with known layouts: the planner's calibration and held-out sets.

Each ``Run`` is one reported measurement: the model's shape, the machine, the layout (tp, pp, dp,
micro-batch, virtual stages, recomputation, sequence parallelism, ZeRO-1 / distributed optimizer or
ZeRO-3 / FSDP, evaluated as hpctrain's engine would run it: ``zero=3`` with its
``zero_reshard_after_forward``), the attention kernel, and the reported throughput per GPU in the
source's own convention (``metric``):

- ``"hfu"``: Megatron-LM's executed FLOPs (Narayanan et al. 2021 eq. 3; full attention square, padded
  vocabulary, the recomputed forward included): PTD-P's and MT-NLG's "TFLOP/s per GPU";
- ``"mfu"``: the same count without recomputation (Korthikanti et al. 2022's model FLOPs); a published
  MFU is stored as MFU x the dense bf16 peak (312 A100, 989 H100). Llama 3 and Nemotron-4 report MFU /
  TFLOP/s with this count up to the attention convention (a few percent at their sequence lengths).

``calibration=True`` rows tuned the device presets (devices.py); every other row is HELD OUT: no
constant was fitted to it. Where a source leaves a layout detail out, ``assumed`` says what this table
takes and why. One rule for the virtual stages no source states: Megatron-LM / NeMo runs since 2022
(Korthikanti, Nemotron, Llama 3's Megatron-style schedule) interleave one layer per virtual stage (V =
layers / pp, as run_table_1.sh does for 530B); DeepSpeed's pipeline (MT-NLG, BLOOM) has no interleaving. ``python -m hpctrain.plan.validate`` (or ``hpctrain plan --validate published``) prints
the comparison; tests/unit/test_plan_published.py asserts its error and the published layout's rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan.shapes import Shape, gpt_shape

SELENE = (2400.0, 200.0)  # DGX A100: NVSwitch 2400 Gbit/s per GPU; 8 HDR InfiniBand NICs per node (200 per GPU)
JEAN_ZAY = (800.0, 50.0)  # BLOOM: 4 NVLink inter-GPU connects, 4 Omni-Path 100 Gbit/s links per 8-GPU node
DGX_H100 = (3600.0, 400.0)  # NVLink 4 (450 GB/s per direction); 8 ConnectX-7 400 Gbit/s per node
META_RSC = (3600.0, 400.0)  # Grand Teton H100 servers, NVLink inside, RoCE 400 Gbit/s per GPU (Llama 3 §3.3.1)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: Shape
    device: str
    gpus: int
    links: tuple[float, float]  # (intra, inter) Gbit/s per GPU
    seq_len: int
    global_batch: int
    tp: int
    pp: int
    micro_batch: int
    virtual_stages: int
    recompute: str  # "off", "selective", "full"
    sequence_parallel: bool
    zero: int
    attention: str  # "fused" (flash-style) or "unfused" (Megatron's 2021-22 softmax over the full square)
    scatter_gather: bool  # Megatron-LM's scatter/gather of stage-boundary tensors over tp
    metric: str  # "hfu" or "mfu" (module docstring)
    published_tflops: float
    calibration: bool = False
    assumed: str = ""
    zero_reshard_after_forward: bool = True  # zero 3: parallel.zero_reshard_after_forward

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


GPT3_175B = gpt_shape(12288, 96, 96, 51200)
MT_NLG_530B = gpt_shape(20480, 105, 128, 50257)
GPT_530B = gpt_shape(20480, 105, 128, 51200)
GPT_1T = gpt_shape(25600, 128, 160, 51200)
GPT_22B = gpt_shape(6144, 48, 64, 51200)
BLOOM_176B = Shape(250880, 14336, 70, 112, 112, 4 * 14336, 2048, True, "gelu", "alibi")
NEMOTRON4_340B = Shape(256000, 18432, 96, 96, 8, 73728, 4096, False, "relu2", "rope")
LLAMA3_405B = Shape(128256, 16384, 126, 128, 8, 53248, 8192, False, "swiglu", "rope")

KORTHIKANTI = "Korthikanti et al. 2022 (MLSys 2023), Tables 3 and 5; Megatron-LM README MFU/HFU table"
KORTHIKANTI_2240 = "Korthikanti et al. 2022 (MLSys 2023), abstract and section 6 (530B on 2240 A100)"
MT_NLG = "Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', section 2.4"
BLOOM = ("BigScience 2022, BLOOM paper (arXiv 2211.05100) section 3.4 and 'The Technology Behind BLOOM "
         "Training' (Bekman, Hugging Face blog): tp 4, pp 12, dp 8, micro-batch 2, batch 2048, ~150 TFLOP/s")
NEMOTRON = "NVIDIA 2024, Nemotron-4 340B Technical Report, Table 2 (batch ramp, iteration time, MFU)"
LLAMA3 = "Llama Team, Meta 2024, 'The Llama 3 Herd of Models', Table 4 (405B, 8K sequence, 16M-token batch)"
LLAMA3_FSDP = "Dubey et al. 2024, 'The Llama 3 Herd of Models', section 3.3.2: DP is FSDP"

RUNS: tuple[Run, ...] = (
    # calibration (with PTD-P Table 1, ptdp.py): selective recomputation + SP on A100, one H100 run
    Run("gpt-22b korthikanti", KORTHIKANTI, GPT_22B, "a100", 8, SELENE, 2048, 4, 8, 1, 4, 1, "selective",
        True, 0, "unfused", False, "mfu", 0.415 * 312, calibration=True),
    Run("gpt3-175b korthikanti", KORTHIKANTI, GPT3_175B, "a100", 64, SELENE, 2048, 64, 8, 8, 1, 12, "selective",
        True, 0, "unfused", False, "mfu", 0.514 * 312, calibration=True, assumed="V=12 (one layer per virtual stage)"),
    Run("nemotron4-340b 1536", NEMOTRON, NEMOTRON4_340B, "h100", 1536, DGX_H100, 4096, 768, 8, 12, 1, 8, "off",
        True, 1, "fused", False, "mfu", 0.424 * 989, calibration=True,
        assumed="V=8 (one layer per virtual stage, NeMo's habit), no recomputation, distributed optimizer"),
    # held out
    Run("gpt-530b korthikanti", KORTHIKANTI, GPT_530B, "a100", 280, SELENE, 2048, 280, 8, 35, 1, 3, "selective",
        True, 0, "unfused", False, "mfu", 0.560 * 312, assumed="V=3 (one layer per virtual stage)"),
    Run("gpt-1t korthikanti", KORTHIKANTI, GPT_1T, "a100", 512, SELENE, 2048, 512, 8, 64, 1, 2, "selective",
        True, 0, "unfused", False, "mfu", 0.563 * 312, assumed="V=2 (one layer per virtual stage)"),
    Run("gpt-530b 2240 selective", KORTHIKANTI_2240, GPT_530B, "a100", 2240, SELENE, 2048, 2240, 8, 35, 1, 3,
        "selective", True, 0, "unfused", False, "mfu", 0.542 * 312,
        assumed="batch 2240 (= GPUs, as in the paper's Table 3 runs; V=3 needs micro-batches a multiple of pp); "
                "V=3 (one layer per virtual stage)"),
    Run("gpt-530b 2240 full", KORTHIKANTI_2240, GPT_530B, "a100", 2240, SELENE, 2048, 2240, 8, 35, 1, 3,
        "full", False, 0, "unfused", True, "mfu", 0.421 * 312, assumed="as the selective row"),
    Run("mt-nlg-530b 2240", MT_NLG, MT_NLG_530B, "a100", 2240, SELENE, 2048, 1920, 8, 35, 1, 1, "full",
        False, 1, "unfused", False, "hfu", 126.0, assumed="DeepSpeed pipeline (no interleaving), ZeRO-1"),
    Run("mt-nlg-530b 2800", MT_NLG, MT_NLG_530B, "a100", 2800, SELENE, 2048, 1920, 8, 35, 1, 1, "full",
        False, 1, "unfused", False, "hfu", 121.0, assumed="as 2240"),
    Run("mt-nlg-530b 3360", MT_NLG, MT_NLG_530B, "a100", 3360, SELENE, 2048, 1920, 8, 35, 1, 1, "full",
        False, 1, "unfused", False, "hfu", 113.0, assumed="as 2240"),
    Run("bloom-176b 384", BLOOM, BLOOM_176B, "a100", 384, JEAN_ZAY, 2048, 2048, 4, 12, 2, 1, "full",
        False, 1, "unfused", False, "hfu", 150.0, assumed="DeepSpeed pipeline, ZeRO-1; links from the blog"),
    Run("nemotron4-340b 3072", NEMOTRON, NEMOTRON4_340B, "h100", 3072, DGX_H100, 4096, 1536, 8, 12, 1, 8, "off",
        True, 1, "fused", False, "mfu", 0.423 * 989, assumed="as 1536"),
    Run("nemotron4-340b 6144", NEMOTRON, NEMOTRON4_340B, "h100", 6144, DGX_H100, 4096, 2304, 8, 12, 1, 8, "off",
        True, 1, "fused", False, "mfu", 0.410 * 989, assumed="as 1536"),
    Run("llama3-405b 8192", LLAMA3, LLAMA3_405B, "h100", 8192, META_RSC, 8192, 2048, 8, 16, 1, 8, "selective",
        True, 3, "fused", False, "mfu", 430.0,
        assumed="V=8 (one layer per virtual stage: the paper drops one layer from the first and last stages); "
                "zero=3: FSDP, which 'shards the model, optimizer, and gradients' but does 'not reshard after "
                "forward computation' (" + LLAMA3_FSDP + "): hpctrain's zero 3 with "
                "zero_reshard_after_forward=false (each unit gathered once per step, gradients reduce-scattered "
                "every micro-batch); selective recomputation (no scores with a fused kernel)",
        zero_reshard_after_forward=False),
    Run("llama3-405b 16384", LLAMA3, LLAMA3_405B, "h100", 16384, META_RSC, 8192, 2048, 8, 16, 1, 8, "selective",
        True, 3, "fused", False, "mfu", 400.0, assumed="as 8192 (FSDP: zero=3, no resharding after forward)",
        zero_reshard_after_forward=False),
)
