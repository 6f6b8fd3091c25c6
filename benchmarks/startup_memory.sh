#!/bin/bash
# Start-up time and memory of a 4-rank data-parallel run, as a user sees them (docs/benchmarks.md, "Parameters
# born sharded"): seconds from mpiexec's start to step 1's line in metrics.jsonl, each rank's resident set
# sampled from outside every 0.25 s, and the run's own lines (build time, peak after step 1, whole-run peak).
#   benchmarks/startup_memory.sh SRC RUNDIR [key=value ...]
# SRC: the checkout whose hpctrain runs (PYTHONPATH; compare two commits with two worktrees); RUNDIR: a new
# directory (refused if it exists: nothing is ever removed); the rest: overrides of configs/tiny.toml
# with tp=pp=1, seq 32, global batch 4 (e.g. model.d_model=1024 ... parallel.zero=3 train.steps=2).
set -u
SRC=$1; RD=$2; shift 2
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [ -e "$RD" ] || [ -e "$RD.log" ]; then echo "startup_memory: $RD or $RD.log exists; give a new directory" >&2; exit 2; fi
elapsed() { awk -v now="$(date +%s.%N)" -v t0="$start" 'BEGIN { printf "%.1f", now - t0 }'; }
export OMP_NUM_THREADS=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 PYTHONPATH=$SRC
start=$(date +%s.%N)
$HERE/.venv/bin/mpiexec -n 4 $HERE/.venv/bin/python -m hpctrain.cli train --config $HERE/configs/tiny.toml parallel.tp=1 parallel.pp=1 parallel.microbatches=1 model.preset=custom model.vocab_size=256 model.max_seq_len=256 train.seq_len=32 train.global_batch=4 train.run_dir=$RD checkpoint.interval=0 "$@" > $RD.log 2>&1 &
pid=$!
maxrss=0; t1=""
while kill -0 $pid 2>/dev/null; do
  for p in $(pgrep -f "run_dir=$RD" | grep -v "^$pid$"); do
    r=$(awk '/VmRSS/{print $2}' /proc/$p/status 2>/dev/null); [ -n "$r" ] && [ "$r" -gt "$maxrss" ] && maxrss=$r
  done
  if [ -z "$t1" ] && [ -f $RD/metrics.jsonl ] && grep -q '"step": 1' $RD/metrics.jsonl; then t1=$(elapsed); fi
  sleep 0.25
done
wait $pid; rc=$?
echo "rc=$rc t_step1=${t1}s sampled_max_rss_per_rank=$((maxrss/1024))MiB total=$(elapsed)s"
grep -E "^done:|model state|memory per rank|build" $RD.log | cut -c1-250
