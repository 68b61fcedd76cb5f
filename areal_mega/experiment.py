"""The experiment config: one YAML file for the trainer, the servers and the launcher.

Each section is owned by the component that reads it; this module only nests them and checks the
few facts that span sections. It sits above trainer/ and launcher/ (both read it, neither owns
it), so that neither imports the other for its config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from areal_mega.algo.config import AlgorithmConfig
from areal_mega.config import from_dict, load_dict
from areal_mega.data import DatasetConfig
from areal_mega.inference.config import InferenceConfig
from areal_mega.launcher.config import LaunchConfig
from areal_mega.megatron.engine import MegatronEngineConfig
from areal_mega.parallel import ParallelConfig
from areal_mega.reward import RewardConfig
from areal_mega.rollout.config import RolloutConfig
from areal_mega.sandbox import check_extra_paths
from areal_mega.trainer.config import TrainerLoopConfig
from areal_mega.trainer.critic import CriticConfig
from areal_mega.weight_sync.config import WeightSyncConfig
from areal_mega.workflows import WorkflowConfig

__all__ = ["ExperimentConfig", "experiment_from_dict", "load_experiment"]


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
    ``algorithm.needs_reference`` (``kl_coef > 0``) a frozen, forward-only copy of the initial policy (``model_path``,
    same layout and ``actor.model`` settings, no optimizer) serves as the KL reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The PPO critic (trunk from ``model_path`` + value head, its own optimizer); built only
    when ``algorithm.needs_critic`` (an estimator that reads values, e.g. "gae")."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """SGLang servers (launched by the pool, or at ``inference.addresses``) and the client."""
    servers: dict[str, InferenceConfig] = field(default_factory=dict)
    """Other server pools, each defined once by name (judges, reward models); a judge's or a
    reward model's ``inference: <name>`` refers to one (each user still starts its own servers
    from a definition with launch settings; with ``addresses`` they share running ones)."""
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

    def __post_init__(self) -> None:
        # The one place the default is applied: servers start from the learners' initial weights
        # unless the file says otherwise.
        if self.model_path and not self.inference.server.model_path:
            self.inference.server.model_path = self.model_path
        _link_pools(self.reward, self.servers)

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: must name an HF model directory")
        if self.workflow.sampling.temperature <= 0:
            # pi_theta / pi_prox / pi_ref are computed at the behaviour policy's temperature
            raise ValueError(f"workflow.sampling.temperature: the learner's log-probs are taken at the sampling "
                             f"temperature, which must be > 0 for training, got {self.workflow.sampling.temperature}")
        if self.algorithm.num_minibatches > self.rollout.batch_size:
            raise ValueError(f"algorithm.num_minibatches: {self.algorithm.num_minibatches} mini-batches of whole groups "
                             f"need rollout.batch_size >= {self.algorithm.num_minibatches} groups per batch, "
                             f"got {self.rollout.batch_size}")
        scores_steps = self.reward.scores_steps()
        if self.algorithm.process_weight > 0 and self.workflow.steps.split == "none":
            raise ValueError("algorithm.process_weight: process rewards need step boundaries; set workflow.steps.split "
                             "(regex or turns)")
        if self.algorithm.process_weight > 0 and not scores_steps:
            raise ValueError("algorithm.process_weight: process rewards need a reward that scores steps; set "
                             "reward.step_scoring (or a composite component's)")
        if scores_steps and self.workflow.steps.split == "none":
            raise ValueError("reward.step_scoring: there are no steps to score; set workflow.steps.split (regex or turns)")
        if scores_steps and self.algorithm.process_weight == 0:
            raise ValueError("reward.step_scoring: the step scores would be unused with algorithm.process_weight 0")
        check_extra_paths(self, {"data.path": self.data.path, "output_dir": self.output_dir})
        if self.trainer.rollout_snapshot_every and not self.rollout.save_in_flight:
            raise ValueError("trainer.rollout_snapshot_every: snapshots save the episodes in flight; "
                             "it needs rollout.save_in_flight: true")
        if self.trainer.study_delay and self.rollout.max_staleness != self.trainer.study_delay:
            raise ValueError(f"trainer.study_delay: {self.trainer.study_delay} needs rollout.max_staleness equal to it "
                             f"(got {self.rollout.max_staleness}): the servers' version lags the learner's by the delay")
        if self.algorithm.proximal == "interpolate" and self.actor.model.moe_routing_replay != "off":
            raise ValueError(f"algorithm.proximal: 'interpolate' skips the proximal forward that "
                             f"actor.model.moe_routing_replay {self.actor.model.moe_routing_replay!r} uses; set 'forward'")
        if self.actor.model.moe_routing_replay == "observe" and not self.algorithm.decoupled:
            raise ValueError("actor.model.moe_routing_replay: 'observe' measures the routes in the proximal forward, "
                             "which only algorithm.decoupled computes; set algorithm.decoupled: true")
        if self.actor.model.moe_routing_replay == "proximal" and not self.algorithm.decoupled:
            raise ValueError("actor.model.moe_routing_replay: 'proximal' replays the proximal forward's routes, "
                             "which only algorithm.decoupled computes; set algorithm.decoupled: true or use 'rollout'")
        if self.inference.server.quantization == "fp8" and not self.algorithm.decoupled:
            raise ValueError("inference.server.quantization: fp8 behaviour log-probs differ from the bf16 learner's; the "
                             "decoupled loss's pi_prox / pi_behav weight corrects that: set algorithm.decoupled: true")


def _link_pools(node: object, servers: dict[str, InferenceConfig]) -> None:
    """Every ``inference: <name>`` under ``node`` becomes the pool ``servers[name]`` (an unknown
    name stays, for the owner's check to name it)."""
    if isinstance(node, list):
        for item in node:
            _link_pools(item, servers)
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "inference" and isinstance(value, str) and value in servers:
                setattr(node, f.name, servers[value])
            else:
                _link_pools(value, servers)


def experiment_from_dict(data: dict, where: str = "", *, whole: bool = True) -> ExperimentConfig:
    """The typed experiment of a YAML's dict (``where`` prefixes error messages).

    ``whole=False`` is for a launch whose learner command is not the trainer (the launcher's
    stand-ins, a site's own script): its YAML may carry other keys and need not name a model, so
    only the known sections it has are parsed (types and keys checked, and every setting nested
    in a section validated); the checks a section or the experiment makes across its fields for
    the trainer's use (e.g. ``inference``: a model or addresses) are skipped."""
    data = dict(data or {})  # the model_path default: ExperimentConfig.__post_init__
    if whole:
        return from_dict(ExperimentConfig, data, where)
    known = {f.name for f in dataclasses.fields(ExperimentConfig)}
    return from_dict(ExperimentConfig, {k: v for k, v in data.items() if k in known}, where, depth=2)


def load_experiment(path: str | None, overrides: list[str] | None = None) -> ExperimentConfig:
    data, where = load_dict(path, overrides)
    return experiment_from_dict(data, where)
