#!/bin/bash
# GRPO on a 70B Llama with 65,536-token traces: 16 learner nodes (megatron TP8 x PP4 x CP4) + 16
# SGLang nodes (TP8 each). The layout and memory budget are explained in
# configs/grpo_llama70b_64k.yaml (docs/context_parallel.md); placement logic
# lives in areal_mega/launcher (plan.py). Submit from the repository root with the learner
# virtualenv active:
#   sbatch launch/grpo_70b_64k.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-70b-64k
#SBATCH --nodes=32
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
exec slurm/run_launcher.sh --config configs/grpo_llama70b_64k.yaml "$@"
