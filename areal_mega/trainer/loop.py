"""The asynchronous RL loop: one process per learner rank, under torchrun (``trainer/main.py``
builds the components). Rank 0 also drives generation in a background thread.

    rollout batch (rank 0, broadcast) -> proximal log-probs -> advantages (both on the whole batch)
      -> optimizer step(s) (one per mini-batch and epoch) -> weight sync to the servers -> version bump

Generation never waits for training: the controller keeps sampling with the current weights
while the learner trains, bounded by ``rollout.max_staleness``; ``max_staleness = 0`` is
synchronous RL. The decoupled PPO loss corrects for the policy gap (``algorithm.decoupled``).
"""

from __future__ import annotations

from areal_mega.trainer.trainer import Trainer


def run(trainer: Trainer) -> int:
    cfg, actor, m = trainer.cfg, trainer.actor, trainer.metrics
    trainer.start()  # resume from the newest complete checkpoint, start generating (rank 0)
    if cfg.trainer.eval_at_start:
        trainer.evaluate(step=trainer.start_step)
    for step in range(trainer.start_step, cfg.trainer.num_steps):
        with m.phase("rollout"):
            batch, rollout_stats = trainer.next_batch()  # rank 0 samples, every rank receives
        prox_stats = {}
        if cfg.algorithm.decoupled:  # pi_prox: the policy before this update (one extra forward)
            with m.phase("prox_logp"):
                prox_stats = trainer.proximal(batch)  # batch["prox_logprobs"]; MoE routing replay; mismatch metrics
        batch.update(trainer.ref_and_values(batch))  # ref log-probs / KL (needs_reference), critic values (needs_critic)
        batch.update(trainer.advantages(batch))
        with m.phase("train"):
            train_stats = trainer.train_policy(batch)  # algorithm.num_minibatches x ppo_epochs optimizer steps
        critic_stats = trainer.train_critic(batch, version=step + 1)  # PPO critic on the returns; {} if none
        with m.phase("weight_sync"):
            sync = trainer.sync_weights(version=step + 1)  # every live server; bumps the rollout version
        actor.set_version(step + 1)
        stop = trainer.stop_requested()  # SIGTERM/SIGUSR1 or trainer.stop_file: checkpoint, then stop
        m.log({**rollout_stats, **prox_stats, **{f"train/{k}": v for k, v in train_stats.items()}, **critic_stats,
               "weight_sync/seconds": sync.seconds, "weight_sync/GBps": sync.gbps, "weight_sync/bytes": float(sync.bytes),
               "weight_sync/resharded": float(sync.mode == "reshard"),  # 0: broadcast (or a fallback to it)
               "version": step + 1, **trainer.throughput(batch, m)})
        # The step's record before its checkpoint: a kill -9 between the two leaves a record past
        # the last checkpoint (cut on resume), never a checkpoint whose step has no record.
        m.commit(step + 1)
        if trainer.should_save(step + 1) or stop:
            with m.phase("save"):  # timed into the next step's record
                trainer.save(step + 1)
        elif trainer.should_snapshot(step + 1):  # the generation side alone, between checkpoints
            with m.phase("snapshot"):
                trainer.snapshot(step + 1)
        if stop:  # no evaluation: a preemption's grace period is for the checkpoint
            trainer.announce_stop(step + 1)
            break
        if trainer.should_eval(step + 1):
            trainer.evaluate(step=step + 1)
    trainer.close()
    return 0
