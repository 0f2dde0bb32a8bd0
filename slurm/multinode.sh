#!/usr/bin/env bash
# mlm_ddp on several Slurm nodes: one `accelerate launch` per node, one DDP process group across all.
#
#   cd /path/to/mlm_ddp && sbatch slurm/multinode.sh [mlm_ddp.train flags]
#   e.g. sbatch slurm/multinode.sh --config recipe.yaml --max_train_steps 1000 --checkpointing_steps 200
#
# Edit the #SBATCH lines for your cluster (and nothing else). With GPUs, one process per GPU of a node
# (--gpus-per-node); without, PROCS_PER_NODE CPU processes per node (default 1) over gloo.
# CPUs: each node runs one task, the launcher, and it gets every CPU the job holds on that node; its
# processes share them, each with an equal share of threads (OMP_NUM_THREADS, at least 1). So request
# CPUs per node, not per process: --cpus-per-task=2 suits the CPU default (one process per node); on a
# GPU node request its cores, with --exclusive (the whole node) or --cpus-per-task=<cores> (to share
# it): one per GPU process at least, plus its --dataloader_num_workers. Not --cpus-per-gpu: the script
# passes srun --cpus-per-task, which srun does not combine with it.
# Preemption or the time limit: Slurm sends USR1 to this script 120 s early (--signal); every process
# finishes its step, all save one checkpoint, and the job requeues itself. The requeued job resumes
# from that checkpoint (--resume_from_checkpoint auto), so no step is lost or repeated. The save has
# 30 s, not 120: the script passes SIGTERM on at once, and torchrun (inside accelerate launch) kills
# its workers 30 s after its own SIGTERM.
# scancel: Slurm itself sends SIGTERM to every process, which saves one checkpoint, and SIGKILL after
# KillWait (slurm.conf, default 30 s); the job ends CANCELLED and is not requeued.
# --overwrite_output_dir is refused: every attempt resumes --output_dir, so none may erase it.
#
#SBATCH --job-name=mlm_ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
##SBATCH --gpus-per-node=8
##SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=mlm_ddp-%j.out
#SBATCH --error=mlm_ddp-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
set -euo pipefail

die() { echo "slurm/multinode.sh: error: $*" >&2; exit 2; }

[[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_JOB_NODELIST:-} && -n ${SLURM_NNODES:-} ]] ||
    die "not inside a Slurm allocation (no SLURM_JOB_ID / SLURM_JOB_NODELIST): submit with sbatch slurm/multinode.sh"
command -v scontrol >/dev/null || die "scontrol not found: this script runs on a Slurm cluster"
cd "${SLURM_SUBMIT_DIR:-.}"
config=${ACCELERATE_CONFIG:-accelerate_configs/multi_node.yaml}
[[ -f $config ]] || die "$config not found: submit from the mlm_ddp folder, or export ACCELERATE_CONFIG"

# The flags are checked once, here, before any node starts: a bad one is one line, not one per rank.
# Every attempt of this job, requeues included, resumes --output_dir (--resume_from_checkpoint auto
# below), so --overwrite_output_dir is refused rather than allowed to erase a requeued job's
# checkpoints.
python -c '
import sys
from mlm_ddp.config import parse_args
from mlm_ddp.errors import BadInput
try:
    out = parse_args(sys.argv[1:]).run
except BadInput as err:
    sys.exit(f"slurm/multinode.sh: error: {err}")
if out.overwrite_output_dir:
    sys.exit(f"slurm/multinode.sh: error: --overwrite_output_dir: every attempt of this job, requeues included, "
             f"resumes --output_dir {out.output_dir} (--resume_from_checkpoint auto), so it cannot erase it; "
             f"remove {out.output_dir} yourself or choose another --output_dir, and submit without "
             "--overwrite_output_dir")
' --resume_from_checkpoint auto "$@" || exit 2

