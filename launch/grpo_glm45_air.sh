#!/bin/bash
# GRPO on GLM-4.5-Air (MoE): 8 learner nodes (megatron TP4 x PP2, EP16) + 8 SGLang nodes (TP8 each).
# The split and memory budget are explained in configs/grpo_glm45_air.yaml; placement logic
# lives in areal_mega/launcher (plan.py). Submit from the repository root with the learner
# virtualenv active:
#   sbatch launch/grpo_glm45_air.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-glm45-air
#SBATCH --nodes=16
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
# Survive the time limit: USR1 to the batch shell 10 min before it, so the learners checkpoint
# within launch.preempt_grace_s (300 s) and the job requeues itself (slurm/run_launcher.sh).
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
exec slurm/run_launcher.sh --config configs/grpo_glm45_air.yaml "$@"
