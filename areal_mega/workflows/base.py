"""Shared pieces of the workflows: the tokenizer contract, the config, trajectory assembly."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

from areal_mega.api.io import GenerationResult, SamplingParams
from areal_mega.api.workflow import RolloutWorkflow, Trajectory
from areal_mega.kinds import fill_default_options
from areal_mega.reward import RewardFn, RewardResult, evaluate, evaluate_steps
from areal_mega.agent_tools import ToolRegistry
from areal_mega.workflows.steps import StepConfig, split_steps


class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer the workflows use."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class WorkflowConfig:
    kind: str = "single_turn"
    """A built-in below or "package.module:Name", a ``RolloutWorkflow`` called as
    ``Name(cfg, tokenizer, reward_fn, tools)`` (its own settings in ``options``). "single_turn": prompt -> group of samples -> reward. "multi_turn": on a wrong answer the
    environment appends ``feedback`` and the model tries again. "tool": the model may call the
    calculator tool (``<calc>expr</calc>``; see ``areal_mega.workflows.tool``). "agent": the
    agent function ``agent`` drives the model through an OpenAI-style client
    (``areal_mega.workflows.agent``)."""
    options: Any = None
    """The kind's own settings (its ``Options`` dataclass: multi_turn, tool, agent, or a user kind's)."""
    group_size: int = 4
    """Samples per prompt (a GRPO group)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Per-generation-call sampling settings (max_new_tokens is per turn)."""
    max_turns: int = 3
    """multi_turn: attempts per sample; tool: generation calls per sample (tool calls + 1);
    agent: model calls per episode (one more ends the episode with reward 0)."""
    max_context_tokens: int = 4096
    """multi_turn / tool: stop when another turn could exceed this many tokens in total; agent:
    a call whose prompt + max_tokens exceeds it ends the episode with reward 0. The budget used is
    this or the model's own context length (config.json ``max_position_embeddings``), whichever
    is smaller."""
    steps: StepConfig = field(default_factory=StepConfig)
    """How generated tokens are cut into steps (``Trajectory.step_ends``); the reward's
    ``evaluate_steps`` (``reward.step_scoring``) then gives each step its reward."""

    OPEN_KINDS: ClassVar[dict[str, str]] = {"kind": "workflow"}

    def __post_init__(self) -> None:
        fill_default_options(self)

    def validate(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {self.max_turns}")
        self.sampling.validate()
        try:
            self.steps.validate()
        except ValueError as e:
            raise ValueError(f"steps.{e}") from None


def model_context_len(tokenizer: Any) -> int | None:
    """The model's own context length (``max_position_embeddings`` of the ``config.json`` next to
    the tokenizer: the trainer and the evaluator load both from ``model_path``), None if unknown."""
    path = getattr(tokenizer, "name_or_path", None)
    try:
        with open(f"{path}/config.json") as f:
            cfg = json.load(f)
    except (OSError, TypeError, ValueError):
        return None
    n = cfg.get("max_position_embeddings", (cfg.get("text_config") or {}).get("max_position_embeddings"))
    return int(n) if isinstance(n, int) and n > 0 else None


async def score(reward_fn: RewardFn, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
    """``reward.evaluate`` for a workflow: a reward that raises fails the episode with reason
    ``reward_exception`` (``areal_mega.rollout.failures``), counted, never the run's end."""
    from areal_mega.rollout.failures import EpisodeFailure

    try:
        return await evaluate(reward_fn, prompt, completion, data)
    except Exception as e:
        raise EpisodeFailure("reward_exception", f"{type(e).__name__}: {e}") from e


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def with_eos(sampling: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """Sampling params whose stop ids include the tokenizer's EOS."""
    return sampling.with_stop_token(getattr(tokenizer, "eos_token_id", None))


def new_group_id(data: dict[str, Any]) -> str:
    """Unique per episode (the same prompt in two epochs must not merge into one group)."""
    return f"{data.get('id', '')}#{uuid.uuid4().hex[:12]}"


class TokenWorkflow(RolloutWorkflow):
    """Set-up shared by the token-level workflows (built-in or a user's): a validated config and
    its options, the tokenizer, the reward, the tools (kind "tool" or a user kind that wants them),
    and the sampling params with the tokenizer's EOS added to the stop tokens."""

    def __init__(self, cfg: WorkflowConfig, tokenizer: Tokenizer, reward_fn: RewardFn,
                 tools: ToolRegistry | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.options = cfg.options
        """The kind's own typed options (its ``Options`` dataclass), None for kinds without."""
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.tools = tools
        self.sampling = with_eos(cfg.sampling, tokenizer)
        model_len = model_context_len(tokenizer)
        self.max_context_tokens = min(cfg.max_context_tokens, model_len or cfg.max_context_tokens)
        """Context budget of an episode: ``workflow.max_context_tokens`` or the model's own context
        length (config.json ``max_position_embeddings``), whichever is smaller."""

    async def score_steps(self, b: "TrajectoryBuilder", prompt: str, data: dict[str, Any]) -> None:
        """Cut ``b``'s generated turns into steps (``cfg.steps``) and score them with the reward's
        ``evaluate_steps`` (none when it has none: boundaries only)."""
        ends, texts = split_steps(self.tokenizer, b.turns, self.cfg.steps)
        b.step_ends = ends
        b.step_rewards = (await evaluate_steps(self.reward_fn, prompt, texts, data) or []) if ends else []


class TrajectoryBuilder:
    """Appends prompt / environment tokens (loss_mask 0) and generated tokens (loss_mask 1,
    with their behaviour log-probs and versions) into one aligned sequence."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.input_ids = list(prompt_ids)
        self.loss_mask = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.versions = [-1] * len(prompt_ids)
        self.num_interruptions = 0
        self.turns: list[list[int]] = []
        """The generated ids of each ``add_generated`` call (the step splitter's turns)."""
        self.step_ends: list[int] = []
        self.step_rewards: list[float] = []
        self.routes: np.ndarray | None = None  # rows for the first len(routes) tokens (see add_generated)

    def add_env(self, ids: list[int]) -> None:
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, res: GenerationResult, keep: int | None = None) -> None:
        """Append the first ``keep`` generated tokens (all by default): truncating a sample
        keeps it on-policy, its prefix is exactly what was sampled."""
        n = len(res.output_ids) if keep is None else keep
        if res.routes is not None:
            # The call's routes cover its input (this sequence so far) and its tokens but the last;
            # rows already held came from the call that first fed those tokens: keep them.
            have = 0 if self.routes is None else len(self.routes)
            new = res.routes[have:len(self.input_ids) + n - 1]
            self.routes = new if self.routes is None else np.concatenate([self.routes, new])
        self.input_ids += res.output_ids[:n]
        self.loss_mask += [1] * n
        self.logprobs += list(res.output_logprobs[:n])
        self.versions += list(res.output_versions[:n])
        self.num_interruptions += res.num_interruptions
        self.turns.append(list(res.output_ids[:n]))

    def build(self, reward: float, group_id: str, info: dict[str, Any]) -> Trajectory:
        info = {"num_interruptions": self.num_interruptions, **info}
        routes = None
        if self.routes is not None:
            routes = np.full((len(self.input_ids), self.routes.shape[1]), -1, dtype=np.int16)
            routes[:len(self.routes)] = self.routes
        return Trajectory(self.input_ids, self.loss_mask, self.logprobs, self.versions, reward, group_id, info,
                          step_ends=list(self.step_ends), step_rewards=list(self.step_rewards), routes=routes)
