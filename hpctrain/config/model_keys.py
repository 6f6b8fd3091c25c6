"""The model's keys: ``[model]`` (the transformer; sizes left unset take the preset's) and ``[lora]``."""
from dataclasses import dataclass

from hpctrain.config.keys import COUNT_MAX, SIZE_MAX, key
from hpctrain.config.presets import PRESETS

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # attention q/k/v/o, the MLP's gate/up/down


@dataclass
class ModelConfig:
    """Transformer model; keys left unset (0, "auto", not given) take the preset's value (see resolve_model)."""
    preset: str = key("tiny", choices=(*PRESETS, "custom"), help=(
        "Named model (see Presets below, and docs/models-and-data.md for their sources); it fills every model key "
        "left unset (sizes and `rope_theta` at 0, `mlp`/`positions` at `auto`, `tie_embeddings` not given). "
        "`custom`: no preset, give every size key explicitly."))
    vocab_size: int = key(0, above=0, max=SIZE_MAX, help=(
        "Vocabulary size (token ids must be below it). 0 = the preset's (256, byte-level tokens, for `tiny`, "
        "`small` and `custom`; 50257 GPT-2/3, 51200 PTD-P, 32000 Llama 2, 128256 Llama 3). 256 is what the builtin "
        "corpus and text sources produce. Any size works with any `parallel.tp`: the embedding and LM head are "
        "padded (`model.vocab_multiple`)."))
    vocab_multiple: int = key(128, min=1, max=65536, help=(
        "The embedding and LM head hold `ceil(vocab_size / (vocab_multiple x tp)) x vocab_multiple x tp` rows "
        "(Megatron's `make_vocab_size_divisible_by`): every tp rank the same number, a multiple of this (128: "
        "tensor-core friendly GEMMs). The padding rows are zero, never trained, masked out of the loss and "
        "sampling, and never saved: checkpoints and exports hold the true vocabulary, so a run may change it on "
        "resume. 1 = pad only to a multiple of tp. See docs/parallelism.md."))
    d_model: int = key(0, above=0, max=SIZE_MAX, help="Hidden size. 0 = the preset's.")
    n_layers: int = key(0, above=0, max=COUNT_MAX, help=(
        "Transformer blocks. 0 = the preset's. Must be >= `parallel.pp`."))
    n_heads: int = key(0, above=0, max=COUNT_MAX, help=(
        "Query heads; `d_model` must be divisible by it, and it by `parallel.tp`. 0 = the preset's."))
    n_kv_heads: int = key(0, above=0, max=COUNT_MAX, help=(
        "Key/value heads (grouped-query attention; = n_heads is plain multi-head). Must divide `n_heads` and be "
        "divisible by `parallel.tp`. 0 = the preset's."))
    d_ff: int = key(0, above=0, max=SIZE_MAX, help=(
        "MLP width (SwiGLU or GELU); divisible by `parallel.tp`. 0 = the preset's."))
    max_seq_len: int = key(0, above=0, max=SIZE_MAX, help=(
        "Longest sequence the model accepts (`train.seq_len` <= it). 0 = the preset's."))
    tie_embeddings: bool | None = key(None, help=(
        "The LM head reuses the input embedding. With pp > 1 the last stage holds a copy whose gradient is summed "
        "with stage 0's over the pipeline group every step. Not given = the preset's (true for the GPT presets, "
        "false otherwise)."))
    rope_theta: float = key(0.0, above=0, help=(
        "Base of the rotary position embedding frequencies (`positions = \"rope\"`). 0 = the preset's (500000 for "
        "Llama 3, else 10000)."))
    mlp: str = key("auto", choices=("auto", "swiglu", "gelu"), help=(
        "The MLP: `swiglu` (Llama: down(silu(gate(x)) * up(x)), three d_model x d_ff matrices) or `gelu` (GPT-2/3, "
        "Megatron: down(gelu(up(x))) with the tanh approximation both used, two matrices). `auto` = the preset's "
        "(`gelu` for the GPT presets, else `swiglu`). An architecture key."))
    positions: str = key("auto", choices=("auto", "rope", "learned"), help=(
        "Position information: `rope` (rotary, on q and k in every layer) or `learned` (GPT: a max_seq_len x "
        "d_model table `pos_embed.weight` added to the token embedding on the first pipeline stage; replicated "
        "over tp; with sequence parallelism each tp rank adds the rows of its local sequence). `auto` = the "
        "preset's (`learned` for the GPT presets, else `rope`). An architecture key; Hugging Face export/import "
        "needs `swiglu` + `rope`."))
    norm_eps: float = key(1e-5, above=0, help="Epsilon of RMSNorm.")
    init_std: float = key(0.02, above=0, help=(
        "Standard deviation of the normal initialisation of every matrix (norm weights start at 1)."))
    attention_window: int = key(0, min=0, help=(
        "Sliding-window attention (Mistral's sliding_window): token t attends to t-W+1..t. 0 = full causal. At "
        "most train.seq_len. With parallel.cp > 1 the ring skips the blocks entirely outside every query's window. "
        "An architecture key: `hpctrain import-hf` of a Mistral sets it, `hpctrain export --format hf` of a model "
        "with W > 0 writes a MistralForCausalLM, and model.init_from / a weights-only resume refuse another window."))
    init_from: str = key("", help=(
        "Start a fresh run from these weights instead of a random initialisation: a Hugging Face Llama or Mistral "
        "directory (config.json + safetensors) or an hpctrain checkpoint (step, checkpoints or run directory). Any "
        "layout; each rank reads only its slabs. The model.* keys must describe the same model (an error lists the "
        "differences). Applies only when nothing is resumed, so a requeued job continues from its own checkpoint. "
        "Optimizer state starts fresh. See docs/models-and-data.md."))
    fused_head_loss: bool = key(True, help=(
        "The last pipeline stage computes the LM head and the cross-entropy together over loss chunks of tokens "
        "(and over the vocab-parallel slabs with tp), never holding [tokens, vocab] logits: forward forms dh and "
        "dW chunk by chunk with the logits (the plain path's 3 head matmuls; float16 recomputes them in backward: "
        "4), far less memory (docs/benchmarks.md). Losses and gradients equal the plain path's (float64: 1e-10 in "
        "every layout). `false`: logits, then the vocab-parallel cross-entropy (the fallback). Generation and "
        "export always compute plain logits. Not part of the model: a run may change it on resume."))
    loss_chunk_tokens: int = key(0, min=0, help=(
        "Tokens per chunk of the fused head + loss (`model.fused_head_loss`), of the last stage's micro-batch "
        "tokens (micro_batch x seq_len / cp). 0 = automatic: one chunk when the float32 logits of all tokens over "
        "this rank's vocabulary slab fit 256 MiB, else as many tokens as fit (a multiple of 128). A size that does "
        "not divide the tokens is fine (the last chunk is smaller). The start-up line names the chunk."))
    head_kernel: str = key("auto", choices=("auto", "hpctrain", "liger", "cce"), help=(
        "Which kernel runs the fused head + loss (`model.fused_head_loss`) at tp = 1 on CUDA: `hpctrain` (its own "
        "chunks), `liger` (Liger-Kernel's fused linear cross-entropy) or `cce` (Apple's Cut Cross-Entropy), both "
        "from `pip install 'hpctrain[kernels]'`. `auto`: a start-up trial runs each one installed forward + "
        "backward on the run's shapes, checks it against hpctrain's and takes the fastest that passed (float64: "
        "hpctrain's, untried). `liger`/`cce`: that one if it passes its trial, else hpctrain's with one line "
        "saying why. Ignored on the host, under tp > 1 and with the fused head off. The start-up line names a "
        "kernel other than hpctrain's (docs/gpus.md). Not part of the model: a run may change it on resume."))
    residual_dtype: str = key("auto", choices=("auto", "float32"), help=(
        "The dtype of the residual stream of a bfloat16/float16 model: `auto` (default), the training dtype; "
        "`float32`: the embedding's output, what every block takes and returns, what pipeline stages send each "
        "other and the final norm's input stay float32, while every sublayer computes in the training dtype (each "
        "norm's output is cast to it, each sublayer's output added to the float32 residual: Megatron's "
        "--fp32-residual-connection, and what the loop of fp32 parameters under torch.autocast keeps). Costs the "
        "residual's activation memory and pipeline bytes twice over. float32/float64 runs are never narrowed: "
        "there it changes nothing. Why `auto` stays the default, and the measurements: docs/gpus.md. Not part of "
        "the model: a run may change it on resume."))


