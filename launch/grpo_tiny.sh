#!/bin/bash
# The same code path as grpo_70b.sh with the tiny model, on CPU-only nodes (no GPUs, gloo):
# for CI and laptops with slurm/local_cluster.py. Submit from the repository root with the
# learner virtualenv active:
#   sbatch launch/grpo_tiny.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-tiny
#SBATCH --nodes=4
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
# Survive the time limit: USR1 to the batch shell 10 min before it, so the learners checkpoint
# within launch.preempt_grace_s (300 s) and the job requeues itself (slurm/run_launcher.sh).
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# --gpus-per-node 0: CPU placement (gloo) even where --exclusive hands us a node's GPUs.
# A later --config in "$@" replaces this one (tests use their own YAML this way).
exec slurm/run_launcher.sh --gpus-per-node 0 --config configs/grpo_tiny.yaml "$@"
