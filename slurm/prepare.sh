#!/usr/bin/env bash
# Tokenize and pack a large corpus once, as a Slurm job array: task i of N takes its share of the input
# files (balanced by bytes), on every core its node gives it, and writes its own part with a marker.
#
#   cd /path/to/mlm_ddp && sbatch --array=0-7 slurm/prepare.sh --train_file /data/corpus/ \
#       --output_dir /data/prepared --model_name_or_path /models/bert --max_seq_length 128
#
# Every task of the array runs the same command; mlm_ddp.prepare reads its index and the array's size
# from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT. The task that finds every part complete writes
# manifest.json, and training reads the folder with --prepared_data /data/prepared. If tasks die (a
# node lost, the time limit), submit the same command again: tasks whose part has its marker end at
# once, the others are redone from their start, and a part without its marker is never read.
# The output folder must be shared by the nodes (as checkpoints need anyway).
#
#SBATCH --job-name=mlm_ddp-prepare
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=12:00:00
#SBATCH --output=mlm_ddp-prepare-%A_%a.out
#SBATCH --error=mlm_ddp-prepare-%A_%a.out
set -euo pipefail

[[ -n ${SLURM_ARRAY_TASK_ID:-} && -n ${SLURM_SUBMIT_DIR:-} ]] || {
    echo "slurm/prepare.sh: error: not a task of a Slurm job array (no SLURM_ARRAY_TASK_ID): submit with sbatch --array=0-N slurm/prepare.sh" >&2
    exit 2
}
cd "$SLURM_SUBMIT_DIR"
# one tokenizing process per CPU this task holds (the default counts the cores it may run on)
exec python -m mlm_ddp.prepare --num_workers "${SLURM_CPUS_PER_TASK:-1}" "$@"
