#!/usr/bin/env bash
# Check an hpctrain installation on a GPU node: CUDA as torch sees it, CuPy and NCCL, MPI, the GPU
# tests (tests/gpu) and a short data-parallel training run on NP ranks. Prints a summary; exit 0 only
# if all passed. Set HPCTRAIN_TEST_MPIEXEC / MPIEXEC for your launcher (e.g. "srun" inside salloc).
#   scripts/gpu_check.sh                 # with the python on PATH (activate your environment first)
#   PYTHON=/path/to/python NP=2 scripts/gpu_check.sh
# Run it inside an allocation on a GPU node (e.g. `salloc -N1 --gpus-per-node=4` then this script).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
NP="${NP:-1}"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/hpctrain-gpu-check.XXXXXX")"
declare -a SUMMARY
status=0
check() {  # check NAME COMMAND...: run, record PASS/FAIL
  local name="$1"; shift
  if "$@" >"$OUT/$name.log" 2>&1; then SUMMARY+=("PASS  $name"); else
    SUMMARY+=("FAIL  $name (log: $OUT/$name.log)"); status=1
    echo "== $name failed; the end of its log:"; tail -n 25 "$OUT/$name.log"
  fi
}

"$PYTHON" - <<'EOF' | tee "$OUT/environment.txt"
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, HIP {getattr(torch.version, 'hip', None)}")
print(f"CUDA available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
try:
    from cupy.cuda import nccl
    import cupy
    print(f"cupy {cupy.__version__}, NCCL {nccl.get_version()}")
except Exception as exc:
    print(f"cupy/NCCL not importable: {exc.__class__.__name__}: {exc} (CUDA tensors then go through MPI)")
from mpi4py import MPI
print("MPI:", MPI.Get_library_version().strip("\x00 \n").splitlines()[0])
EOF

check cuda-visible "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'"
check gpu-tests "$PYTHON" -m pytest tests/gpu -v --timeout 900
MPIEXEC="${MPIEXEC:-$(dirname "$(command -v "$PYTHON")")/mpiexec}"
[ -x "$MPIEXEC" ] || MPIEXEC=mpiexec
check train-gpu "$MPIEXEC" -n "$NP" "$PYTHON" -m hpctrain.cli train --config configs/tiny.toml \
  parallel.tp=1 parallel.pp=1 train.device=cuda train.dtype=bfloat16 train.steps=30 train.progress=false train.run_dir="$OUT/run"
[ -f "$OUT/run/summary.json" ] && { echo "training summary:"; cat "$OUT/run/summary.json"; }

echo
echo "== hpctrain GPU check =="
cat "$OUT/environment.txt"
printf '%s\n' "${SUMMARY[@]}"
echo "logs: $OUT"
exit $status
