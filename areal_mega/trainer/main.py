"""The composition root of a training run: each component built by one explicit call, then the loop.

    torchrun --nproc-per-node 2 -m areal_mega.cli train --config configs/grpo_tiny.yaml
    torchrun --nproc-per-node 2 my_experiment.py --config configs/grpo_tiny.yaml   # your copy of build()

To replace a component by an object of your own, copy :func:`build` into a file and change its
line (examples/, docs/extending.md); a ``package.module:Name`` in the YAML needs no copy at all.
"""

from __future__ import annotations

import argparse
import sys

from areal_mega.errors import EXIT_REFUSED, UserError
from areal_mega.experiment import ExperimentConfig, load_experiment
from areal_mega.trainer.loop import run
from areal_mega.trainer.trainer import Trainer

__all__ = ["build", "main", "parse_args"]


def build(cfg: ExperimentConfig) -> Trainer:
    """Every rank: process groups, engines, weight sync, the algorithm; rank 0 also the
    generation service, tokenizer, reward, workflow and prompts. Nothing here reads a kind."""
    from areal_mega.megatron.engine import MegatronTrainEngine
    from areal_mega.megatron.parallel_state import init_learner
    from areal_mega.rollout.service import RolloutService
    from areal_mega.trainer.critic import CriticEngine
    from areal_mega.utils.metrics import Metrics
    from areal_mega.weight_sync import megatron_weight_sync
    from areal_mega.data import build_prompt_source
    from areal_mega.reward.code import check_prompt_source
    from areal_mega.workflows.stack import EpisodeStack

    alg = cfg.algorithm
    groups, ctrl = init_learner(cfg.parallel, backend=cfg.trainer.backend, seed=cfg.seed)
    actor = MegatronTrainEngine.create(cfg.actor, cfg.model_path, groups, hf_weights_dir=cfg.model_path)
    # The KL reference is the INITIAL policy, also after a resume; forward-only: no optimizer state.
    ref = (MegatronTrainEngine.create(cfg.actor, cfg.model_path, groups, hf_weights_dir=cfg.model_path, trainable=False)
           if alg.needs_reference else None)
    critic = (CriticEngine.create(cfg.critic, cfg.model_path, groups, hf_weights_dir=cfg.model_path, seed=cfg.seed)
              if alg.needs_critic else None)
    # Tensors travel in the servers' dtype (inference.server.dtype), whatever the learner trains in;
    # generation is paused by the trainer through the rollout service, which also names the targets.
    wire = cfg.inference.server.dtype if cfg.inference.server.dtype != "auto" else None
    weight_sync = megatron_weight_sync(cfg.weight_sync, adapter=actor.model.adapter, chunks=actor.model.chunks,
                                       groups=groups, world_group=ctrl, dtype=wire,
                                       pause_mode=cfg.inference.client.pause_mode,
                                       api_key=cfg.inference.resolved_api_key(),
                                       quantization=cfg.inference.server.quantization, model=actor.model)
    advantage = alg.estimator(alg)  # algorithm.adv_estimator: a built-in or package.module:Class
    policy_loss = alg.loss          # algorithm.policy_loss: built per optimizer step by the trainer
    rank0 = groups.rank == 0
    metrics = Metrics(f"{cfg.output_dir}/tb" if rank0 else None, enabled=rank0,
                      jsonl_path=f"{cfg.output_dir}/metrics.jsonl")
    generation = episodes = prompts = None
    if rank0:  # generation, rewards and prompts live on rank 0
        generation = RolloutService(cfg.inference, server_wait_s=cfg.weight_sync.server_wait_s,
                                    capture_routes=cfg.actor.model.captures_server_routes, lora=weight_sync.lora)
        episodes = EpisodeStack.build(cfg.model_path, cfg.workflow, cfg.reward, policy_engine=generation.pool)
        prompts = build_prompt_source(cfg.data, episodes.tokenizer)
        check_prompt_source(cfg.reward, prompts, cfg.data.allow_empty_test_output)  # a code reward's tests
    return Trainer(cfg=cfg, groups=groups, ctrl_group=ctrl, actor=actor, weight_sync=weight_sync,
                   advantage=advantage, policy_loss=policy_loss, metrics=metrics, ref=ref, critic=critic,
                   generation=generation, episodes=episodes, prompts=prompts)


def parse_args(argv: list[str] | None = None) -> ExperimentConfig:
    """``--config FILE [key.sub=value ...]`` -> the validated experiment (what ``areal-mega train``
    and a user's script both take)."""
    ap = argparse.ArgumentParser(description="areal_mega training run (one learner rank, under torchrun)")
    ap.add_argument("--config", required=True)
    args, rest = ap.parse_known_args(argv)
    bad = [r for r in rest if "=" not in r]
    if bad:
        raise SystemExit(f"unexpected arguments {bad} (overrides look like key.sub=value)")
    try:
        return load_experiment(args.config, rest)
    except UserError as e:  # a bad file or key: one line, also from a researcher's own script
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_REFUSED) from None


def main(argv: list[str] | None = None) -> int:
    return run(build(parse_args(argv)))
