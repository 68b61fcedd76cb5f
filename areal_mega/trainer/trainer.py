"""Everything the trainer loop (``areal_mega.trainer.loop``) calls, built once per learner rank.

Rank 0 additionally owns the :class:`RolloutDriver` (inference pool + rollout controller) and
writes metrics; every rank owns its share of the actor engine and of weight sync. Batches are
formed on rank 0 and broadcast over a gloo group (tiny compared with a train step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from areal_mega.megatron.checkpoint import read_run_state, resume_run_checkpoint, save_run_checkpoint, set_rng_state
from areal_mega.megatron.engine import MegatronTrainEngine
from areal_mega.megatron.parallel_state import ModelParallelGroups, init_model_parallel
from areal_mega.megatron.routing import replay_metrics
from areal_mega.parallel import ParallelLayout
from areal_mega.algo.advantages import compute_advantages
from areal_mega.rollout.batch import broadcast_batch, split_minibatches, to_engine_alignment, trajectories_to_batch
from areal_mega.trainer.critic import CriticEngine
from areal_mega.trainer.config import ExperimentConfig
from areal_mega.algo.losses import PPOActorLoss, PPOCriticLoss, global_counts, kl_estimate
from areal_mega.rollout.driver import RolloutDriver
from areal_mega.utils.metrics import Metrics
from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.weight_sync import megatron_weight_sync
from areal_mega.weight_sync.sync import SyncStats, WeightSync, WeightSyncError


def train_on_minibatches(actor: MegatronTrainEngine, batch: dict[str, torch.Tensor],
                         make_loss: Callable[[dict[str, torch.Tensor]], Any], temperature: float, *,
                         num_minibatches: int = 1, ppo_epochs: int = 1) -> tuple[dict[str, float], list[dict[str, float]]]:
    """``ppo_epochs`` passes of one optimizer step per mini-batch (``split_minibatches``: by
    sequences, groups whole) over a batch whose advantages (and ``prox_logprobs``) were computed
    on the whole batch. ``make_loss(minibatch)`` builds each step's loss with that mini-batch's
    own normalisers. Returns (stats of the batch, stats of each step in order): step-summed
    "loss"/"num_tokens"/"num_microbatches", max of "*/max", min of "*/min", the last "step"/"lr",
    the mean of the rest, plus "num_updates"."""
    pieces = split_minibatches(batch, num_minibatches)
    steps = [actor.train_batch(mb, make_loss(mb), temperature) for _ in range(ppo_epochs) for mb in pieces]
    out: dict[str, float] = {}
    for k in steps[0]:
        vals = [st[k] for st in steps]
        if k in ("loss", "num_tokens", "num_microbatches"):
            out[k] = sum(vals)
        elif k.endswith("/max"):
            out[k] = max(vals)
        elif k.endswith("/min"):
            out[k] = min(vals)
        elif k in ("step", "lr"):
            out[k] = vals[-1]
        else:
            out[k] = sum(vals) / len(vals)
    out["num_updates"] = float(len(steps))
    return out, steps


def _backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


@dataclass
class Trainer:
    cfg: ExperimentConfig
    groups: ModelParallelGroups
    actor: MegatronTrainEngine
    weight_sync: WeightSync
    metrics: Metrics
    ctrl_group: Any
    start_step: int
    driver: RolloutDriver | None = None
    eval_workflow: Any = None
    eval_set: list[dict[str, Any]] = field(default_factory=list)
    prompts: Any = None
    """Rank 0's PromptStream (areal_mega.data): the training prompts with a resumable position."""
    stop_signal: int | None = None
    """The SIGTERM/SIGUSR1 this rank received, if any (a stop after the current step)."""
    ref: MegatronTrainEngine | None = None
    """Frozen forward-only initial policy (algorithm.kl_coef > 0), same layout as the actor."""
    critic: CriticEngine | None = None
    """PPO critic (algorithm.adv_estimator == "gae"); never synced to the servers."""
    reward: Any = None
    """Rank 0's reward function (owns worker processes for math / isolated rewards)."""
    tools: Any = None
    """Rank 0's tool registry (workflow kind "tool"; owns the python tool's sandbox workers)."""
    _t_last: float = field(default_factory=time.perf_counter)

    @property
    def is_driver(self) -> bool:
        return self.groups.rank == 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, cfg: ExperimentConfig) -> "Trainer":
        backend = _backend(cfg.trainer.backend)
        if not dist.is_initialized():
            dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        layout = ParallelLayout.build(cfg.parallel, dist.get_world_size())
        groups = init_model_parallel(layout, backend=backend, seed=cfg.seed)
        # Python objects (batches, URLs) travel on gloo even when the learners use NCCL.
        ctrl = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        actor = MegatronTrainEngine.create(cfg.actor, cfg.model_path, groups, hf_weights_dir=cfg.model_path)
        # The KL reference is the INITIAL policy, also after a resume; forward-only: no optimizer state.
        ref = (MegatronTrainEngine.create(cfg.actor, cfg.model_path, groups, hf_weights_dir=cfg.model_path,
                                          trainable=False) if cfg.algorithm.kl_coef > 0 else None)
        critic = (CriticEngine.create(cfg.critic, cfg.model_path, groups, hf_weights_dir=cfg.model_path, seed=cfg.seed)
                  if cfg.algorithm.adv_estimator == "gae" else None)
        out = Path(cfg.output_dir)
        start_step = 0
        run_state = None
        # The newest COMPLETE checkpoint (areal_mega.json present); half-written ones are skipped.
        resumed = resume_run_checkpoint(out / "checkpoints", actor, critic, group=ctrl) if cfg.trainer.resume else None
        if resumed is not None:
            start_step = actor.get_version()
            run_state, rng = read_run_state(resumed)
            if rng is not None:  # every rank continues its generators where the checkpoint left them
                set_rng_state(rng)

        rank0 = groups.rank == 0
        capture = cfg.actor.model.moe_routing_replay == "rollout"  # the servers record every token's experts
        driver = RolloutDriver(cfg.inference, capture_routes=capture) if rank0 else None
        box: list[Any] = [driver.server_urls if driver else None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        servers = [SGLangClient(u, timeout_s=cfg.weight_sync.http_timeout_s, api_key=cfg.inference.resolved_api_key())
                   for u in box[0]]
        # Tensors travel in the servers' dtype (inference.server.dtype), whatever the learner trains in.
        wire = cfg.inference.server.dtype if cfg.inference.server.dtype != "auto" else None
        # The trainer pauses generation through the pool (sync_weights), in the pool's mode.
        ws_cfg = dataclasses.replace(cfg.weight_sync, pause_servers=False, pause_mode=cfg.inference.client.pause_mode)
        ws = megatron_weight_sync(ws_cfg, adapter=actor.model.adapter, chunks=actor.model.chunks,
                                  groups=groups, servers=servers, world_group=ctrl, dtype=wire)
        if start_step > 0:  # the servers started from model_path: bring them to the resumed weights
            ws.sync(version=start_step)
        if rank0:
            out.mkdir(parents=True, exist_ok=True)
        metrics = Metrics(str(out / "tb") if rank0 else None, enabled=rank0, jsonl_path=str(out / "metrics.jsonl"))
        trainer = cls(cfg=cfg, groups=groups, actor=actor, weight_sync=ws, metrics=metrics, ctrl_group=ctrl,
                    start_step=start_step, driver=driver, ref=ref, critic=critic)
        trainer._catch_stop_signals()
        if rank0:
            trainer._start_rollout(run_state)
        return trainer

    def _start_rollout(self, run_state: dict[str, Any] | None) -> None:
        from transformers import AutoTokenizer

        from areal_mega.data import PromptStream, load_dataset
        from areal_mega.evaluation import EvalSpec, eval_workflows, load_items
        from areal_mega.reward import build_reward
        from areal_mega.workflows import build_workflow

        cfg = self.cfg
        tok = AutoTokenizer.from_pretrained(cfg.model_path)
        assert self.driver is not None
        # A judge on the policy's servers (reward.judge.servers: policy) uses the driver's pool.
        reward = self.reward = build_reward(cfg.reward, policy_engine=self.driver.pool, policy_tokenizer=tok)
        split = load_dataset(cfg.data, tokenizer=tok)
        if cfg.workflow.kind == "tool":  # one registry (one python-tool sandbox) for both workflows
            from areal_mega.tools import build_tools

            self.tools = build_tools(cfg.workflow.tools, timeout_s=cfg.workflow.tool_timeout_s,
                                     max_output_chars=cfg.workflow.tool_max_output_chars)
        workflow = build_workflow(cfg.workflow, tok, reward, self.tools)
        self.eval_set = load_items(cfg, tok, heldout=split.eval)
        # what `areal-mega eval` runs
        self.eval_workflow, _ = eval_workflows(cfg.workflow, tok, reward, EvalSpec(), tools=self.tools)
        # Resumed: the prompt stream continues where the checkpoint stood, the prompts that were
        # in flight then (dropped with the episodes) first -- every prompt trained once per epoch.
        # The staleness counters start afresh at the resumed version: nothing is in flight.
        self.prompts = PromptStream(split.train)
        if run_state is not None and run_state.get("prompts") is not None:
            self.prompts.load_state_dict(run_state["prompts"])
        self.driver.start_rollout(workflow, self.prompts, cfg.rollout, version=self.start_step)

    # ------------------------------------------------------------------ loop pieces
    def next_batch(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Collective: rank 0 waits for a rollout batch and every rank receives it."""
        while True:
            payload: dict[str, Any] | None = None
            if self.driver is not None:
                rb = self.driver.next_batch()
                if rb is None:
                    payload = {"resync": True}
                else:
                    self.metrics.histogram("rollout/token_staleness", rb.staleness_counts)
                    self._log_prompts(rb)
                    reward_metrics = getattr(self.reward, "metrics", None)  # the judge's outcome counts
                    payload = {"batch": to_engine_alignment(trajectories_to_batch(rb.groups)),
                               "stats": {**rb.stats, **self.driver.pool_stats(),
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

    def _log_prompts(self, rb: Any) -> None:
        """``prompts.jsonl``: the prompts each batch trains, by stream position and sample id
        (what lets a resumed or failed-over run be checked for prompts lost or trained twice)."""
        rows = [[*pos, pid] for pos, pid in zip(rb.positions, rb.prompt_ids) if pos is not None]
        with open(Path(self.cfg.output_dir) / "prompts.jsonl", "a") as f:
            f.write(json.dumps({"version": rb.version, "prompts": rows}) + "\n")

    def proximal(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """pi_prox (the policy before this update; one extra forward) into ``batch["prox_logprobs"]``.
        MoE routing replay: the servers' routes in the batch are replayed here (rollout); with
        "proximal" the routes this forward chose become the batch's, for the training forward.
        Returns the train/inference mismatch metrics (routing.replay_metrics)."""
        out = self.actor.forward(batch, self.cfg.workflow.sampling.temperature, with_entropy=False)
        batch["prox_logprobs"] = out["logprobs"]
        natural = out.get("routes")
        if self.cfg.actor.model.moe_routing_replay == "proximal":
            batch["routed_experts"] = natural
        return replay_metrics(batch, out["logprobs"], natural, self.actor.get_version(),
                              self.actor.model.arch.num_layers)

    def ref_and_values(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the advantages and losses need from the extra models, {} when neither is built:
        ``ref_logprobs`` [T] (frozen reference, same temperature as the actor's log-probs),
        ``kl`` [T] = kl_estimate(pi, pi_ref) on the loss mask when ``kl_in_reward`` (pi = the
        proximal policy when computed, else the behaviour one), ``values`` [T] (critic)."""
        out: dict[str, torch.Tensor] = {}
        alg = self.cfg.algorithm
        if self.ref is not None:
            with self.metrics.phase("ref_logp"):
                out["ref_logprobs"] = self.ref.forward_logprobs(batch, self.cfg.workflow.sampling.temperature)
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
        return compute_advantages(batch, self.cfg.algorithm)

    def train_policy(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The policy's optimizer steps on one rollout batch (``algorithm.num_minibatches`` x
        ``algorithm.ppo_epochs``; 1 x 1 = one step on the whole batch); no weight sync here."""
        alg = self.cfg.algorithm
        stats, _ = train_on_minibatches(self.actor, batch, self.loss_fn, self.cfg.workflow.sampling.temperature,
                                        num_minibatches=alg.num_minibatches, ppo_epochs=alg.ppo_epochs)
        return stats

    def loss_fn(self, batch: dict[str, torch.Tensor]) -> PPOActorLoss:
        tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
        return PPOActorLoss(self.cfg.algorithm, total_tokens=tokens, total_seqs=seqs)

    def throughput(self, batch: dict[str, torch.Tensor], metrics: Metrics) -> dict[str, float]:
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        gen = float(batch["loss_mask"].sum())
        return {"perf/step_s": dt, "perf/generated_tokens_per_s": gen / max(dt, 1e-9),
                "perf/tokens_per_s": batch["input_ids"].numel() / max(dt, 1e-9)}

    def sync_weights(self, version: int) -> SyncStats:
        """Push the weights as ``version`` to every live server and bump the version on the
        generation side (collective). Rank 0 pauses generation through the pool (so the pool
        knows its servers are paused, not dead) and picks the targets after a fresh health pass:
        a dead server is skipped, a recovered one is brought up to date before it takes traffic
        again; a server dying mid-sync costs one retry."""
        if self.driver is not None:
            self.driver.pause()
        try:
            for attempt in range(2):
                wait_s = self.cfg.weight_sync.server_wait_s
                box: list[Any] = [self.driver.sync_targets(wait_s) if self.driver is not None else None]
                dist.broadcast_object_list(box, src=0, group=self.ctrl_group)
                if not box[0]:
                    raise WeightSyncError(f"weight sync: no live inference server to push weights to "
                                          f"(waited weight_sync.server_wait_s={wait_s:g} s)")
                self.weight_sync.set_servers([SGLangClient(u, timeout_s=self.cfg.weight_sync.http_timeout_s,
                                                           api_key=self.cfg.inference.resolved_api_key()) for u in box[0]])
                try:
                    stats = self.weight_sync.sync(version=version)
                    break
                except WeightSyncError:
                    if attempt == 1:
                        raise
                    self.weight_sync.close()  # membership changed under us: reconnect and resend
            if self.driver is not None:
                self.driver.set_version(version)  # admission moves on; new tokens carry `version`
                self.driver.release_resynced(self.weight_sync.server_urls)
        finally:
            if self.driver is not None:
                self.driver.resume()
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

    def save(self, step: int) -> None:
        """``checkpoints/stepNNNNNN`` (actor + ``critic/``) in the one checkpoint format, staged
        and renamed into place, then ``checkpoints/latest`` moved to it (both atomic)."""
        run_state = None
        if self.driver is not None:
            run_state = {"step": step, "prompts": self.driver.prompt_state()}
        save_run_checkpoint(Path(self.cfg.output_dir) / "checkpoints", step, self.actor, self.critic,
                            extra={"model_path": self.cfg.model_path}, run_state=run_state)
        dist.barrier(group=self.ctrl_group)

    def evaluate(self, step: int) -> None:
        res = None
        if self.driver is not None and self.eval_set:
            res = self.driver.evaluate(self.eval_workflow, self.eval_set)
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
        if self.driver is not None:
            self.driver.close()
        if self.reward is not None:
            self.reward.close()  # reward worker processes
        if self.tools is not None:
            self.tools.close()  # the python tool's sandbox workers
        self.weight_sync.close()
        dist.barrier(group=self.ctrl_group)
        dist.destroy_process_group()
