#!/bin/bash
# FP8 rollout: launch/grpo_deepseek_v3_671b.sh with bf16 TP32 servers over 4 nodes -> FP8 TP16 servers over 2 nodes (the published DeepSeek-V3 checkpoint is this block FP8);
# the learner quantizes at sync time (docs/weight_sync.md "FP8 rollout").
# GRPO on DeepSeek-V3-671B (MoE, MLA): 32 learner nodes (megatron TP8 x PP1, EP256) + 32 SGLang nodes.
# The split and memory budget are explained in configs/grpo_deepseek_v3_671b.yaml; placement logic
# lives in areal_mega/launcher (plan.py). Submit from the repository root with the learner
# virtualenv active:
#   sbatch launch/grpo_deepseek_v3_671b.sh [--dry-run] [key=value overrides ...]
#SBATCH --job-name=grpo-fp8-deepseek-v3-671b
#SBATCH --nodes=64
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
exec slurm/run_launcher.sh --config configs/grpo_deepseek_v3_671b.yaml \
    inference.server.quantization=fp8 inference.server.tp_size=16 inference.server.model_path=/models/DeepSeek-V3 "$@"
