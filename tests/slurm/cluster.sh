#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for `make test-slurm` (tests/slurm/conftest.py):
# munged and slurmctld in the root network namespace on a bridge address, and two slurmd,
# each in its own network namespace joined to the bridge by a veth pair.
#
#   tests/slurm/cluster.sh up DIR     # start; DIR holds slurm.conf, logs, spool, state
#   tests/slurm/cluster.sh down DIR   # stop everything it started, remove the namespaces
#
# Everything listens on the bridge's 10.77.0.0/24 addresses only; every wait is bounded.
set -euo pipefail

ACTION=${1:?up or down}
DIR=$(realpath -m "${2:?a state directory}")
PREFIX=rsl  # names of the bridge, veths and namespaces
BRIDGE=${PREFIX}br0
CTL_ADDR=10.77.0.1
NODES=(node1 node2)
ADDRS=(10.77.0.11 10.77.0.12)

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2
    shift 2
    for _ in $(seq 1 $((limit * 10))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    echo "cluster: timed out after ${limit}s waiting for ${what}" >&2
    return 1
}

down() {
    for pidfile in "$DIR"/run/*.pid; do
        [ -e "$pidfile" ] || continue
        kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 0.5
    for pidfile in "$DIR"/run/*.pid; do
        [ -e "$pidfile" ] || continue
        kill -9 "$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
    for i in "${!NODES[@]}"; do
        ip netns pids "${PREFIX}${i}" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "${PREFIX}${i}" 2>/dev/null || true
        ip link del "${PREFIX}h${i}" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    sed -i "/# runner-slurm-test$/d" /etc/hosts
}

up() {
    for tool in munged slurmctld slurmd sbatch ip; do
        command -v "$tool" >/dev/null || { echo "cluster: $tool is not installed" >&2; exit 3; }
    done
    mkdir -p "$DIR"/{run,log,spool,state,munge,jobs}
    chown slurm:slurm "$DIR"/state "$DIR"/log
    chmod 755 "$DIR" "$DIR"/run "$DIR"/log

    ip link add "$BRIDGE" type bridge
    ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in "${!NODES[@]}"; do
        ns="${PREFIX}${i}"
        ip netns add "$ns"
        ip link add "${PREFIX}h${i}" type veth peer name eth0 netns "$ns"
        ip link set "${PREFIX}h${i}" master "$BRIDGE" up
        ip -n "$ns" addr add "${ADDRS[$i]}/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done

    for i in "${!NODES[@]}"; do  # node names resolve as on a cluster with DNS
        echo "${ADDRS[$i]} ${NODES[$i]} # runner-slurm-test" >>/etc/hosts
    done

    chown munge:munge "$DIR"/munge
    runuser -u munge -- /usr/sbin/munged --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log"
    cp "$DIR/munge/munged.pid" "$DIR/run/munged.pid"

    # every core of the machine: nproc honours OMP_NUM_THREADS, which the suite sets to 1
    local cpus
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    local nodelines=""
    for i in "${!NODES[@]}"; do
        nodelines+="NodeName=${NODES[$i]} NodeAddr=${ADDRS[$i]} CPUs=$cpus State=UNKNOWN"$'\n'
    done
    cat >"$DIR/slurm.conf" <<EOF
ClusterName=runner
SlurmctldHost=$(hostname -s)($CTL_ADDR)
MailProg=/bin/true
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
# cred_expire: a requeued job may start again after it + 1 s (SLURM's default: 120 s)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
KillWait=5
$nodelines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$DIR/slurm.conf"
    slurmctld -f "$SLURM_CONF"
    wait_for 20 "slurmctld" scontrol ping
    for i in "${!NODES[@]}"; do
        mkdir -p "$DIR/spool/${NODES[$i]}"
        # nsenter, not ip netns exec: that remounts /sys, hiding the cgroup tree slurmd reads.
        # Its own UTS namespace: processes on the node see its name as their host name.
        nsenter --net="/run/netns/${PREFIX}${i}" unshare --uts sh -c \
            "hostname ${NODES[$i]} && exec slurmd -f '$SLURM_CONF' -N ${NODES[$i]}"
    done
    wait_for 30 "both nodes idle" bash -c \
        "[ \$(sinfo -h -N -t idle -o %N | sort -u | wc -l) -eq ${#NODES[@]} ]"
    echo "cluster: up (SLURM_CONF=$SLURM_CONF)"
}

case "$ACTION" in
    up) down; up ;;
    down) down ;;
    *) echo "usage: $0 up|down DIR" >&2; exit 2 ;;
esac
