#!/bin/bash
# Stop the test Slurm started by slurm_up.sh: only the processes whose pid files it wrote.
D=${SLURM_TEST_DIR:-/tmp/hpctrain-slurm}
for f in "$D"/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
sleep 0.5
exit 0
