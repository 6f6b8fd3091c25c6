"""The keys of the training run: ``[optim]``, ``[data]``, ``[train]``, ``[checkpoint]``, ``[monitor]``."""
from dataclasses import dataclass

from hpctrain.config.keys import SIZE_MAX, key
from hpctrain.runtime.dtypes import DTYPE_NAMES


@dataclass
class OptimConfig:
    """Optimizer hyperparameters (learning rate and schedule live in TrainConfig)."""
    name: str = key("adamw", choices=("adamw", "sgd"), help=(
        "`adamw` (decoupled weight decay) or `sgd` (with optional momentum)."))
    beta1: float = key(0.9, min=0, below=1, help="AdamW first-moment decay.")
    beta2: float = key(0.95, min=0, below=1, help="AdamW second-moment decay.")
    eps: float = key(1e-8, above=0, help="AdamW denominator epsilon.")
    weight_decay: float = key(0.1, min=0, help=(
        "Decoupled weight decay, applied to matrices (dim >= 2) only, not to norm weights."))
    momentum: float = key(0.0, min=0, help="SGD momentum (0 = plain SGD); ignored by AdamW.")
    grad_clip: float = key(1.0, min=0, help=(
        "Clip the GLOBAL gradient norm (over every rank and stage) to this value. 0 = no clipping."))
    update: str = key("auto", choices=("auto", "compiled", "fused"), help=(
        "How AdamW updates the float32 masters. `compiled`: one `torch.compile`d pass per step that reads master, "
        "gradient and moments once and writes master, moments and the half-precision parameters, lr and the "
        "clip/loss-scale divisor as device scalars (no recompiles, no host reads; the gradients are not written). "
        "`fused`: `torch._fused_adamw_`, then a copy into the half-precision parameters. `auto`: `compiled` when "
        "`train.compile` is on, else `fused`. SGD, float64 masters and 1-bit Adam's frozen steps run the unfused "
        "ops whatever this says; `compiled` needs `optim.name = \"adamw\"`."))


@dataclass
class DataConfig:
    """Corpus: "builtin" (embedded) or a path to a text file, folder, .npy or .h5."""
    source: str = key("builtin", help=(
        "`builtin` (the Python standard library's sources, byte-level, cached on first use), or a path: a text "
        "file, a folder of text files, a `.npy` token array, or a `.h5`/`.hdf5` file with a `tokens` dataset. A "
        "corpus made by `hpctrain data prepare` is read by slabs: each rank reads only the windows it trains on. "
        "An SFT corpus (`hpctrain data prepare --format sft-jsonl`) trains on packed examples whose loss counts "
        "only the responses (docs/models-and-data.md, SFT data)."))
    tokenizer: str = key("bytes", help=(
        "`bytes` (every byte a token, vocabulary 256) or the path of a Hugging Face `tokenizer.json` (e.g. from "
        "`hpctrain data train-tokenizer`). Training checks that the corpus was prepared with this tokenizer; "
        "nothing is downloaded."))
    valid_fraction: float = key(0.0, min=0, below=1, help=(
        "Hold out the last fraction of the corpus for validation (at a document boundary for a prepared corpus; "
        "the last examples of an SFT corpus); training never samples from it. 0 = no validation data."))
    cache_dir: str = key("", help=(
        "Where the builtin corpus is cached. Empty = `~/.cache/hpctrain`. `HPCTRAIN_CACHE`, when set, overrides it."))
    max_bytes: int = key(0, min=0, help=(
        "Keep only the first N tokens (= bytes) of a byte-level source (text, folder, builtin, .npy); a prepared "
        "token file (hpctrain data prepare) is always used whole. 0 = the whole corpus."))


