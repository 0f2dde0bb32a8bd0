#!/usr/bin/env bash
# mlm_ddp on one Slurm node: all its GPUs (--gpus-per-node), or PROCS_PER_NODE CPU processes.
#
#   cd /path/to/mlm_ddp && sbatch slurm/singlenode.sh [mlm_ddp.train flags]
#
# Edit the #SBATCH lines for your cluster. The launch, preemption and requeue logic is multinode.sh's,
# run here with one node (see that file). CPUs: the node's launcher gets every CPU the job holds and
# gives each process an equal share of threads, so on a GPU node request its cores: --exclusive (the
# whole node) or --cpus-per-task=<cores>; 2 suits the CPU default (one process).
#
#SBATCH --job-name=mlm_ddp
#SBATCH --nodes=1
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

[[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_SUBMIT_DIR:-} ]] || {
    echo "slurm/singlenode.sh: error: not inside a Slurm allocation (no SLURM_JOB_ID): submit with sbatch slurm/singlenode.sh" >&2
    exit 2
}
# sbatch runs a copy of this file, so multinode.sh is found from the submit folder
exec bash "$SLURM_SUBMIT_DIR/slurm/multinode.sh" "$@"
