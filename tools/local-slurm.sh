#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for the tests, CI and trying the Slurm path.
#
#   tools/local-slurm.sh start    install (apt, once), configure and start munged, slurmctld and
#                                 one slurmd per virtual node; idempotent (a healthy cluster
#                                 is left alone, a broken one is restarted)
#   tools/local-slurm.sh stop     stop every daemon it started
#   tools/local-slurm.sh status   exit 0 when every virtual node answers, else 1
#
# Partitions gpu-a100, gpu-h100 and cpu have NODES_PER_PARTITION virtual nodes each: a
# heterogeneous job never starts on one node (only the backfill scheduler starts hetjobs and
# it reserves whole nodes, one per component), so the virtual nodes are slurmd processes
# (Debian's Slurm is built with MULTIPLE_SLURMD) on ports 17101.. of this host. The virtual
# nodes claim CPUS_PER_NODE CPUs each whatever the host has (config_overrides); no GPUs.
# Needs root (daemons, apt). Logs: /var/log/slurm/.
set -euo pipefail

NODES_PER_PARTITION=${NODES_PER_PARTITION:-2}
CPUS_PER_NODE=${CPUS_PER_NODE:-16}
PARTITIONS=(gpu-a100 gpu-h100 cpu)
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
HOST=$(hostname -s)

die() { echo "local-slurm: $*" >&2; exit 1; }

# state letter of a live (not zombie) process, empty if gone: PID 1 here reaps late
alive() { local s; s=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true); [[ -n "$s" && "$s" != Z ]]; }
# the pid in file $1 names a live process called $2 (a stale file's pid may name another one)
pid_alive() { local p; [[ -f "$1" ]] && p=$(cat "$1") && alive "$p" && [[ $(cat "/proc/$p/comm" 2>/dev/null) == "$2" ]]; }
# the daemon a pid file of this script belongs to: slurmd-<node>.pid -> slurmd
daemon_of() { local b=${1##*/}; b=${b%.pid}; echo "${b%%-*}"; }

node_names() {
  local p i
  for p in "${PARTITIONS[@]}"; do
    for ((i = 1; i <= NODES_PER_PARTITION; i++)); do echo "$p-$i"; done
  done
}

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v srun >/dev/null && return
  [[ $(id -u) == 0 ]] || die "Slurm is not installed and this is not root: install slurmctld slurmd slurm-client munge"
  echo "local-slurm: installing slurm and munge (apt)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge libpmix-dev >/dev/null
}

write_conf() {
  mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
  local tmp port=17101 p nodes
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# written by tools/local-slurm.sh: a one-machine cluster with virtual nodes
ClusterName=astraflow-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MailProg=/bin/true
TmpFS=/tmp/slurm-%n
SlurmdSpoolDir=/var/spool/slurmd/%n
StateSaveLocation=/var/spool/slurmctld
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
ReturnToService=2
MpiDefault=pmi2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
EOF
  for p in "${PARTITIONS[@]}"; do
    echo "NodeName=$p-[1-$NODES_PER_PARTITION] NodeHostname=$HOST NodeAddr=127.0.0.1" \
      "Port=[$port-$((port + NODES_PER_PARTITION - 1))] CPUs=$CPUS_PER_NODE RealMemory=16000 State=UNKNOWN" >>"$tmp"
    port=$((port + NODES_PER_PARTITION))
  done
  for p in "${PARTITIONS[@]}"; do
    nodes="$p-[1-$NODES_PER_PARTITION]"
    echo "PartitionName=$p Nodes=$nodes MaxTime=INFINITE State=UP OverSubscribe=YES$([[ $p == cpu ]] && echo ' Default=YES')" >>"$tmp"
  done
  if [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; then rm -f "$tmp"; return 1; fi
  mv "$tmp" "$CONF"
  chmod 644 "$CONF"
  return 0
}

# Runs a daemon with no descriptor of the caller's but stdin/out/err: munged keeps what it
# inherits, so a lock held by whoever started the cluster (`flock LOCK make test`) would stay
# held for as long as munged lives.
without_inherited_fds() {
  local fd
  for fd in /proc/$BASHPID/fd/*; do
    fd=${fd##*/}
    ((fd > 2)) && eval "exec $fd>&-"
  done 2>/dev/null
  "$@"
}

# munged answers when a credential it encodes also decodes: a pid file proves nothing (a
# snapshot of this machine may carry one whose pid now names another process, and munged
# can be stopped by whoever installed it moments after it started).
munge_answers() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    head -c 128 /dev/urandom >/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 600 /etc/munge/munge.key
  fi
  munge_answers && return
  local pid_file=/run/munge/munged.pid try
  if pid_alive "$pid_file" munged; then
    kill "$(cat "$pid_file")" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$pid_file"
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  for try in 1 2 3; do
    (without_inherited_fds runuser -u munge -- /usr/sbin/munged --force) || true
    for _ in $(seq 50); do munge_answers && return; sleep 0.1; done
    echo "local-slurm: munged does not answer (try $try of 3)" >&2
  done
  { tail -n 20 /var/log/munge/munged.log; ls -la /run/munge; pgrep -a munged; } >&2 2>/dev/null || true
  die "munged did not start; see /var/log/munge/munged.log"
}

healthy() {
  munge_answers || return 1
  pid_alive /run/slurmctld.pid slurmctld || return 1
  local n
  for n in $(node_names); do pid_alive "/run/slurmd-$n.pid" slurmd || return 1; done
  local states  # sinfo must answer: a failing one printed nothing, which once passed for "no node down"
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
  ! grep -Eq ' (down|drain|unk|fail)' <<<"$states"
}

stop() {
  local f
  for f in /run/slurmd-*.pid /run/slurmctld.pid; do
    pid_alive "$f" "$(daemon_of "$f")" && kill "$(cat "$f")" 2>/dev/null || true
  done
  for _ in $(seq 50); do
    local left=0
    for f in /run/slurmd-*.pid /run/slurmctld.pid; do pid_alive "$f" "$(daemon_of "$f")" && left=1; done
    ((left == 0)) && break
    sleep 0.1
  done
  rm -f /run/slurmd-*.pid /run/slurmctld.pid
}

start() {
  install
  local changed=0
  write_conf && changed=1
  start_munge
  if ((changed == 0)) && healthy; then echo "local-slurm: running ($(node_names | wc -l) nodes)"; return; fi
  stop
  local n
  slurmctld -i
  for n in $(node_names); do
    mkdir -p "/var/spool/slurmd/$n" "/tmp/slurm-$n"
    slurmd -N "$n"
  done
  for _ in $(seq 100); do
    if healthy && [[ $(sinfo -h -N -t idle,mix,alloc -o '%N' 2>/dev/null | sort -u | wc -l) == $(node_names | wc -l) ]]; then
      echo "local-slurm: started ($(node_names | wc -l) nodes: ${PARTITIONS[*]})"
      return
    fi
    sleep 0.2
  done
  sinfo -N >&2 || true
  die "nodes did not come up; see $LOG_DIR/"
}

case "${1:-}" in
  start) start ;;
  stop) stop; echo "local-slurm: stopped" ;;
  status) healthy && { sinfo; exit 0; } || { echo "local-slurm: not running" >&2; exit 1; } ;;
  *) die "usage: $0 start|stop|status" ;;
esac
