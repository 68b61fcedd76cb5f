#!/bin/bash
# GRPO with LoRA on Qwen3-30B-A3B (MoE): 1 learner node (megatron TP1 x EP8, frozen base + rank-16
# attention and per-expert adapters) + 1 SGLang node (TP8); on a larger allocation the planner picks the split
# (launch.learner.num_nodes: null). Why it fits: configs/grpo_qwen3_30b_a3b_lora.yaml, docs/lora.md.
# Submit from the repository root with the learner virtualenv active:
#   sbatch launch/grpo_qwen3_30b_a3b_lora.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-qwen3-30b-a3b-lora
#SBATCH --nodes=2
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
exec slurm/run_launcher.sh --config configs/grpo_qwen3_30b_a3b_lora.yaml "$@"