@dataclass
class TrainConfig:
    """Training loop, precision, learning-rate schedule and logging."""
    steps: int = key(50, min=0, help="Optimizer steps of the run (also the length of the learning-rate schedule).")
    seed: int = key(1234, min=0, help=(
        "Seed of the initial weights (each parameter drawn globally from (seed, name), so every layout starts "
        "identically) and of the data order (sample i depends only on (seed, i))."))
    dtype: str = key("float32", choices=DTYPE_NAMES, help=(
        "Parameter and activation dtype. bfloat16/float16 keep float32 main gradients and float32 master weights "
        "in the optimizer; float16 also uses dynamic loss scaling."))
    global_batch: int = key(8, min=1, max=SIZE_MAX, help=(
        "Sequences per optimizer step over all replicas; divisible by dp, and global_batch / dp by "
        "`parallel.microbatches` (with `train.micro_batch_size` > 0: divisible by dp x micro_batch_size)."))
    micro_batch_size: int = key(0, min=0, max=SIZE_MAX, help=(
        "Sequences per forward (and backward) on each replica; 0 = global_batch / dp / `parallel.microbatches`. > "
        "0: the replica batch runs as global_batch / (dp x micro_batch_size) micro-batches with gradients "
        "accumulated in between, and the dp reduction runs once per step, overlapped with the last micro-batch's "
        "backward. global_batch must be divisible by dp x micro_batch_size. With cp the micro-batch is still "
        "sequences (each cp rank holds its stripes of them). `hpctrain plan` reads it as its `--micro-batch`."))
    seq_len: int = key(64, min=1, max=SIZE_MAX, help="Tokens per sequence (<= `model.max_seq_len`).")
    lr: float = key(3e-3, above=0, help="Peak learning rate (reached after warm-up).")
    min_lr: float = key(3e-4, min=0, help="Final learning rate of the cosine or linear decay.")
    warmup_steps: int = key(5, min=0, help="Steps of linear warm-up from lr / warmup_steps to lr.")
    lr_schedule: str = key("cosine", choices=("cosine", "constant", "linear"), help=(
        "After warm-up: `cosine` or `linear` decay to min_lr at the last step, or `constant`."))
    fp8: str = key("none", choices=("none", "tensorwise", "rowwise"), help=(
        "Float8 matmuls in the transformer blocks' linears (attention q/k/v/o, the MLP, the experts' linears) "
        "through torchao's `torchao.float8` casts (the `fp8` extra): `tensorwise` (one dynamic scale per tensor) "
        "or `rowwise` (one per row, power-of-2 scales); the embedding, LM head and MoE router stay in "
        "`train.dtype`. Scales are computed over the whole logical tensor (amax max-reduced over the tp group "
        "where a tensor is split), so every layout computes what one process does. Needs `train.dtype=bfloat16` "
        "(float32 or float64 too with `train.fp8_emulate`: references) and an sm89+ GPU, or `train.fp8_emulate`. "
        "Nothing fp8 is saved: the masters stay float32. See docs/gpus.md (FP8)."))
    fp8_emulate: bool = key(False, help=(
        "Emulate `train.fp8` (the CPU, or a GPU below sm89): the same casts and scales, each float8 operand "
        "dequantised and the matmul run in float32 (torchao's emulation). Not a speed path."))
    recompute: bool = key(False, help=(
        "Activation checkpointing: keep only each block's input and recompute the block in backward (less memory, "
        "about a third more compute)."))
    compile: str = key("false", choices=("false", "true", "auto"), help=(
        "`torch.compile` (inductor; C++ on the CPU, Triton on GPUs) of every transformer block of this rank's "
        "pipeline stages, one graph per block shape, reused by all blocks: the norms, projections, rotary, "
        "attention core, SwiGLU/GELU and residual adds fused. Tensor- and context-parallel collectives run eagerly "
        "between the compiled pieces (graph breaks by design); at tp = 1 the final norm, LM head and loss are one region; "
        "at dp = pp = tp = cp = 1 (no LoRA, experts or fp8) the whole stage, embedding to loss, is one region. `true`, "
        "`false` (TOML booleans work too) or `auto`: on when the run's device is a GPU. The first step pays the "
        "compile (seconds to a minute; cached in inductor's cache dir). `hpctrain train --verbose` prints the "
        "graphs and graph breaks after the first step. See docs/gpus.md."))
    compile_regions: str = key("auto", choices=("auto", "blocks"), help=(
        "What `train.compile` compiles as one region. `auto`: the whole stage, embedding to loss, where nothing needs "
        "per-block regions (dp = pp = tp = cp = 1, ZeRO <= 1, no LoRA, experts or fp8: no reduction for the blocks' "
        "gradient hooks to overlap, no collective inside), else every block (and the tail at tp = 1). `blocks`: "
        "every block always (for comparison; docs/gpus.md)."))
    log_interval: int = key(1, min=1, help=(
        "In batch logs (no terminal) print a progress line every N steps (and always the last and any skipped "
        "step). metrics.jsonl always gets every step."))
    peak_tflops: float = key(0.0, min=0, help=(
        "Peak TFLOP/s of one rank's device, for the MFU column. 0 = the published dense peak of a known GPU for "
        "the run's dtype (A100, H100, H200, V100, MI250X, MI300X: `hpctrain/runtime/device.py`), else unknown (no "
        "MFU). The model FLOPs per token are 6 per matmul parameter plus causal attention; a LoRA run counts 4 per "
        "frozen parameter (no weight gradient) and 6 per adapter parameter."))
    device: str = key("auto", choices=("auto", "cpu", "cuda"), help=(
        "`auto`: the GPU that this node-local rank binds (`local_rank % visible GPUs`, honouring "
        "`CUDA_VISIBLE_DEVICES`) when torch sees CUDA, else the CPU; `cpu`; `cuda` (an error on a rank without a "
        "GPU). Parameters, gradients, optimizer state, batches and pipeline buffers all live there."))
    host_malloc: str = key("auto", choices=("auto", "keep", "system"), help=(
        "Host memory a step frees: `keep` makes glibc's malloc keep it for the next step (mallopt: only requests "
        "above 32 MiB are mapped apart, the heap is not trimmed), so the activations and gradients of each step "
        "do not fault their pages in anew; `system`: the C library's own behaviour; `auto` (default): `keep` on "
        "a CPU device, where every activation is host memory. The peak resident memory is the same; it is not "
        "returned between steps. Measured: docs/benchmarks.md, \"Pipeline schedules\". No effect where the C "
        "library is not glibc."))
    allow_tf32: bool = key(True, help=(
        "Let float32 matmuls use TF32 tensor cores on NVIDIA GPUs (Ampere and newer): much faster, ~1e-3 relative "
        "error per product. Off for bitwise CPU/GPU comparisons."))
    exit_signals: list[str] = key(factory=lambda: ["USR1", "TERM"], help=(
        "Signals that stop the run cleanly: every rank agrees to stop after the same step, the state is saved "
        "synchronously, then the job is requeued (`train.requeue`) or exits with code 75. Slurm's "
        "`--signal=USR1@SECONDS` sends the first."))
    time_limit_s: float = key(0.0, min=0, help=(
        "Stop (and save) before this many seconds of wall time have passed since start. 0 = the Slurm job's end "
        "time (`squeue -o %e`), or no limit outside Slurm. The stop is checked before each step and leaves 3 steps "
        "(the one about to run and the 2 its request takes to be agreed: the verdict is read a step late; 2 with "
        "an immediate verdict) plus twice the MEASURED duration of the last save "
        "([slurm.md](slurm.md#time-limits))."))
    time_limit_margin_s: float = key(60.0, above=0, help=(
        "Time kept for the final save before any save has been measured in this job."))
    requeue: str = key("auto", choices=("auto", "never"), help=(
        "`auto`: after a stop by signal or time limit under Slurm, rank 0 runs `scontrol requeue` and every rank "
        "exits 0 (the job resumes from the checkpoint); if the job cannot be requeued, or with `never`, the exit "
        "code is 75."))
    loss_scale: float = key(65536.0, above=0, help=(
        "Initial dynamic loss scale for float16: halved (and the step skipped on every rank) when gradients "
        "overflow, doubled after 1000 good steps. Unused for other dtypes."))
    nonfinite: str = key("stop", choices=("stop", "skip"), help=(
        "A non-finite loss, or (without float16 loss scaling) a non-finite gradient norm, is never applied. "
        "`stop`: the run stops at once, saves nothing, logs a stop event and exits 4. `skip`: the step is skipped "
        "and training goes on (see max_skipped_steps)."))
    max_skipped_steps: int = key(20, min=1, help=(
        "Consecutive skipped steps after which the run stops as with nonfinite = stop (exit 4): non-finite steps, "
        "and float16 overflows at the minimum loss scale (1) that would otherwise skip forever. An overflow while "
        "the scale is above 1 only halves it (the scaler's search, as Megatron-LM and DeepSpeed): any "
        "train.loss_scale recovers."))
    run_dir: str = key("runs/default", help=(
        "Directory of the run: metrics.jsonl, config.json, summary.json, checkpoints/."))
    progress: bool = key(True, help="Show a live progress bar when stdout is a terminal.")
    eval_interval: int = key(0, min=0, help=(
        "Every N steps (and at the last step) compute the validation loss over `train.eval_steps` held-out global "
        "batches: `val_loss` in metrics.jsonl and on the progress line. Needs `data.valid_fraction`. 0 = off."))
    eval_steps: int = key(4, min=1, help=(
        "Global batches per validation; the same held-out batches every time and in every layout."))
    trace: bool = key(False, help=(
        "Write a Chrome-trace / Perfetto JSON per rank into <run_dir>/trace/: every phase and every collective "
        "(group, op, bytes, start, end) of the traced steps; `hpctrain trace RUN_DIR` merges them and says where "
        "each rank's time went (docs/scaling.md)."))
    trace_steps: int = key(5, min=1, help=(
        "How many steps `train.trace` records, from the second step of the run on (the first opens connections and "
        "warms caches)."))


