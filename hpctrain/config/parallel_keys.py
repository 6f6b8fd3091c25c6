"""The keys of the parallel layout and its communication: ``[parallel]``, ``[comm]``, ``[compression]``."""
from dataclasses import dataclass

from hpctrain.config.keys import COUNT_MAX, SIZE_MAX, key


@dataclass
class ParallelConfig:
    """Process grid and communication settings."""
    dp: int = key(0, min=0, help=(
        "Data-parallel replicas. 0 = world size / (tp x pp x cp); otherwise dp x pp x cp x tp must equal the "
        "number of ranks."))
    tp: int = key(1, min=1, help=(
        "Tensor-parallel ranks per layer (heads, MLP and vocabulary split; Megatron style). Keep it within a node."))
    pp: int = key(1, min=1, help="Pipeline stages (consecutive layers per stage).")
    cp: int = key(1, min=1, help=(
        "Context parallelism: ranks sharing each sequence. Each holds 2 of the 2 x cp stripes of it (stripe i and "
        "2cp-1-i, so causal work is even) and attention is a ring: K/V blocks pass around the cp group while "
        "blocks compute. train.seq_len must be divisible by 2 x cp. Gradients are summed and ZeRO-1 shards over dp "
        "x cp. Placed inside a node with tp when cp x tp fits."))
    schedule: str = key("1f1b", choices=("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"), help=(
        "Pipeline schedule: `gpipe` (all forwards, then all backwards), `1f1b` (same bubble, at most pp - s "
        "micro-batches of activations held on stage s), `interleaved` (Megatron's interleaved 1F1B over "
        "`virtual_stages` virtual stages per rank: the bubble divided by V; needs pp >= 2 and microbatches a "
        "multiple of pp), or the zero-bubble schedules (Qi et al. 2024), whose backward is split into B (input "
        "gradient) and W (weight gradients, deferred into the bubbles): `zb-h1` (1F1B's memory, about a third "
        "of its bubble) and `zb-v` (`virtual_stages = 2` in a V shape: rank r holds virtual stages r and "
        "2 pp - 1 - r); both need pp >= 2 and microbatches >= pp."))
    virtual_stages: int = key(1, min=1, max=COUNT_MAX, help=(
        "Virtual stages per pp rank (V). With `schedule = \"interleaved\"`: >= 2, and pp x V <= n_layers; rank r "
        "holds virtual stages r, pp + r, 2 pp + r, ... (Megatron's `--num-layers-per-virtual-pipeline-stage`, "
        "counted in virtual stages). 2 with zb-v (virtual stages r and 2 pp - 1 - r); 1 with gpipe, 1f1b and "
        "zb-h1."))
    microbatches: int = key(1, min=1, max=SIZE_MAX, help=(
        "Micro-batches per replica per step: the replica batch (global_batch / dp) is split into this many; "
        "gradients accumulate over them. The pipeline bubble is (pp - 1) / (virtual_stages x microbatches) of the "
        "ideal step. With `train.micro_batch_size` > 0 it is derived (global_batch / (dp x micro_batch_size)): "
        "leave it at 1 or give the same number."))
    sequence_parallel: bool = key(False, help=(
        "Split the activations between TP layers along the sequence over tp (norms run on S/tp tokens; all-reduce "
        "becomes reduce-scatter + all-gather). Needs `train.seq_len` divisible by tp."))
    zero: int = key(0, choices=(0, 1, 2, 3), help=(
        "ZeRO stage over the replica group (dp x cp). 1: each rank keeps optimizer state (and fp32 masters) for "
        "1/dp of the parameters; gradients are reduce-scattered and updated parameters all-gathered. 2: also the "
        "gradients: each micro-batch's are reduce-scattered bucket by bucket during backward into this rank's "
        "slice and the full bucket is freed. 3: also the parameters: a rank keeps only its slice of each unit "
        "(the embedding, each transformer block, the final norm and head; of its tp slab and pipeline stage); a "
        "unit is all-gathered before it runs and freed after (`zero_reshard_after_forward`), the next "
        "`zero_prefetch` units' gathers posted ahead. Parameters whose gradient is first summed over another "
        "group (sequence-parallel norm weights, LoRA factors with tp > 1, a tied embedding split over pp) stay "
        "whole; a LoRA run's frozen base is sharded and gathered like the rest. 0 = off. Compression needs "
        "zero <= 1. With expert parallelism (`parallel.ep` > 1) the experts are sharded over their replicas (the "
        "dp x cp / ep ranks holding the same experts; at 3 a block's experts are gathered over them with its unit). "
        "At every stage the model is built on the meta device and each rank creates only the parameter bytes it "
        "keeps (docs/parallelism.md, \"Parameters born sharded\")."))
    zero_reshard_after_forward: bool = key(True, help=(
        "ZeRO-3: free a unit's gathered parameters after each forward and gather them again for its backward "
        "(2 all-gathers per unit and micro-batch, the least memory; the final norm + LM head's unit stays "
        "gathered from its forward to its backward). false: a unit stays gathered from its first forward to its last "
        "backward of the step (1 all-gather per unit and step; every unit of the stage gathered at once)."))
    zero_prefetch: int = key(1, min=0, max=COUNT_MAX, help=(
        "ZeRO-3: units whose all-gather is posted ahead of the one running (the next in forward, the previous "
        "in backward), so communication overlaps compute. 0 = gather each unit only when it is needed. Each "
        "adds one unit's gathered parameters to the peak memory."))
    ep: int = key(1, min=1, max=COUNT_MAX, help=(
        "Expert parallelism (a model with `moe.num_experts` > 0): the experts of every MoE layer are split over ep "
        "ranks carved out of the replica group (dp x cp: consecutive replica ranks form an ep group), each holding "
        "num_experts / ep of them; tokens go to their experts and back by all-to-all on the ep group. Expert "
        "gradients are summed over the replicas that hold the same experts (dp x cp / ep), the rest over dp x cp. "
        "Must divide dp x cp and `moe.num_experts`. 1 = every rank holds every expert."))
    bucket_mb: float = key(25.0, above=0, help=(
        "Size of a gradient bucket (MiB of main-grad storage). A bucket's dp reduction starts as soon as backward "
        "has produced all its gradients."))
    stage_layers: list[int] = key(factory=list, help=(
        "Layers per pipeline stage, e.g. `[3, 5]`; pp entries summing to n_layers (interleaved and zb-v: pp x "
        "virtual_stages entries, one per virtual stage in order; interleaved rank r holds v = c x pp + r, zb-v "
        "r and 2 pp - 1 - r). Empty = balanced by parameter count "
        "(embedding and LM head count against their stages)."))
    strict_placement: bool = key(False, help=(
        "Make a tensor-parallel group that spans nodes an error instead of a warning."))
    backend: str = key("auto", choices=("auto", "mpi", "cuda-mpi", "nccl"), help=(
        "How CUDA tensors travel (host tensors always use MPI): `auto` = NCCL via CuPy when it imports and each "
        "rank of a group has its own GPU, else MPI with host staging; `mpi` = host staging (any MPI, ranks may "
        "share a GPU); `cuda-mpi` = device pointers to a CUDA-aware MPI; `nccl` = NCCL or an error."))


