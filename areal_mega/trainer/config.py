"""The top-level experiment config: one YAML file for the trainer, the servers and the launcher.

Each section is owned by the component that reads it; this class only nests them and checks
the few facts that span sections (e.g. the launcher's learner layout equals the trainer's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mega.config import from_dict, load_dict
from areal_mega.data import DatasetConfig
from areal_mega.inference.config import InferenceConfig
from areal_mega.launcher.config import LaunchConfig
from areal_mega.megatron.engine import MegatronEngineConfig
from areal_mega.parallel import ParallelConfig
from areal_mega.reward import RewardConfig
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.rollout.config import RolloutConfig
from areal_mega.trainer.critic import CriticConfig
from areal_mega.weight_sync.config import WeightSyncConfig
from areal_mega.workflows import WorkflowConfig


@dataclass
class TrainerLoopConfig:
    """Length of the run, checkpoints, evaluation, logging."""

    num_steps: int = 100
    """Optimizer steps (= policy versions) to train; the run ends at version num_steps."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0 = only at the end)."""
    resume: bool = True
    """Resume from the newest complete ``<output_dir>/checkpoints/stepNNNNNN`` when there is one
    (model, optimizer, LR schedule, version, prompt-stream position, RNG states); the servers
    are re-synced to the resumed weights first."""
    eval_every: int = 0
    """Evaluate on ``eval_data`` every this many steps (0 = only at start/end)."""
    eval_at_start: bool = True
    """Evaluate the initial policy (version 0 or the resumed one) before training."""
    eval_at_end: bool = True
    """Evaluate the final policy after the last weight sync."""
    backend: str = "auto"
    """torch.distributed backend of the learners: "nccl", "gloo", or "auto" (nccl with CUDA)."""
    export_hf_at_end: bool = True
    """Also write the final weights as an HF checkpoint (``<output_dir>/hf``) via the adapter."""
    stop_file: str = ""
    """Graceful stop: when this file exists (checked after every step), the trainer saves a
    checkpoint and exits 0 -- for preemption notices and operators (the launcher creates
    ``<run_dir>/STOP`` on SIGUSR1/SIGTERM). SIGTERM/SIGUSR1 to a learner rank do the same.
    Empty = only the signals."""

    def validate(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"num_steps: must be >= 0, got {self.num_steps}")
        if self.save_every < 0 or self.eval_every < 0:
            raise ValueError("save_every / eval_every: must be >= 0")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend: {self.backend!r} is not one of auto, nccl, gloo")


@dataclass
class ExperimentConfig:
    model_path: str = ""
    """HF model directory (config.json, safetensors, tokenizer) the learners start from."""
    output_dir: str = "runs/experiment"
    """Checkpoints, TensorBoard logs (``tb/``), metrics.jsonl and the final HF export."""
    seed: int = 1
    """Seed of the learners (megatron RNG) and of data order."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Learner layout (tp, pp, cp, dp)."""
    actor: MegatronEngineConfig = field(default_factory=MegatronEngineConfig)
    """The policy's megatron engine: model build, optimizer, micro-batching. With
    ``algorithm.kl_coef > 0`` a frozen, forward-only copy of the initial policy (``model_path``,
    same layout and ``actor.model`` settings, no optimizer) serves as the KL reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The PPO critic (trunk from ``model_path`` + value head, its own optimizer); built only
    when ``algorithm.adv_estimator`` is "gae"."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """SGLang servers (launched by the pool, or at ``inference.addresses``) and the client."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How new weights reach the servers after each step."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Batch size (episodes), max_staleness, concurrency, dynamic filtering."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and policy loss (GRPO/PPO/RLOO/REINFORCE++, decoupled PPO, ...)."""
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    """How one episode is generated (group size, sampling, prompt template, turns/tools)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How completions are scored."""
    data: DatasetConfig = field(default_factory=DatasetConfig)
    """Training prompts."""
    eval_data: DatasetConfig | None = None
    """Held-out prompts for evaluation (greedy, one sample each); None disables evaluation."""
    trainer: TrainerLoopConfig = field(default_factory=TrainerLoopConfig)
    """Run length, checkpoints, evaluation."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Placement for the launchers (local / Slurm); the trainer itself ignores it."""

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: must name an HF model directory")
        if self.algorithm.num_minibatches > self.rollout.batch_size:
            raise ValueError(f"algorithm.num_minibatches: {self.algorithm.num_minibatches} mini-batches of whole groups "
                             f"need rollout.batch_size >= {self.algorithm.num_minibatches} groups per batch, "
                             f"got {self.rollout.batch_size}")
        if self.actor.model.moe_routing_replay == "proximal" and not self.algorithm.decoupled:
            raise ValueError("actor.model.moe_routing_replay: 'proximal' replays the proximal forward's routes, "
                             "which only algorithm.decoupled computes; set algorithm.decoupled: true or use 'rollout'")


def load_experiment(path: str | None, overrides: list[str] | None = None) -> ExperimentConfig:
    data, where = load_dict(path, overrides)
    # Servers start from the learners' initial weights unless the file says otherwise.
    server = data.setdefault("inference", {}).setdefault("server", {})
    if isinstance(server, dict) and not server.get("model_path") and data.get("model_path"):
        server["model_path"] = data["model_path"]
    return from_dict(ExperimentConfig, data, where)