@dataclass
class CheckpointConfig:
    """Checkpointing; the field ``async_`` is the key ``async``."""
    interval: int = key(0, min=0, help=(
        "Save every N steps. 0 = only at the end of the run (or of a `--max-steps` job, or of a stop by signal or "
        "time limit, which always saves). A job killed without warning (kill -9, a node failure) resumes from the "
        "last interval checkpoint, so with 0 it starts over."))
    keep: int = key(3, min=1, help=(
        "Complete checkpoints to keep; older ones are deleted after a newer one is published."))
    async_: bool = key(True, help=(
        "Write in a background thread after a host snapshot, while training continues (the next save or the end of "
        "the run waits for it)."))
    writer: str = key("auto", choices=("auto", "mpio", "shards"), help=(
        "`mpio`: one HDF5 file written collectively with MPI-IO (needs h5py built with MPI); `shards`: one file "
        "per rank joined by HDF5 virtual datasets; `auto`: mpio when available, else shards."))
    dir: str = key("", help="Where checkpoints go. Empty = `<train.run_dir>/checkpoints`.")
    local_dir: str = key("", help=(
        "The node-local tier (docs/fault-tolerance.md): a path on each node (`/dev/shm`, `$TMPDIR`, local NVMe) where "
        "every rank keeps its own state for this layout every `checkpoint.local_interval` steps, from a host copy "
        "taken in the step and written in the background. `$VARS` and `{hostname}` are expanded. `--resume auto` "
        "takes it when it is at least as new as the newest global checkpoint, every piece verifies and the "
        "layout is the same. Empty = off."))
    local_interval: int = key(0, min=0, help=(
        "Steps between two saves to `checkpoint.local_dir` (needs it set). 0 = no local saves."))
    replicas: int = key(0, choices=(0, 1, 2), help=(
        "Partner ranks on other nodes that also keep each rank's local piece (MPI point-to-point in the "
        "background): a replaced node's pieces are rebuilt from them. Needs `checkpoint.local_dir` and more nodes "
        "than replicas."))


