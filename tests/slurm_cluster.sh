#!/usr/bin/env bash
# A real Slurm cluster on this one machine for the tests: one slurmctld and two slurmd, nodes n1 and
# n2, each slurmd in its own UTS + mount namespace so that jobs see `hostname` = n1 / n2.
#
#   tests/slurm_cluster.sh start STATE_DIR   # installs slurm-wlm + munge if missing (root, apt-get)
#   tests/slurm_cluster.sh stop STATE_DIR    # stops exactly what start started
#
# Every client (sbatch, srun, scontrol, ...) and job must see SLURM_CONF=STATE_DIR/slurm.conf: the
# cluster never touches /etc/slurm. Facts behind each setting: ../shared/SLURM.md of the project.
set -euo pipefail

cmd=${1:?usage: slurm_cluster.sh start|stop STATE_DIR}
state=$(realpath -m "${2:?usage: slurm_cluster.sh start|stop STATE_DIR}")
ctld_port=17817
export SLURM_CONF="$state/slurm.conf"

alive() {  # pid file -> true if that process runs and is not a zombie (PID 1 here does not reap)
    local pid
    [[ -f $1 ]] || return 1
    pid=$(<"$1")
    [[ $(ps -o stat= -p "$pid" 2>/dev/null) =~ ^[^Z] ]]
}

stop_pid() {
    local file=$1
    alive "$file" || return 0
    kill "$(<"$file")" 2>/dev/null || true
    for _ in $(seq 50); do alive "$file" || return 0; sleep 0.1; done
    kill -9 "$(<"$file")" 2>/dev/null || true
}

start() {
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        [[ $(id -u) == 0 ]] || { echo "slurm_cluster: slurm-wlm is not installed and we are not root" >&2; exit 3; }
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
    # a fresh state folder: otherwise slurmctld restores and reruns the jobs of an earlier start
    rm -rf "$state"
    mkdir -p "$state/ctld"

    # munge authenticates every message; reuse one that runs, else start ours (and stop it later)
    if [[ ! -f /etc/munge/munge.key ]]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    fi
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        # munged (user munge) may not enter the state folder: its pid file lives in /run/munge
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/mlm_ddp-test.pid
        for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
        cp /run/munge/mlm_ddp-test.pid "$state/munged.pid"
    fi

    cat >"$SLURM_CONF" <<EOF
ClusterName=mlmddp
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmctldPidFile=$state/slurmctld.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdSpoolDir=$state/spool-%n
SlurmdPidFile=$state/slurmd-%n.pid
SlurmdLogFile=$state/slurmd-%n.log
# both "nodes" share this machine's cores and memory
SlurmdParameters=config_overrides
# the cgroup plugins do not work in this sandbox
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobRequeue=1
ReturnToService=2
# a requeued job may start once its credential expired: 5 s instead of 120 s
AuthInfo=cred_expire=5
# pending and requeued jobs start within seconds
SchedulerParameters=bf_interval=1,sched_interval=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=30
NodeName=n1 NodeAddr=127.0.0.1 Port=17001 CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=17002 CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
EOF
    # inside the jobs, n1 and n2 resolve
    { cat /etc/hosts; echo "127.0.0.1 n1 n2"; } >"$state/hosts"

    slurmctld
    for node in n1 n2; do
        unshare --mount --uts bash -c \
            "hostname $node && mount --bind '$state/hosts' /etc/hosts && exec slurmd -N $node"
    done
    for _ in $(seq 600); do
        idle=$(sinfo -h -N -r -t idle -o %N 2>/dev/null | sort -u | tr '\n' ' ')
        [[ $idle == "n1 n2 " ]] && { echo "slurm cluster up: n1 n2 (SLURM_CONF=$SLURM_CONF)"; return 0; }
        sleep 0.1
    done
    echo "slurm_cluster: nodes not idle after 60 s; see $state/slurmctld.log, $state/slurmd-n1.log" >&2
    exit 1
}

stop() {
    [[ -f $SLURM_CONF ]] || return 0
    # cancel our jobs first, or their tasks outlive slurmd
    if alive "$state/slurmctld.pid"; then
        scancel --partition=test 2>/dev/null || true
        sleep 1
    fi
    stop_pid "$state/slurmd-n2.pid"
    stop_pid "$state/slurmd-n1.pid"
    stop_pid "$state/slurmctld.pid"
    stop_pid "$state/munged.pid"  # only exists if we started munged
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) echo "usage: slurm_cluster.sh start|stop STATE_DIR" >&2; exit 2 ;;
esac
