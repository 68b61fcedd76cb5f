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
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# --gpus-per-node 0: CPU placement (gloo) even where --exclusive hands us a node's GPUs.
# A later --config in "$@" replaces this one (tests use their own YAML this way).
exec python -m areal_mega.launcher slurm --gpus-per-node 0 --config configs/grpo_tiny.yaml "$@"