@dataclass
class MonitorConfig:
    """Live monitoring: Prometheus metrics, TensorBoard, per-rank straggler gathering (docs/monitoring.md)."""
    prometheus_port: int = key(0, min=0, max=65535, help=(
        "Rank 0 serves Prometheus metrics at `http://prometheus_addr:PORT/metrics` (the `prometheus_client` "
        "package, in a thread of its own: a scrape never blocks a step). 0 = no server. A port in use stops the "
        "run before its first step, on every rank, in one line. The metrics: docs/monitoring.md."))
    prometheus_addr: str = key("127.0.0.1", help=(
        "The address the metrics server binds: `127.0.0.1` (default, this node only) or `0.0.0.0` (every "
        "interface, for a Prometheus on another node)."))
    prometheus_textfile: str = key("", help=(
        "A `*.prom` file for node_exporter's textfile collector, written by rank 0 atomically (a temporary file "
        "renamed) every `monitor.interval` steps, after a checkpoint and at exit (with `hpctrain_up 0`). \"\" = "
        "none. An unwritable path stops the run before its first step."))
    labels: list[str] = key(factory=list, help=(
        "Extra constant labels on every series, `[\"cluster=frontier\", \"project=abc\"]` (Prometheus label names; "
        "not `run`, `job_id`, `layout` or a metric's own labels, which hpctrain sets)."))
    tensorboard: bool = key(False, help=(
        "Rank 0 writes the same scalars as TensorBoard event files under `<train.run_dir>/tensorboard/` (the "
        "`tensorboard` package; `tensorboard --logdir` it)."))
    interval: int = key(0, min=0, help=(
        "Steps between two gathers of every rank's step time and bytes sent (the straggler and communication "
        "metrics: one small collective per interval) and two textfile writes. 0 = `train.log_interval`."))
