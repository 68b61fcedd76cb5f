"""The episode stack: tokenizer, reward, tools and workflow, built ONE way for the trainer and for
``areal-mega eval`` (what evaluation scores is exactly what training scores).

    stack = EpisodeStack.build(model_path, cfg.workflow, cfg.reward, policy_engine=pool)
    stack.workflow                      # the training workflow
    greedy, sampled = stack.eval_workflows(temperature=..., num_samples=...)
    stack.close()                       # reward workers, the python tool's sandbox workers
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.workflow import RolloutWorkflow
from areal_mega.reward import RewardConfig, RewardFn, build_reward
from areal_mega.agent_tools import ToolRegistry
from areal_mega.kinds import resolve
from areal_mega.workflows.base import Tokenizer, WorkflowConfig

__all__ = ["EpisodeStack"]


@dataclass
class EpisodeStack:
    cfg: WorkflowConfig
    tokenizer: Tokenizer
    reward: RewardFn
    """Owns worker processes for math / isolated rewards; a judge on the policy's servers
    (``reward.options.servers: policy``) uses ``policy_engine``."""
    tools: ToolRegistry | None
    """A workflow kind that ``uses_tools``: one registry (one python-tool sandbox) for every
    workflow built here."""
    workflow: RolloutWorkflow
    """The training workflow."""

    @classmethod
    def build(cls, model_path: str, workflow: WorkflowConfig, reward: RewardConfig, *,
              policy_engine: InferenceEngine) -> "EpisodeStack":
        """Tokenizer, reward, tools (for a workflow kind that ``uses_tools``) and workflow of the
        config, each by its kind (``areal_mega.kinds``)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        kind = resolve("workflow", workflow.kind)
        tools = None
        if getattr(kind, "uses_tools", False):  # its options say which (ToolWorkflow.Options.build)
            tools = workflow.options.build()
        try:
            fn = build_reward(reward, policy_engine=policy_engine, policy_tokenizer=tok)
            return cls(workflow, tok, fn, tools, kind(workflow, tok, fn, tools))
        except BaseException:
            if tools is not None:
                tools.close()
            raise

    def eval_workflows(self, *, num_samples: int = 0, temperature: float = 1.0
                       ) -> tuple[RolloutWorkflow, RolloutWorkflow | None]:
        """(greedy: one sample at temperature 0, sampled: ``num_samples`` at ``temperature`` for
        pass@k or None): the training workflow's class with only group size and temperature
        changed."""
        def variant(group_size: int, temp: float) -> RolloutWorkflow:
            cfg = dataclasses.replace(self.cfg, group_size=group_size,
                                      sampling=dataclasses.replace(self.cfg.sampling, temperature=temp))
            return type(self.workflow)(cfg, self.tokenizer, self.reward, self.tools)

        return variant(1, 0.0), (variant(num_samples, temperature) if num_samples else None)

    def close(self) -> None:
        try:
            self.reward.close()
        finally:
            if self.tools is not None:
                self.tools.close()
