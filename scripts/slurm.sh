#!/usr/bin/env bash
# A one-node Slurm on this machine, for `scheduler: slurm` and the tests marked `slurm`.
#
#   scripts/slurm.sh install   # apt: slurm-wlm + munge; write the config; then start
#   scripts/slurm.sh start     # start munged, slurmctld, slurmd (no systemd); PIDs in $RUN
#   scripts/slurm.sh stop      # stop the daemons this script started, by their PID files
#   scripts/slurm.sh status    # which of them run
#
# Debian's Slurm 22.05 without systemd or cgroups: ProctrackType=proctrack/linuxproc,
# TaskPlugin=task/none, the node named `hostname -s`. Two fake GPUs (gres gpu:2): Slurm
# accepts GPU files only when they are character devices, so they are made with
# `mknod c 1 3` (the same device as /dev/null); each job then gets its own
# CUDA_VISIBLE_DEVICES. Needs root (apt, /etc/slurm, the devices).
set -euo pipefail

RUN=${PIPE_SLURM_RUN:-/run/pipe-slurm}
STATE=${PIPE_SLURM_STATE:-/var/lib/pipe-slurm}
CONF=/etc/slurm/slurm.conf
GPUS=${PIPE_SLURM_GPUS:-2}
NODE=$(hostname -s)

log() { echo "slurm.sh: $*" >&2; }

write_config() {
    local cpus mem_mb
    cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc: it obeys OMP_NUM_THREADS, which make exports as 1
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$RUN"
    for i in $(seq 0 $((GPUS - 1))); do
        [ -c "/dev/pipe-gpu$i" ] || { rm -f "/dev/pipe-gpu$i"; mknod "/dev/pipe-gpu$i" c 1 3; }
    done
    cat >"$CONF" <<EOF
# written by pipe's scripts/slurm.sh: one node, $GPUS fake GPUs, no systemd, no cgroups
ClusterName=pipe
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$RUN/slurmctld.log
SlurmdLogFile=$RUN/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
GresTypes=gpu
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=30
NodeName=$NODE CPUs=$cpus RealMemory=$mem_mb Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=1-00:00:00 State=UP
EOF
    local last=$((GPUS - 1))
    echo "NodeName=$NODE Name=gpu File=/dev/pipe-gpu[0-$last]" >/etc/slurm/gres.conf
    log "wrote $CONF and /etc/slurm/gres.conf (node $NODE, $cpus CPUs, gpu:$GPUS)"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS COMMAND...: poll COMMAND until it succeeds, at most SECONDS
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || return 1
        sleep 0.2
    done
}

start() {
    [ -f "$CONF" ] || write_config
    mkdir -p "$RUN" "$STATE/ctld" "$STATE/d" /run/munge
    chown munge:munge /run/munge 2>/dev/null || true
    if ! alive "$RUN/munged.pid"; then
        [ -f /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
        chown munge:munge /etc/munge/munge.key
        runuser -u munge -- munged --pid-file=/run/munge/munged.pid
        wait_for 10 test -s /run/munge/munged.pid
        cp /run/munge/munged.pid "$RUN/munged.pid"
    fi
    if ! alive "$RUN/slurmctld.pid"; then
        slurmctld -f "$CONF"
        wait_for 20 test -s "$RUN/slurmctld.pid"
    fi
    if ! alive "$RUN/slurmd.pid"; then
        slurmd -f "$CONF"
        wait_for 20 test -s "$RUN/slurmd.pid"
    fi
    wait_for 30 node_up || { log "node $NODE did not come up: $(sinfo -h -N -o '%T %E' 2>&1)"; exit 1; }
    log "up: $(sinfo -h -N -o '%N %T %G')"
}

node_up() { sinfo -h -N -o '%T' | grep -qE '^(idle|mixed|allocated)'; }

stop() {
    local name pid
    for name in slurmd slurmctld munged; do
        alive "$RUN/$name.pid" || { rm -f "$RUN/$name.pid"; continue; }
        pid=$(cat "$RUN/$name.pid")
        kill "$pid"
        wait_for 20 bash -c "! kill -0 $pid" || { log "$name ($pid) still runs; killing it"; kill -9 "$pid"; }
        rm -f "$RUN/$name.pid"
        log "stopped $name ($pid)"
    done
}

status() {
    local name
    for name in munged slurmctld slurmd; do
        if alive "$RUN/$name.pid"; then echo "$name: running ($(cat "$RUN/$name.pid"))"; else echo "$name: stopped"; fi
    done
}

case "${1:-}" in
    install)
        if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
        fi
        write_config
        start
        ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
