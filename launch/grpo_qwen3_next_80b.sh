#!/bin/bash
# GRPO on Qwen3-Next-80B-A3B (hybrid MoE): 4 learner nodes (megatron TP2 x PP4, EP8) + 4 SGLang nodes (two TP4 servers each).
# The split and memory budget are explained in configs/grpo_qwen3_next_80b.yaml; placement logic
# lives in areal_mega/launcher (plan.py). Submit from the repository root with the learner
# virtualenv active:
#   sbatch launch/grpo_qwen3_next_80b.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-qwen3-next-80b
#SBATCH --nodes=8
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
exec slurm/run_launcher.sh --config configs/grpo_qwen3_next_80b.yaml "$@"
