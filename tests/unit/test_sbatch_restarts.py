"""slurm/train.sbatch --restarts after a node failure (exit 5): the relaunch leaves out the nodes hpctrain named in
$HPCTRAIN_NODE_FAILURE_FILE and takes a spare. Run by bash with stand-ins for srun and scontrol (no Slurm needed;
tests/integration/test_slurm_restarts.py runs the relaunches on a real Slurm)."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SRUN = """#!/bin/bash
# a probe (srun --overlap ... true) succeeds; the first job step fails on n2's local disk; the second trains
if [[ " $* " == *" --overlap "* ]]; then exit 0; fi
echo "step: $*" >> "$LOG"
if [ ! -e "$LOG.first" ]; then touch "$LOG.first"; echo n2.cluster.example >> "$HPCTRAIN_NODE_FAILURE_FILE"; exit 5; fi
exit 0
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'n1\\nn2\\nn3\\n' ;;
  "show node") echo "NodeName=$4 State=IDLE" ;;
esac
"""


def test_a_node_failure_relaunches_without_the_named_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "steps.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HPCTRAIN_DIR": str(tmp_path), "VIRTUAL_ENV": "x", "LOG": str(log),
           "HPCTRAIN_CHECK": "0", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NUM_NODES": "3", "TMPDIR": str(tmp_path)}
    out = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch"), "--restarts", "1", "--spare-nodes", "1",
                          "--config", "my.toml"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    steps = log.read_text().splitlines()
    assert len(steps) == 2 and "-w n1,n2 " in steps[0] and "-w n1,n3 " in steps[1], steps
    assert "--resume auto" in steps[1]
    assert "relaunch attempt 1/1: step exit 5; excluded: n2; on 2 node(s): n1,n3" in out.stderr, out.stderr
    assert not (tmp_path / "hpctrain-failed-nodes-77").exists()
