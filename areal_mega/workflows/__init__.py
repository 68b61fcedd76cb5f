"""Rollout workflows (``RolloutWorkflow.arun_episode(engine, data) -> list[Trajectory]``).

    wf = build_workflow(WorkflowConfig(kind="single_turn", group_size=8), tokenizer, reward_fn)

single_turn: one answer per sample; multi_turn: retry with feedback; tool: calls of the tools in
an ``areal_mega.agent_tools.ToolRegistry`` (built from ``cfg.tools`` unless one is passed: pass one
registry to several workflows to share its sandbox workers; close it yourself then).
agent: agent code written against an OpenAI-style client (workflows/agent.py).
Prompt / feedback / tool-output tokens have loss_mask 0; generated tokens carry the engine's
behaviour log-probs and per-token policy versions.
"""

from __future__ import annotations

from areal_mega.reward import RewardFn
from areal_mega.workflows.agent import AgentClient, AgentWorkflow
from areal_mega.agent_tools import ToolRegistry
from areal_mega.workflows.base import Tokenizer, WorkflowConfig
from areal_mega.workflows.multi_turn import MultiTurnWorkflow
from areal_mega.workflows.single_turn import SingleTurnWorkflow
from areal_mega.workflows.tool import ToolWorkflow, calculator

_KINDS = {"single_turn": SingleTurnWorkflow, "multi_turn": MultiTurnWorkflow, "tool": ToolWorkflow,
          "agent": AgentWorkflow}


def build_workflow(cfg: WorkflowConfig, tokenizer: Tokenizer, reward_fn: RewardFn, tools: ToolRegistry | None = None):
    if cfg.kind not in _KINDS:
        raise ValueError(f"kind: unknown workflow {cfg.kind!r} (known: {sorted(_KINDS)})")
    if cfg.kind == "tool":
        return ToolWorkflow(cfg, tokenizer, reward_fn, tools)
    return _KINDS[cfg.kind](cfg, tokenizer, reward_fn)


__all__ = ["AgentClient", "AgentWorkflow", "MultiTurnWorkflow", "SingleTurnWorkflow", "ToolWorkflow", "WorkflowConfig", "build_workflow", "calculator"]
