"""Rollout workflows (``RolloutWorkflow.arun_episode(engine, data) -> list[Trajectory]``).

    wf = build_workflow(WorkflowConfig(kind="single_turn", group_size=8), tokenizer, reward_fn)

single_turn: one answer per sample; multi_turn: retry with feedback; tool: calls of the tools in
an ``areal_mega.agent_tools.ToolRegistry`` (built from ``cfg.options.tools`` unless one is passed: pass one
registry to several workflows to share its sandbox workers; close it yourself then).
agent: agent code written against an OpenAI-style client (workflows/agent.py); or a user's
"package.module:Name" (a ``RolloutWorkflow`` called as ``Name(cfg, tokenizer, reward_fn, tools)``).
Prompt / feedback / tool-output tokens have loss_mask 0; generated tokens carry the engine's
behaviour log-probs and per-token policy versions.
"""

from __future__ import annotations

from areal_mega.kinds import resolve
from areal_mega.reward import RewardFn
from areal_mega.workflows.agent import AgentClient, AgentWorkflow
from areal_mega.agent_tools import ToolRegistry
from areal_mega.workflows.base import Tokenizer, WorkflowConfig
from areal_mega.workflows.multi_turn import MultiTurnWorkflow
from areal_mega.workflows.single_turn import SingleTurnWorkflow
from areal_mega.workflows.tool import ToolWorkflow, calculator

def build_workflow(cfg: WorkflowConfig, tokenizer: Tokenizer, reward_fn: RewardFn, tools: ToolRegistry | None = None):
    """The workflow ``cfg.kind`` names (a built-in or a user's "package.module:Name",
    ``areal_mega.kinds``), called as ``Kind(cfg, tokenizer, reward_fn, tools)``."""
    return resolve("workflow", cfg.kind)(cfg, tokenizer, reward_fn, tools)


__all__ = ["AgentClient", "AgentWorkflow", "MultiTurnWorkflow", "SingleTurnWorkflow", "ToolWorkflow", "WorkflowConfig", "build_workflow", "calculator"]
