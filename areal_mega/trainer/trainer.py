"""Everything the trainer loop (``areal_mega.trainer.loop``) calls, over components built by
``areal_mega.trainer.main`` (the composition root). Rank 0 also holds the rollout service and the
episode stack and writes metrics; batches are formed there and broadcast over a gloo group."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from areal_mega.algo.losses import PPOCriticLoss, global_counts, interpolation_weights, kl_estimate
from areal_mega.api.algorithm import AdvantageEstimator, PolicyLoss
from areal_mega.api.data import PromptSource
from areal_mega.api.engine import TrainEngine
from areal_mega.api.workflow import RolloutBatch, RolloutWorkflow
from areal_mega.evaluation import load_items
from areal_mega.experiment import ExperimentConfig
from areal_mega.megatron.parallel_state import ModelParallelGroups
from areal_mega.rollout.batch import broadcast_batch, split_minibatches, to_engine_alignment, trajectories_to_batch
from areal_mega.rollout.service import RolloutService
from areal_mega.trainer.critic import CriticEngine
from areal_mega.trainer.run_state import (read_rollout_snapshot, remove_rollout_snapshot, resume_run,
                                          save_run_checkpoint, write_rollout_snapshot)
from areal_mega.trainer.runlog import cut_logs_past
from areal_mega.utils.metrics import Metrics
from areal_mega.utils.stats import reduce_stats
from areal_mega.weight_sync.sync import SyncStats, WeightSync, WeightSyncError
from areal_mega.workflows.stack import EpisodeStack


def train_on_minibatches(actor: TrainEngine, batch: dict[str, torch.Tensor],
                         make_loss: Callable[[dict[str, torch.Tensor]], Any], temperature: float, *,
                         num_minibatches: int = 1, ppo_epochs: int = 1) -> tuple[dict[str, float], list[dict[str, float]]]:
    """``ppo_epochs`` passes of one optimizer step per mini-batch (``split_minibatches``: by
    sequences, groups whole) over a batch whose advantages (and ``prox_logprobs``) were computed
    on the whole batch. ``make_loss(minibatch)`` builds each step's loss with that mini-batch's
    own normalisers. Returns (stats of the batch: the steps' stats combined by the one rule of
    ``areal_mega.utils.stats``, plus "num_updates"; stats of each step in order)."""
    pieces = split_minibatches(batch, num_minibatches)
    steps = [actor.train_batch(mb, make_loss(mb), temperature) for _ in range(ppo_epochs) for mb in pieces]
    out = reduce_stats(steps)
    out["num_updates"] = float(len(steps))
    return out, steps


@dataclass
class Trainer:
    """The loop's pieces over components built elsewhere (``trainer/main.py``, or a researcher's
    own copy of it): it never builds a component and never dispatches on a config kind."""

    cfg: ExperimentConfig
    groups: ModelParallelGroups
    ctrl_group: dist.ProcessGroup
    """Carries Python objects (batches, URLs, targets): gloo even when the learners use NCCL."""
    actor: TrainEngine
    weight_sync: WeightSync
    advantage: AdvantageEstimator
    """Advantages of a whole rollout batch (``api.algorithm``)."""
    policy_loss: Callable[..., PolicyLoss]
    """Built once per optimizer step: ``policy_loss(cfg.algorithm, total_tokens=..., total_seqs=...)``."""
    metrics: Metrics
    ref: TrainEngine | None = None
    """Frozen forward-only initial policy (``algorithm.needs_reference``), same layout as the actor."""
    critic: CriticEngine | None = None
    """PPO critic (an estimator with ``needs_values``); never synced to the servers."""
    generation: RolloutService | None = None
    """Rank 0's generation side (inference pool + rollout controller, the one policy version)."""
    episodes: EpisodeStack | None = None
    """Rank 0's tokenizer, reward, tools and workflow (the ones ``areal-mega eval`` builds)."""
    prompts: PromptSource | None = None
    """Rank 0's training prompts with a resumable position."""
    start_step: int = 0
    eval_workflow: RolloutWorkflow | None = None
    eval_set: list[dict[str, object]] = field(default_factory=list)
    stop_signal: int | None = None
    """The SIGTERM/SIGUSR1 this rank received, if any (a stop after the current step)."""
    _t_last: float = field(default_factory=time.perf_counter)
    _served: deque = field(default_factory=deque)
    """``trainer.study_delay``: (version, CPU weights) of the last delay + 1 versions."""

    def __post_init__(self) -> None:
        if self.cfg.trainer.study_delay:  # version 0's weights: what the servers start from
            self._served.append((0, self.actor.snapshot_weights(self._served_dtype())))

    def _served_dtype(self) -> torch.dtype | None:
        """``trainer.study_delay`` keeps its history in the servers' 16-bit dtype, which the weights are
        cast to on their way anyway: the same bits served at half the memory of fp32 (d = 16 on
        SmolLM2-135M: 4.6 GB, not 9.2). Exact: every family's export only relayouts tensors (a LoRA
        merge fallback would compute W + BA from the rounded copies)."""
        dtype = self.cfg.inference.server.dtype
        return getattr(torch, dtype) if dtype in ("bfloat16", "float16") else None

    @property
    def is_driver(self) -> bool:
        return self.groups.rank == 0

    @property
    def temperature(self) -> float:
        """The learner's temperature (log-probs of the actor, pi_prox and the reference): the
        behaviour policy's, ``workflow.sampling`` temperature (> 0: ExperimentConfig.validate),
        read here and nowhere else."""
        return self.cfg.workflow.sampling.temperature

    def start(self) -> None:
        """Resume from the newest COMPLETE checkpoint (``trainer.resume``; half-written ones are
        skipped), bring the servers to its weights, then start generating (rank 0)."""
        cfg, out = self.cfg, Path(self.cfg.output_dir)
        run_state: dict[str, Any] = {}
        if cfg.trainer.resume:
            self.start_step, run_state = resume_run(out / "checkpoints", self.actor, self.critic, group=self.ctrl_group)
        if self.is_driver:
            out.mkdir(parents=True, exist_ok=True)
            # Between learner checkpoints the generation side may have been snapshotted on top of
            # this one (trainer.rollout_snapshot_every): it continues from there (docs/resume.md).
            snap = read_rollout_snapshot(out / "checkpoints", self.start_step) if cfg.trainer.resume else None
            if snap is not None:
                run_state = {**(run_state or {}), **snap}
            else:
                remove_rollout_snapshot(out / "checkpoints")
            # Records past the checkpoint (a killed run's last steps) are redone: move them out.
            for name, n in cut_logs_past(out, self.start_step).items():
                print(f"trainer: {n} record(s) of {name} past checkpoint {self.start_step} moved to "
                      f"{name}.superseded", file=sys.stderr, flush=True)
        # The servers started from model_path: bring them to the resumed weights; adapter-only LoRA
        # sync: load the first adapter (SGLang refuses requests naming an adapter it does not hold).
        if self.start_step > 0 or self.weight_sync.lora is not None:
            self.sync_weights(version=self.start_step)
        self._catch_stop_signals()
        if self.generation is not None:
            self.eval_set = load_items(cfg, self.episodes.tokenizer, heldout=self.prompts.heldout())
            self.eval_workflow, _ = self.episodes.eval_workflows()  # what `areal-mega eval` runs
            # Resumed: the episodes generated and not trained then (rollout.save_in_flight) continue
            # first, at their admission versions (docs/resume.md); then the prompt stream, where the
            # checkpoint stood, the prompts given back first -- every prompt trained once per epoch.
            run_state = run_state or {}
            if run_state.get("prompts") is not None:
                self.prompts.load_state_dict(run_state["prompts"])
            self.generation.start(self.episodes.workflow, self.prompts, cfg.rollout, restore=run_state.get("rollout"),
                                  keep_trained=cfg.trainer.rollout_snapshot_every > 0)
        self._base_step = self.start_step  # the learner checkpoint a snapshot is taken on

    # ------------------------------------------------------------------ loop pieces
    def next_batch(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Collective: rank 0 waits for a rollout batch and every rank receives it."""
        while True:
            payload: dict[str, Any] | None = None
            if self.generation is not None:
                rb = self.generation.next_batch()
                if rb is None:
                    payload = {"resync": True}
                else:
                    # versions behind the learner's (trainer.study_delay: the servers' lag added)
                    lag = self.actor.get_version() - self._served[0][0] if self._served else 0
                    self.metrics.histogram("rollout/token_staleness",
                                           {k + lag: c for k, c in rb.staleness_counts.items()})
                    self._log_prompts(rb)
                    reward_metrics = getattr(self.episodes.reward, "metrics", None)  # the judge's outcome counts
                    payload = {"batch": to_engine_alignment(trajectories_to_batch(rb.groups)),
                               "stats": {**rb.stats, **self.generation.stats(),
                                         **(reward_metrics() if reward_metrics else {})}}
            got = broadcast_batch(payload, src=0, group=self.ctrl_group)
            if "resync" not in got:
                return got["batch"], got["stats"]
            # Every server restarted and waits, parked, for the current weights before it may
            # generate; without them no batch can come. Push the current version again.
            if self.is_driver:
                print(f"weight sync: no server in rotation, all wait for weights; pushing version "
                      f"{self.actor.get_version()} again", file=sys.stderr, flush=True)
            self.sync_weights(version=self.actor.get_version())

    def _log_prompts(self, rb: RolloutBatch) -> None:
        """``prompts.jsonl``: the prompts each batch trains, by stream position and sample id
        (what lets a resumed or failed-over run be checked for prompts lost or trained twice), and
        the prompts skipped since the previous batch (their episodes kept failing: ``skipped``,
        ``[epoch, index, id, reason]``)."""
        rows = [[*pos, pid] for pos, pid in zip(rb.positions, rb.prompt_ids) if pos is not None]
        record: dict[str, Any] = {"version": rb.version, "prompts": rows}
        if any(rb.episode_ids):  # the per-episode log: no episode trained twice across resumes
            record["episodes"] = rb.episode_ids
        if rb.skipped:
            record["skipped"] = [[*(s["pos"] or [None, None]), s["id"], s["reason"]] for s in rb.skipped]
        with open(Path(self.cfg.output_dir) / "prompts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def proximal(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """pi_prox into ``batch["prox_logprobs"]`` (the engine's ``proximal_logprobs``: one extra
        forward, MoE routing replay); returns the train/inference mismatch metrics. With
        ``algorithm.proximal: interpolate`` no forward: the loss interpolates (``prox_alpha``)."""
        if self.cfg.algorithm.proximal == "interpolate":
            batch["prox_alpha"] = interpolation_weights(batch["versions"], self.actor.get_version())
            return {}
        return self.actor.proximal_logprobs(batch, self.temperature)

    def ref_and_values(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the advantages and losses need from the extra models, {} when neither is built:
        ``ref_logprobs`` [T] (frozen reference, same temperature as the actor's log-probs),
        ``kl`` [T] = kl_estimate(pi, pi_ref) on the loss mask when ``kl_in_reward`` (pi = the
        proximal policy when computed, else the behaviour one), ``values`` [T] (critic)."""
        out: dict[str, torch.Tensor] = {}
        alg = self.cfg.algorithm
        if self.ref is not None:
            with self.metrics.phase("ref_logp"):
                out["ref_logprobs"] = self.ref.forward_logprobs(batch, self.temperature)
            if alg.kl_in_reward:
                pi = batch.get("prox_logprobs", batch["logprobs"])
                kl = kl_estimate(pi, out["ref_logprobs"], alg.kl_estimator)
                # where, not a product: a NaN at a prompt position must not survive as NaN * 0.
                out["kl"] = torch.where(batch["loss_mask"].bool(), kl, torch.zeros_like(kl))
        if self.critic is not None:
            with self.metrics.phase("critic_values"):
                out["values"] = self.critic.compute_values(batch)
        return out

    def train_critic(self, batch: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """One critic step (PPOCriticLoss: clipped value loss on ``returns``, old ``values``);
        returns ``critic/*`` stats, {} without a critic."""
        if self.critic is None:
            return {}
        tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
        with self.metrics.phase("critic_train"):
            stats = self.critic.train_batch(batch, PPOCriticLoss(self.cfg.algorithm, total_tokens=tokens, total_seqs=seqs))
        self.critic.set_version(version)
        return {f"critic/{k}": v for k, v in stats.items()}

    def advantages(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.advantage(batch)

    def train_policy(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The policy's optimizer steps on one rollout batch (``algorithm.num_minibatches`` x
        ``algorithm.ppo_epochs``; 1 x 1 = one step on the whole batch); no weight sync here."""
        alg = self.cfg.algorithm
        stats, _ = train_on_minibatches(self.actor, batch, self.loss_fn, self.temperature,
                                        num_minibatches=alg.num_minibatches, ppo_epochs=alg.ppo_epochs)
        return stats

    def loss_fn(self, batch: dict[str, torch.Tensor]) -> PolicyLoss:
        tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
        return self.policy_loss(self.cfg.algorithm, total_tokens=tokens, total_seqs=seqs)

    def throughput(self, batch: dict[str, torch.Tensor], metrics: Metrics) -> dict[str, float]:
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        gen = float(batch["loss_mask"].sum())
        return {"perf/step_s": dt, "perf/generated_tokens_per_s": gen / max(dt, 1e-9),
                "perf/tokens_per_s": batch["input_ids"].numel() / max(dt, 1e-9)}

    def sync_weights(self, version: int) -> SyncStats:
        """Push the weights as ``version`` to every live server (collective); with
        ``trainer.study_delay`` d, version max(0, version - d)'s weights, as that version."""
        delay = self.cfg.trainer.study_delay
        if not delay:
            return self._push_weights(version)
        last = self._served[-1][0]
        if version not in (last, last + 1):
            raise RuntimeError(f"trainer.study_delay: weights of version {last} are the newest kept, asked to serve "
                               f"from version {version}; the history is not checkpointed: run the study in a fresh "
                               f"output_dir")
        if version == last + 1:
            self._served.append((version, self.actor.snapshot_weights(self._served_dtype())))
            if len(self._served) > delay + 1:
                self._served.popleft()
        served, weights = self._served[0]
        if served == version:
            return self._push_weights(version)
        own = self.actor.snapshot_weights()  # the learner's own weights, at full precision, put back after
        self.actor.restore_weights(weights)
        try:
            return self._push_weights(served)
        finally:
            self.actor.restore_weights(own)

    def _push_weights(self, version: int) -> SyncStats:
        """Push the model's weights as ``version`` to every live server (collective). The rollout service
        (rank 0) pauses generation and names the targets (``begin_update``: a dead server is
        skipped, a recovered one is brought up to date before it takes traffic again), then moves
        its one version counter (``end_update``); a server dying mid-sync costs one retry."""
        gen = self.generation
        synced = False
        try:
            for attempt in range(2):
                box: list[Any] = [gen.begin_update() if gen is not None else None]  # pauses generation
                dist.broadcast_object_list(box, src=0, group=self.ctrl_group)
                if not box[0]:
                    raise WeightSyncError(f"weight sync: no live inference server to push weights to "
                                          f"(waited weight_sync.server_wait_s={self.cfg.weight_sync.server_wait_s:g} s)")
                self.weight_sync.set_targets(box[0])
                try:
                    stats = self.weight_sync.sync(version=version)
                    synced = True
                    break
                except WeightSyncError:
                    if attempt == 1:
                        raise
                    self.weight_sync.close()  # membership changed under us: reconnect and resend
        finally:
            if gen is not None:  # admission moves on; new tokens carry `version`; generation resumes
                gen.end_update(version if synced else None, self.weight_sync.server_urls)
        return stats

    def stop_requested(self) -> bool:
        """Collective: True on every rank if any rank received SIGTERM/SIGUSR1 or rank 0 sees
        ``trainer.stop_file`` (the launcher creates it on the same signals)."""
        path = self.cfg.trainer.stop_file
        local = self.stop_signal is not None or (self.is_driver and bool(path) and os.path.exists(path))
        flag = torch.tensor([int(local)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctrl_group)
        return bool(flag.item())

    def _catch_stop_signals(self) -> None:
        """SIGTERM (torchrun forwards its own; preemption) and SIGUSR1 (Slurm's time-limit
        warning) no longer kill the rank: they ask for a stop after the current step, which the
        loop answers with a checkpoint (``stop_requested``). torchrun SIGKILLs its ranks 30 s
        after forwarding a SIGTERM; the launcher's stop file has ``launch.preempt_grace_s``."""
        def on_signal(signum: int, _frame: Any) -> None:
            self.stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, on_signal)

    def announce_stop(self, step: int) -> None:
        if self.is_driver:
            why = f"signal {self.stop_signal}" if self.stop_signal else f"stop file {self.cfg.trainer.stop_file}"
            print(f"trainer: stopped after step {step} ({why}); checkpoint {step} written: run again to resume",
                  file=sys.stderr, flush=True)

    def should_save(self, step: int) -> bool:
        t = self.cfg.trainer
        return step == t.num_steps or (t.save_every > 0 and step % t.save_every == 0)

    def should_eval(self, step: int) -> bool:
        t = self.cfg.trainer
        return (t.eval_every > 0 and step % t.eval_every == 0) or (t.eval_at_end and step == t.num_steps)

    def should_snapshot(self, step: int) -> bool:
        every = self.cfg.trainer.rollout_snapshot_every
        return every > 0 and step % every == 0

    def snapshot(self, step: int) -> None:
        """Rank 0: the generation side (prompt stream, episodes generated or handed out since the
        last learner checkpoint) to ``checkpoints/rollout_snapshot.json``, on top of that
        checkpoint (docs/resume.md). Not collective: the other ranks hold no generation state."""
        if self.generation is not None:
            state = self.generation.checkpoint_state(since_checkpoint=True)
            write_rollout_snapshot(Path(self.cfg.output_dir) / "checkpoints", self._base_step, step, state)

    def save(self, step: int) -> None:
        """``checkpoints/stepNNNNNN`` (actor + ``critic/``) in the one checkpoint format, staged
        and renamed into place, then ``checkpoints/latest`` moved to it (both atomic)."""
        run_state = None
        if self.generation is not None:
            run_state = {"step": step, **self.generation.checkpoint_state()}
        save_run_checkpoint(Path(self.cfg.output_dir) / "checkpoints", step, self.actor, self.critic,
                            extra={"model_path": self.cfg.model_path}, run_state=run_state)
        if self.generation is not None:  # the snapshot was on top of the checkpoint before
            remove_rollout_snapshot(Path(self.cfg.output_dir) / "checkpoints")
        self._base_step = step
        dist.barrier(group=self.ctrl_group)

    def evaluate(self, step: int) -> None:
        res = None
        if self.generation is not None and self.eval_set:
            res = self.generation.evaluate(self.eval_workflow, self.eval_set)
            self.metrics.log({f"eval/{k}": v for k, v in res.items()})
            print(json.dumps({"eval_step": step, **res}), flush=True)
            with open(Path(self.cfg.output_dir) / "eval.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **res}) + "\n")
        dist.barrier(group=self.ctrl_group)

    def close(self) -> None:
        if self.cfg.trainer.export_hf_at_end:
            from areal_mega.megatron.hf_export import save_hf_checkpoint

            save_hf_checkpoint(self.actor.model, str(Path(self.cfg.output_dir) / "hf"), source_dir=self.cfg.model_path)
        self.metrics.close()
        if self.generation is not None:
            self.generation.close()
        if self.episodes is not None:
            self.episodes.close()  # reward worker processes, the python tool's sandbox workers
        self.weight_sync.close()
        dist.barrier(group=self.ctrl_group)
        dist.destroy_process_group()