# One rendezvous for all nodes: the first node's address and a port derived from the job id
# (mlm_ddp.cluster.launcher.slurm_master_port computes the same number). This script runs on the first
# node, where the master listens: if another program holds that port, take the next free one.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
[[ -n $MASTER_ADDR ]] || die "scontrol expanded the node list '$SLURM_JOB_NODELIST' to nothing"
job_port=$((15000 + SLURM_JOB_ID % 15000))
MASTER_PORT=$(python -c '
import socket, sys
first = int(sys.argv[1])
for port in range(first, first + 100):
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            continue
        print(port)
        break
' "$job_port")
[[ -n $MASTER_PORT ]] || die "ports $job_port-$((job_port + 99)) are all taken on $(hostname): free one of them"
if ((MASTER_PORT != job_port)); then
    echo "mlm_ddp: port $job_port (15000 + job id % 15000) is taken on $(hostname); using $MASTER_PORT," \
         "the next free one"
fi
if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    PROCS_PER_NODE=$SLURM_GPUS_ON_NODE
else
    PROCS_PER_NODE=${PROCS_PER_NODE:-1}
    export ACCELERATE_USE_CPU=true
fi
[[ $PROCS_PER_NODE =~ ^[1-9][0-9]*$ ]] ||
    die "PROCS_PER_NODE='$PROCS_PER_NODE': processes per node must be a whole number, at least 1 (export PROCS_PER_NODE=2)"

# The CPUs of each node's launcher task: every CPU the job holds on a node, the fewest where nodes
# differ (SLURM_JOB_CPUS_PER_NODE reads e.g. "72(x2),36"). They go to srun explicitly: since Slurm 22.05
# srun no longer inherits sbatch's --cpus-per-task ("srun will no longer read in SLURM_CPUS_PER_TASK",
# release notes of 22.05, https://slurm.schedmd.com/news.html; sbatch(1), --cpus-per-task: "It must be
# requested again with the call to srun"). Each process gets an equal share as threads: accelerate
# launch exports it as OMP_NUM_THREADS, where torch and the data loaders start from (left alone, it
# exports the submitter's OMP_NUM_THREADS, else 1).
job_cpus=${SLURM_JOB_CPUS_PER_NODE:-}
CPUS_PER_TASK=0
for cpus in ${job_cpus//,/ }; do
    cpus=${cpus%%(*}
    if [[ $cpus =~ ^[1-9][0-9]*$ ]] && ((CPUS_PER_TASK == 0 || cpus < CPUS_PER_TASK)); then
        CPUS_PER_TASK=$cpus
    fi
done
((CPUS_PER_TASK > 0)) || CPUS_PER_TASK=${SLURM_CPUS_ON_NODE:-${SLURM_CPUS_PER_TASK:-1}}
THREADS_PER_PROCESS=$((CPUS_PER_TASK / PROCS_PER_NODE))
((THREADS_PER_PROCESS >= 1)) || THREADS_PER_PROCESS=1
export MASTER_ADDR MASTER_PORT PROCS_PER_NODE THREADS_PER_PROCESS config
echo "mlm_ddp: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES node(s) x $PROCS_PER_NODE" \
     "process(es), master $MASTER_ADDR:$MASTER_PORT"
echo "mlm_ddp: $CPUS_PER_TASK CPU(s) per task (one task per node: srun --cpus-per-task=$CPUS_PER_TASK)," \
     "$PROCS_PER_NODE process(es) per node, $THREADS_PER_PROCESS thread(s) per process"
if ((CPUS_PER_TASK < PROCS_PER_NODE)); then
    echo "mlm_ddp: warning: $CPUS_PER_TASK CPU(s) for the $PROCS_PER_NODE process(es) of each node: they and their" \
         "data loaders share cores; request the node's cores (#SBATCH --exclusive, or --cpus-per-task)"
fi

# On the warning (USR1), SIGTERM goes to every process of the step (scancel --signal does not cancel
# it; signalling srun would): the training processes agree at the next step boundary, save one
# checkpoint and exit 75. The launchers also get SIGTERM and give them 30 s (torchrun's shutdown
# grace) before SIGKILL, so a checkpoint must save within that, whatever --signal's lead time.
# SIGTERM to this script is not a warning: scancel sends it (so does Slurm ending or requeueing the job
# itself), to every process of the step as well, so they save by themselves; requeueing from here
# would bring a cancelled job back.
preempted=0
cancelled=0
# shellcheck disable=SC2317,SC2329  # called by the trap
on_warning() {
    preempted=1
    echo "mlm_ddp: preemption warning: asking every process to save a checkpoint"
    scancel --signal=TERM "$SLURM_JOB_ID.0" || true  # step 0: the srun below, this script's only step
}
# shellcheck disable=SC2317,SC2329  # called by the trap
on_cancel() {
    cancelled=1
    echo "mlm_ddp: SIGTERM from Slurm (scancel, or the job ending): every process saves a checkpoint;" \
         "not requeueing"
}
trap on_warning USR1
trap on_cancel TERM

# Each gloo group costs every process (processes + 3) file descriptors: at 64 nodes x 8, two groups
# pass the common soft limit of 1024 (docs/scale.md). srun passes this limit on to the tasks.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# One task per node runs accelerate launch (exec: the task is the launcher) with the node's CPUs;
# $SLURM_NODEID is expanded inside the step, on each node. The static rendezvous ranks each node by its
# Slurm node id for the whole job, so the c10d rendezvous' split store (an elastic node range whose
# rank-0 node is lost, docs/scale.md) cannot happen here and TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not needed.
# shellcheck disable=SC2016  # expanded by the inner bash, on each node
srun --kill-on-bad-exit=0 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" \
    bash -c 'exec accelerate launch --config_file "$config" \
    --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
    --num_processes $((SLURM_NNODES * PROCS_PER_NODE)) --num_cpu_threads_per_process "$THREADS_PER_PROCESS" \
    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" --rdzv_backend static \
    -m mlm_ddp.train --resume_from_checkpoint auto "$@"' bash "$@" &
step_pid=$!
status=0
# `wait` returns early when a trapped signal arrives; wait again until the step has really ended
while true; do
    wait "$step_pid" && status=0 || status=$?
    kill -0 "$step_pid" 2>/dev/null || break
done

if ((preempted && !cancelled)); then
    echo "mlm_ddp: checkpoint saved; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
