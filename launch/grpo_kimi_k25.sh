#!/bin/bash
# GRPO on Kimi-K2.5 (1T MoE, MLA; its language model): 48 learner nodes (megatron TP8 x PP1, EP384) +
# 48 SGLang nodes (6 servers of TP64). The split and memory budget are explained in configs/grpo_kimi_k25.yaml; placement logic
# lives in areal_mega/launcher (plan.py). Submit from the repository root with the learner
# virtualenv active:
#   sbatch launch/grpo_kimi_k25.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-kimi-k25
#SBATCH --nodes=96
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
exec slurm/run_launcher.sh --config configs/grpo_kimi_k25.yaml "$@"
