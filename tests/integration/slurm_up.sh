#!/bin/bash
# A throwaway single-host Slurm "cluster" for tests: slurmctld + two slurmd (nodes n1, n2, 4 CPUs each)
# on 127.0.0.1, config and state under $SLURM_TEST_DIR (nothing in /etc). Installs slurm + munge from
# Debian if missing (root). Prints `export SLURM_CONF=...`. Stop with slurm_down.sh.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
D=${SLURM_TEST_DIR:-/tmp/hpctrain-slurm}
export SLURM_CONF=$D/slurm.conf
if ! command -v slurmctld >/dev/null; then
  apt-get update -qq
  apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
bash "$(dirname "$0")/slurm_down.sh" >/dev/null 2>&1 || true
rm -rf "$D"; mkdir -p "$D"/{state,spool,log}
# free ports for slurmctld and the two slurmd, so another Slurm on this host cannot collide with this one
read -r CTLD_PORT N1_PORT N2_PORT < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])')
cat > "$SLURM_CONF" <<CONF
ClusterName=hpctrain-test
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
MpiDefault=pmi2
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=300
# fresh job ids per instance: MPICH names its shared-memory segments after jobid.stepid, and a task that
# was killed leaves its segment behind, which a later job with the same id would attach to
FirstJobId=$(( (RANDOM << 15 | RANDOM) % 50000000 + 1000 ))
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$N1_PORT CPUs=4 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$N2_PORT CPUs=4 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
install -d -o munge -g munge /run/munge
[ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey -c
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
slurmctld
slurmd -N n1
slurmd -N n2
sleep 0.5
for f in "$D/slurmctld.pid" "$D/slurmd-n1.pid" "$D/slurmd-n2.pid"; do
  [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null || { echo "slurm_up: a daemon did not start ($f); logs in $D/log" >&2; exit 1; }
done
for i in $(seq 1 150); do
  [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | wc -l)" = 2 ] && break; sleep 0.2
done
[ "$(sinfo -h -N -t idle -o %N | wc -l)" = 2 ] || { echo "slurm nodes did not become idle" >&2; sinfo -N >&2; exit 1; }
echo "export SLURM_CONF=$SLURM_CONF"
