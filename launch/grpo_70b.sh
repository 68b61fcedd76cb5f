#!/bin/bash
# GRPO on a 70B Llama: 4 learner nodes (megatron TP8xPP4) + 12 SGLang nodes (TP8 each).
# The split and memory budget are explained in configs/grpo_llama70b.yaml; placement logic
# lives in areal_mega/launcher (plan.py). Submit from the repository root with the learner
# virtualenv active:
#   sbatch launch/grpo_70b.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-70b
#SBATCH --nodes=16
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
exec python -m areal_mega.launcher slurm --config configs/grpo_llama70b.yaml "$@"
