#!/usr/bin/env bash
# Fine-tune a model made by transformers with LoRA on tp=2 x pp=2, hand the adapter to peft, and ask both.
# docs/models-and-data.md ("Worked example: fine-tuning with LoRA") shows its output and timings.
#
#   bash examples/sft/finetune.sh [WORK_DIR]          (default work/sft-example; STEPS=300 by default)
#
# Run from the repository root with the virtual environment active (make setup; . .venv/bin/activate).
set -euo pipefail
work=${1:-work/sft-example}
steps=${STEPS:-300}
launch=${MPIEXEC:-mpiexec}
if [ -e "$work" ]; then
    echo "finetune.sh: $work exists; give another WORK_DIR or remove it" >&2
    exit 2
fi
mkdir -p "$work"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
timed() { local start=$SECONDS; "$@"; echo "  [$(( SECONDS - start )) s]"; }

echo "== 1. a Llama made by transformers"
timed python examples/sft/make_base.py "$work/base"
echo "== 2. import it (its [model] section for the config)"
timed hpctrain import-hf "$work/base" --out "$work/base-ckpt"
echo "== 3. prepare the SFT examples shipped in the repository"
timed hpctrain data prepare --format sft-jsonl examples/sft/tiny.jsonl --out "$work/sft.h5"
echo "== 4. LoRA on all seven linears, tp=2 x pp=2, the base from the Hugging Face directory"
timed $launch -n 4 hpctrain train --config "$work/base-ckpt/model.toml" model.init_from="$work/base" \
    data.source="$work/sft.h5" data.tokenizer=bytes train.seq_len=128 train.global_batch=8 \
    parallel.tp=2 parallel.pp=2 parallel.microbatches=2 lora.rank=16 lora.alpha=32 \
    "lora.targets=[q,k,v,o,gate,up,down]" train.lr=3e-3 train.warmup_steps=10 train.steps="$steps" \
    train.log_interval=25 checkpoint.interval=0 train.run_dir="$work/run"
echo "== 5. export the adapter for peft"
timed hpctrain export "$work/run" --format peft --out "$work/adapter"
echo "== 6. peft + transformers and hpctrain answer the same question"
timed python examples/sft/peft_generate.py "$work/base" "$work/adapter" "$work/run" "What is 7 times 6?"
echo "== 7. hpctrain generate --chat"
timed hpctrain generate "$work/run" --chat --prompt "Name the capital of France." --temperature 0 --max-new-tokens 24
