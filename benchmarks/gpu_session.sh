#!/usr/bin/env bash
# Issue #26's GPU measurements in four stages of under 10 minutes each, for a short lease on one GPU
# (the project's lent H100/H200; any node with one GPU will do). Run from the repository root:
#
#   benchmarks/gpu_session.sh quick        # everything in one command, < 8 min on one H100 with cold compile
#                                          # caches: tests/gpu, then gpt2-small and gpt2-xl (gpt2-medium if time
#                                          # is left) against compiled torch; ONE table at the end, with targets
#   benchmarks/gpu_session.sh check        # versions, gcc/Python.h for Triton, tests/gpu (incl. the sync-free audit)
#   benchmarks/gpu_session.sh trace        # a compiled bf16 run under torch.profiler; `hpctrain trace`: host waits
#   benchmarks/gpu_session.sh small        # bench_gpu_train: gpt2-small and gpt2-medium, hpctrain vs compiled torch
#   benchmarks/gpu_session.sh xl           # bench_gpu_train: gpt2-xl (~1.5B), micro-batch 8
#   benchmarks/gpu_session.sh residual     # gpt2-xl, 20 steps, hpctrain's residual stream bf16 (auto) then float32
#                                          # (model.residual_dtype), each against the loop: per-step loss gaps, < 8 min
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
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"  # one node: NCCL's bootstrap needs no other interface
if [ "$(id -u)" = 0 ]; then  # Open MPI's mpiexec refuses root without these (the lent GPU machines run as root)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
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

quick() {  # tests/gpu, then the bench presets while the budget lasts; one table (gpu_session_table.py)
  local start=$SECONDS budget=${QUICK_BUDGET_S:-450}
  run quick.log "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  if [ "$DEVICE" = cuda ]; then
    # 27 items took over 240 s on an H200 (2026-11-28): each test gets 75 s so one hang is named and the rest
    # still run; SIGINT at 300 s lets pytest write the junit file with what finished.
    run quick.log timeout -s INT -k 10 300 "$PYTHON" -m pytest tests/gpu -q -p no:cacheprovider -rs --timeout 75 \
      --durations=10 \
      --junitxml="$OUT/tests-gpu.xml"
  else  # the dry run: the table's test line from a small CPU test file
    run quick.log timeout 240 "$PYTHON" -m pytest tests/unit/test_stop_policy.py -q -p no:cacheprovider \
      --junitxml="$OUT/tests-gpu.xml"
  fi
  local preset mb seconds
  for preset in gpt2-small:16:90 gpt2-xl:8:150 gpt2-medium:16:110; do  # name:micro-batch:seconds it needs
    IFS=: read -r name mb seconds <<< "$preset"
    if [ $((SECONDS - start + seconds)) -gt "$budget" ]; then
      echo "== quick: $name left out ($((SECONDS - start)) s used of $budget)" | tee -a "$OUT/quick.log"; continue
    fi
    if [ "$DEVICE" = cpu ]; then
      run quick.log "$PYTHON" benchmarks/bench_gpu_train.py --device cpu --presets tiny --seq-len 64 --micro-batch 2 \
        --global-batch 4 --warmup 1 --steps 2 --window 1 --compile false --json "$OUT/quick-$name.json"
    else
      run quick.log "$PYTHON" benchmarks/bench_gpu_train.py --presets "$name" --micro-batch "$mb" --global-batch 32 \
        --warmup 3 --steps 10 --window 5 --timeout 300 --json "$OUT/quick-$name.json"
    fi
  done
  echo "== quick: $((SECONDS - start)) s" | tee -a "$OUT/quick.log"
  "$PYTHON" benchmarks/gpu_session_table.py --junit "$OUT/tests-gpu.xml" "$OUT"/quick-*.json | tee "$OUT/quick-table.txt"
}

check() {  # versions, what Triton needs, then tests/gpu (incl. the sync-free audit on CUDA)
  run check.log "$PYTHON" -c "import sys, sysconfig, os, shutil, torch; print(sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU');
print('gcc', shutil.which('gcc'), '| Python.h', os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"
  if [ "$DEVICE" = cuda ]; then
    run check.log "$PYTHON" -m pytest tests/gpu -q -p no:cacheprovider -rs --timeout 540
  fi
}

residual() {  # does a float32 residual stream (model.residual_dtype) close the gpt2-xl loss gap to the loop?
  local r
  for r in auto float32; do
    if [ "$DEVICE" = cpu ]; then
      run residual.log "$PYTHON" benchmarks/bench_gpu_train.py --device cpu --presets tiny --seq-len 64 --micro-batch 2 \
        --global-batch 4 --warmup 1 --steps 3 --window 1 --compile false --residual-dtype $r --json "$OUT/residual-$r.json"
    else
      run residual.log "$PYTHON" benchmarks/bench_gpu_train.py --presets gpt2-xl --micro-batch 8 --global-batch 32 \
        --warmup 4 --steps 16 --window 4 --timeout 300 --residual-dtype $r --json "$OUT/residual-$r.json"
    fi
  done
  "$PYTHON" - "$OUT"/residual-auto.json "$OUT"/residual-float32.json <<'EOF' 2>&1 | tee -a "$OUT/residual.log"
import json, sys
for path in sys.argv[1:]:  # each: hpctrain's row and the loop's, every step's loss
    rows = {r["impl"]: r for r in json.load(open(path))}
    hp, loop = rows["hpctrain"], rows["torch"]
    gaps = [abs(a - b) for a, b in zip(hp["losses"], loop["losses"])]
    print(f"residual {hp['residual_dtype']:9} |loss - loop's| mean {sum(gaps) / len(gaps):.4f} max {max(gaps):.4f} "
          f"over {len(gaps)} steps; last {hp['losses'][-1]:.4f} vs {loop['losses'][-1]:.4f}; "
          f"{hp['tokens_per_s']:.0f} tokens/s (loop {loop['tokens_per_s']:.0f})")
EOF
}

trace() {  # a compiled run traced with torch.profiler: host waits per step, split at the optimizer
  local dtype=bfloat16; [ "$DEVICE" = cpu ] && dtype=float32
  rm -rf "$OUT/sync-free"
  run trace.log "$PYTHON" -m hpctrain.cli train --config configs/tiny.toml parallel.tp=1 parallel.pp=1 \
    train.device="$DEVICE" train.dtype=$dtype train.compile=true train.steps=12 train.trace=true train.trace_steps=4 \
    train.progress=false train.run_dir="$OUT/sync-free"
  run trace.log "$PYTHON" -m hpctrain.cli trace "$OUT/sync-free"   # CUDA: "host waits before the optimizer ...: 0"
}

case "${1:-}" in
  quick) quick ;;
  check) check ;;
  trace) trace ;;
  small) bench small gpt2-small,gpt2-medium 16 32 ;;
  xl) bench xl gpt2-xl 8 32 ;;
  residual) residual ;;
  all) check; trace; bench small gpt2-small,gpt2-medium 16 32; bench xl gpt2-xl 8 32 ;;
  *) echo "usage: $0 quick|check|trace|small|xl|residual|all  (DEVICE=cpu for a dry run; outputs in \$OUT)" >&2; exit 2 ;;
esac
echo "== outputs in $OUT:"; ls "$OUT"
exit $status