@dataclass
class CommConfig:
    """Communication watchdog and debugging ($HPCTRAIN_COMM_TIMEOUT, when set, overrides timeout_s)."""
    timeout_s: float = key(600.0, min=0, help=(
        "Seconds a communication call (collective, point-to-point, checkpoint exchange) may take before the job "
        "ends with a hang report that names the ranks that never reached the call (exit 3). 0 = no watchdog. "
        "`HPCTRAIN_COMM_TIMEOUT`, when set, overrides it. A call that waits for ranks inside torch.compile "
        "(`train.compile`'s first step) is not reported while they compile (at most an hour more), and gets a full "
        "timeout after."))
    check: bool = key(False, help=(
        "Debugging: before every collective the group's members compare op, size and dtype; a mismatch ends the "
        "job naming the first differing rank (one extra small allgather per call)."))
    intra_node: str = key("auto", choices=("auto", "shm", "mpi"), help=(
        "How the ranks of one node reduce with each other in the data-parallel group: `shm` = "
        "hpctrain/comm/shm.py's MPI-3 shared-memory window carries the dp group's allreduce / reduce_scatter / "
        "allgather of contiguous CPU float32/float64 sums (gradients, ZeRO-1 gathers; other dtypes, GPU tensors "
        "and other groups stay on MPI); with `shm` a dp group spanning nodes with the same number of its ranks on "
        "each goes hierarchical (hpctrain/comm/hierarchical.py: shared memory on each node, MPI between nodes; "
        "reported as `shm-hierarchical`); refused with the reason before training when the nodes hold different "
        "numbers of dp ranks, one each, or no shared window can be allocated or backed (/dev/shm too small or "
        "full); `auto` (the default) = when every dp group lies on one node, shm for the ops and sizes where it "
        "measured faster than MPI on this node (`route_cache`), else MPI with one line saying why "
        "(a dp group spanning nodes stays on MPI: the hierarchical step measured no faster on emulated nodes); "
        "`mpi` = the MPI library. Measured: the dp step 1.00-1.01x the MPI path at 2 ranks, 1.02-1.04x at 4 (3 "
        "paired runs each, docs/benchmarks.md)."))
    route_cache: bool = key(True, help=(
        "With `intra_node = \"auto\"` on one node: at start-up the dp group times the shared-memory route against "
        "MPI per op (allreduce, reduce_scatter, allgather) and size class (<= 8 KiB, 64 KiB, 1 MiB, 16 MiB, larger; "
        "about 1 s) and sends each through the faster (shm only when >= 1.2x MPI, 2x with more ranks than cores on "
        "the node, where shm's speed swings); the table is cached per node "
        "and MPI (JSON under `intra-node/` in the cache dir: `HPCTRAIN_CACHE`, else `data.cache_dir`, else "
        "`~/.cache/hpctrain`) and shown by `hpctrain info`. `true` = reuse a cached table; `false` = measure "
        "again and rewrite it."))
    alltoall_by_peer_kib: int = key(128, min=0, help=(
        "Expert parallelism on CPUs: the dispatch and combine all-to-alls send blocks of this many KiB or more "
        "(the largest block of any ep rank; every rank knows it) one MPI Isend/Irecv per peer instead of one "
        "Alltoallv: PyPI MPICH's Alltoallv took 1.3-3x as long at 1-64 MiB (docs/benchmarks.md). 0 = always block "
        "by block. GPU tensors on NCCL are not affected."))
    shm_progress: str = key("call", choices=("call", "thread"), help=(
        "When a shared-memory dp reduction (comm.intra_node) runs: `call` = inside the call, in the backward hook "
        "that starts it (measured fastest on this 2-core machine); `thread` = on one worker thread per rank, in "
        "order, overlapped with backward (hides ~98% of the reduction in the trace, but competes for the core: for "
        "nodes with a spare core per rank)."))


