#!/usr/bin/env bash
# Issue #26's GPU measurements in three stages of under 10 minutes each, for a short lease on one GPU
# (the project's lent H100/H200; any node with one GPU will do). Run from the repository root:
#
#   benchmarks/gpu_session.sh check        # versions, tests/gpu (incl. the sync-free audit), the CUDA trace's host waits
#   benchmarks/gpu_session.sh small        # bench_gpu_train: gpt2-small and gpt2-medium, hpctrain vs compiled torch
#   benchmarks/gpu_session.sh xl           # bench_gpu_train: gpt2-xl (~1.5B), micro-batch 8
#   DEVICE=cpu benchmarks/gpu_session.sh all   # the same stages at toy sizes on a CPU (a dry run of this script)
#
# Outputs go to $OUT (default ./gpu-session): one log per stage, the benchmarks' JSON/CSV, the trace
# summary. The last lines of each stage are a short table. PYTHON (default python3) must have torch,
# mpi4py, h5py and numpy; hpctrain is imported from this checkout. Exit status: the first failure's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-$PWD/gpu-session}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

run() {  # run LOG COMMAND...: tee the output into $OUT/LOG, remember a failure
  local log="$OUT/$1"; shift
  echo "== $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== exit $rc: $*" | tee -a "$log"; [ "$status" -ne 0 ] || status=$rc; }
}

bench() {  # bench NAME PRESETS MICRO GLOBAL: hpctrain against compiled plain PyTorch
  if [ "$DEVICE" = cpu ]; then
    run "$1.log" "$PYTHON" benchmarks/bench_gpu_train.py --device cpu --presets tiny --seq-len 64 --micro-batch 2 \
      --global-batch 4 --warmup 1 --steps 2 --compile false --json "$OUT/$1.json" --csv "$OUT/$1.csv"
  else
    run "$1.log" "$PYTHON" benchmarks/bench_gpu_train.py --presets "$2" --micro-batch "$3" --global-batch "$4" \
      --warmup 5 --steps 20 --json "$OUT/$1.json" --csv "$OUT/$1.csv"
  fi
}

check() {
  run check.log "$PYTHON" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  if [ "$DEVICE" = cuda ]; then
    run check.log "$PYTHON" -m pytest tests/gpu -q -p no:cacheprovider -rs --timeout 540
  fi
  local dtype=bfloat16; [ "$DEVICE" = cpu ] && dtype=float32
  rm -rf "$OUT/sync-free"
  run check.log "$PYTHON" -m hpctrain.cli train --config configs/tiny.toml parallel.tp=1 parallel.pp=1 \
    train.device="$DEVICE" train.dtype=$dtype train.compile=true train.steps=12 train.trace=true train.trace_steps=4 \
    train.progress=false train.run_dir="$OUT/sync-free"
  run check.log "$PYTHON" - "$OUT/sync-free" <<'PY'
import glob, json, sys
# host waits between a step's first forward kernel and its fused AdamW kernel (docs/gpus.md: none expected)
paths = glob.glob(f"{sys.argv[1]}/trace/cuda-rank*.json")
if not paths:
    sys.exit(print("no CUDA trace (train.trace writes one on CUDA only)") or 0)
events = json.load(open(paths[0]))["traceEvents"]
waits = sorted(e["ts"] for e in events if e.get("name") in ("cudaStreamSynchronize", "cudaEventSynchronize",
               "cudaDeviceSynchronize") or (e.get("name", "").startswith("cudaMemcpy") and "Async" not in e["name"]))
adam = sorted(e["ts"] for e in events if "fused_adam" in e.get("name", "").lower() and e.get("cat") == "kernel")
print(f"{len(waits)} host waits in the traced steps; fused AdamW kernels: {len(adam)}")
print("waits (us):", [round(w) for w in waits[:24]])
print("AdamW kernels (us):", [round(a) for a in adam[:8]])
PY
}

case "${1:-}" in
  check) check ;;
  small) bench small gpt2-small,gpt2-medium 16 32 ;;
  xl) bench xl gpt2-xl 8 32 ;;
  all) check; bench small gpt2-small,gpt2-medium 16 32; bench xl gpt2-xl 8 32 ;;
  *) echo "usage: $0 check|small|xl|all  (DEVICE=cpu for a dry run; outputs in \$OUT)" >&2; exit 2 ;;
esac
echo "== outputs in $OUT:"; ls "$OUT"
exit $status
