#!/bin/bash
# GRPO on Qwen3-235B-A22B (MoE): 16 learner nodes (megatron TP4 x PP2, EP16) + 8 FP8 SGLang nodes (TP8 each).
# The split and memory budget are explained in configs/grpo_qwen3_235b_a22b.yaml; placement logic
# lives in areal_mega/launcher (plan.py). Submit from the repository root with the learner
# virtualenv active:
#   sbatch launch/grpo_qwen3_235b_a22b.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-qwen3-235b-a22b
#SBATCH --nodes=24
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
exec slurm/run_launcher.sh --config configs/grpo_qwen3_235b_a22b.yaml "$@"