@dataclass
class CompressionConfig:
    """Gradient compression of the data-parallel reduction (docs/compression.md)."""
    method: str = key("none", choices=("none", "fp16", "bf16", "int8", "topk", "randomk", "powersgd",
                                          "onebit", "zfp", "onebit-adam"), help=(
        "Gradient compression of the data-parallel reduction: `none` (dense all-reduce), `fp16`, `bf16`, `int8` "
        "(scale per 256 values), `topk`, `randomk` (keep `density` of the values), `powersgd` (rank-`rank` "
        "matrices), `onebit` (sign + scale), `zfp` (fixed rate `zfp_rate`, needs zfpy), `onebit-adam` (1-bit Adam: "
        "AdamW's momentum in 1 bit after `warmup_steps` dense steps, variance frozen; needs optim.name = adamw). "
        "See docs/compression.md for costs and when each pays."))
    density: float = key(0.01, above=0, max=1, help=(
        "topk / randomk: fraction of each bucket's values sent (0.01 = 1%)."))
    rank: int = key(4, min=1, help=(
        "powersgd: rank r of the approximation P Q^T; a matrix is compressed only if 2 (m+n) r <= m n."))
    error_feedback: bool = key(True, help=(
        "Keep what compression dropped and add it to the next step's gradient (also on the summed side for the "
        "quantizers). Saved in checkpoints."))
    warmup_steps: int = key(0, min=0, help=(
        "Dense steps before compression starts (onebit-adam: the dense AdamW steps before the variance freezes; "
        "must be > 0)."))
    scope: str = key("all", choices=("all", "inter-node"), help=(
        "`all`: compress every dp link. `inter-node`: dense reduce-scatter inside each node, compressed sum across "
        "nodes, all-gather inside the node (from the process grid's node map)."))
    min_numel: int = key(0, min=0, help="Buckets (powersgd: matrices) with fewer elements than this go dense.")
    zfp_rate: float = key(8.0, above=0, max=32, help=(
        "zfp: bits per value in ZFP's fixed-rate mode (8 = 4x smaller than float32)."))
