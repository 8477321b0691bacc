#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for tests and for trying dtlab's SLURM path on a laptop.
#
#   sudo scripts/local_slurm.sh          # install (Debian packages) if missing, configure, start
#   scripts/local_slurm.sh --status      # exit 0 when the cluster answers
#   sudo scripts/local_slurm.sh --stop
#
# Safe to run again while the cluster is up (it then only checks it). No systemd and no cgroups
# are needed: processes are tracked through /proc and tasks are not confined.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE=/var/lib/dtlab-slurm
LOG=/var/log/dtlab-slurm

alive() {  # a pid from a pid file, running and not a zombie (a zombie still passes kill -0)
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 1
  pid=$(<"$pidfile")
  [[ -r /proc/$pid/status ]] || return 1
  ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status"
}

answers() { timeout 5 sinfo -h -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; }

stop() {  # and wait until they are gone: a restart right after must find their ports free
  local d pidfile pids=()
  for d in slurmd slurmctld munged; do
    pidfile=/run/dtlab-$d.pid
    [[ $d == munged ]] && pidfile=/run/munge/munged.pid
    if alive "$pidfile"; then pids+=("$(<"$pidfile")"); kill "${pids[-1]}" || true; fi
  done
  for _ in $(seq 1 100); do
    local left=0
    for pid in "${pids[@]}"; do
      [[ -r /proc/$pid/status ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" && left=1
    done
    (( left )) || return 0
    sleep 0.1
  done
}

case "${1:-}" in
  --status) answers; exit ;;
  --stop) stop; exit 0 ;;
esac

if alive /run/dtlab-slurmctld.pid && alive /run/dtlab-slurmd.pid && answers; then
  echo "local SLURM is running"; exit 0
fi
if [[ $(id -u) != 0 ]]; then
  echo "local_slurm.sh: starting the daemons needs root (run it with sudo)" >&2; exit 1
fi
# Two starts at once (two test sessions) would race for munged's socket: the second waits here,
# then finds the cluster running.
exec 9>/run/dtlab-slurm.lock
flock 9
if alive /run/dtlab-slurmctld.pid && alive /run/dtlab-slurmd.pid && answers; then
  echo "local SLURM is running"; exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null
fi

stop  # half-started leftovers
mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d" "$LOG" /run/munge /etc/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /etc/munge /var/lib/munge /var/log/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key

cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
# MinJobAge=4: `sbatch --wait` polls after 2 s and multiplies its interval by 4 (to 8, then 32 s)
# while it is under MinJobAge / 2; here it stays at 2 s (an 11 s job returned after 42 s with a
# MinJobAge of 600, after 14 s with 4). Finished jobs are then forgotten after 4 s or more (the
# controller purges once a minute); dtlab's sweep judges a forgotten job by its summary.json and log.
cat > "$CONF_DIR/slurm.conf" <<EOF
# Written by dtlab's scripts/local_slurm.sh: one node, localhost, no cgroups, no accounting.
ClusterName=dtlab
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/dtlab-slurmctld.pid
SlurmdPidFile=/run/dtlab-slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
MinJobAge=4
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

runuser -u munge -- /usr/sbin/munged 9>&-  # the daemons must not inherit (and hold) the lock
slurmctld -c 9>&-  # a fresh start: jobs of an earlier cluster (e.g. a killed test) are not run again
slurmd 9>&-
for _ in $(seq 1 100); do
  if answers; then echo "local SLURM is running ($cpus CPUs)"; exit 0; fi
  sleep 0.2
done
echo "local_slurm.sh: the cluster did not come up; see $LOG/" >&2
exit 1