@dataclass
class LoraConfig:
    """Low-rank adapters on a frozen model (LoRA, as Hugging Face PEFT; docs/models-and-data.md)."""
    rank: int = key(0, min=0, help=(
        "LoRA adapter rank r (Hugging Face PEFT's `r`). 0 = off: every weight trains. > 0: every `lora.targets` "
        "linear of every block gains `alpha/r B A x` (A [r, in], B [out, r]) and every other weight (embeddings, "
        "norms, LM head included, as PEFT's default) is frozen: no gradient, no optimizer state, no dp reduction; "
        "gradient norm, clipping, compression and ZeRO-1/2 see the adapters only (ZeRO-3 shards the frozen base "
        "too). At most min(in, out) of the "
        "smallest target. Works in every layout (adapters split over tp like their linear: docs/parallelism.md). "
        "The start-up line reports trainable vs frozen parameters and the optimizer memory saved; checkpoints hold "
        "the adapters and their optimizer state, and refer to the frozen base (`lora.checkpoint_base`). See "
        "docs/models-and-data.md."))
    alpha: float = key(8.0, above=0, help=(
        "PEFT's `lora_alpha`: the adapter's output is scaled by alpha / rank (not rank-stabilised). Must be > 0."))
    dropout: float = key(0.0, min=0, below=1, help=(
        "Dropout probability on the adapter's input (PEFT's `lora_dropout`), in training only. Its masks come from "
        "each rank's torch generator (seeded from `train.seed` and the world rank; saved in checkpoints of CPU "
        "runs), so with dropout > 0 two layouts draw different masks: statistically the same training, not the "
        "same numbers."))
    targets: list[str] = key(factory=lambda: ["q", "v"], help=(
        "The linears of each block that get adapters, any of `q`, `k`, `v`, `o` (attention) and `gate` (SwiGLU "
        "only), `up`, `down` (MLP): HF's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. Default q "
        "and v (the LoRA paper's and PEFT's Llama default)."))
    init: str = key("peft", choices=("peft",), help=(
        "`peft`: A Kaiming-uniform, U(-1/sqrt(in), 1/sqrt(in)) (PEFT's default `init_lora_weights=True`), B zero, "
        "so training starts from the base model's function. Drawn from (`train.seed`, parameter name): every "
        "layout starts from the same adapters. `model.init_from` loads the base weights; the adapters keep this "
        "initialisation."))
    checkpoint_base: str = key("reference", choices=("reference", "copy"), help=(
        "How a LoRA run's checkpoints hold the frozen base weights. `reference` (default): not at all; the "
        "checkpoint records where the base is (`model.init_from`'s absolute path) and a CRC-32 of every base "
        "tensor (root attribute `lora_base`), and a resume, export or generate reads the base from there, checked "
        "against those checksums (the ranks split the check: the base is read whole once). A base that is gone or "
        "changed stops the resume with one line; set `model.init_from` to where the base is now. A run without "
        "`model.init_from` (a random base) copies. `copy`: every checkpoint holds the base too and stands alone "
        "(move it anywhere, delete the base). A run may switch between the two on resume."))
