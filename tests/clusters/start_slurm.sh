#!/usr/bin/env bash
# Start a one-node SLURM cluster on this machine from Debian's slurm-wlm (munged, slurmctld,
# slurmd), as root; print the SLURM_CONF that srun needs. Rerun: it reuses a cluster that answers.
#   export SLURM_CONF=$(tests/clusters/start_slurm.sh) && srun -n 2 hostname
set -euo pipefail
dir=${1:-/tmp/jax-dp-slurm}
conf=$dir/slurm.conf
fail() { echo "start_slurm: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || fail "needs root (it starts munged, slurmctld and slurmd)"
for daemon in munged slurmctld slurmd; do
  command -v $daemon >/dev/null || [ -x /usr/sbin/$daemon ] \
    || fail "$daemon not found: apt-get install slurm-wlm (Debian or Ubuntu)"
done
export PATH=$PATH:/usr/sbin
alive() { [ -e "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ -e "$conf" ] && alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" \
    && SLURM_CONF=$conf timeout 5 sinfo -h -o %T 2>/dev/null | grep -qxE 'idle|mixed|allocated'; then
  echo "$conf"; exit 0
fi
mkdir -p "$dir/state" "$dir/spool" /run/munge
chown munge:munge /run/munge
pgrep -x munged >/dev/null || munged --force 2>>"$dir/munged.log"
host=$(hostname -s)
cpus=$(nproc)
mem=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
cat > "$conf" <<CONF
ClusterName=jaxdp
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF=$conf
for pid in "$dir/slurmctld.pid" "$dir/slurmd.pid"; do  # This cluster's own, if left.
  [ -e "$pid" ] && kill "$(cat "$pid")" 2>/dev/null && sleep 1 || true
done
slurmctld -c -f "$conf"
slurmd -f "$conf"
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qx idle; then echo "$conf"; exit 0; fi
  sleep 1
done
fail "the cluster did not come up within 60 s: see $dir/slurmctld.log and $dir/slurmd.log"
