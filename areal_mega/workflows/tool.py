"""Tool-using agent workflow: the model calls tools of a :class:`~areal_mega.agent_tools.ToolRegistry`
by name, in tags.

    ... <NAME>ARGUMENT</NAME>               model: a call (NAME = a registered tool's name)
    <result>OUTPUT</result>                 environment: the tool's output (or "error: ...")
    ... The answer is 84.                   model continues; no tool call = final turn

Invariant: generation is cut right after the first complete call, so the kept prefix is exactly
what the policy sampled; tool output has loss_mask 0. Details: docs/rollout.md ("Module notes").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Sequence

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationRequest
from areal_mega.api.workflow import Trajectory
from areal_mega.reward import COMPLETION_TOKENS, RewardFn
from areal_mega.agent_tools import ToolConfig, ToolRegistry, build_tools
from areal_mega.agent_tools.calculator import calculator
from areal_mega.config import check_each
from areal_mega.workflows.base import Tokenizer, TokenWorkflow, TrajectoryBuilder, WorkflowConfig, decode, encode, new_group_id, score

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


def find_call(text: str, names: Sequence[str]) -> tuple[int, str, str] | None:
    """(end offset, tool name, argument text) of the call that closes first in ``text``."""
    best = None
    for name in names:
        open_tag, close_tag = f"<{name}>", f"</{name}>"
        start = text.find(open_tag)
        if start < 0:
            continue
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            continue
        stop = end + len(close_tag)
        if best is None or stop < best[0]:
            best = (stop, name, text[start + len(open_tag) : end])
    return best


def cut_after_tool_call(tokenizer: Tokenizer, ids: list[int], names: Sequence[str] = ("calc",)) -> tuple[int, str, str] | None:
    """(k, tool name, argument text) with k the fewest tokens whose text contains a complete
    call, or None if there is none. Binary search: containing a complete call is monotone in
    the prefix length."""
    if find_call(decode(tokenizer, ids), names) is None:
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if find_call(decode(tokenizer, ids[:mid]), names) is not None:
            hi = mid
        else:
            lo = mid + 1
    found = find_call(decode(tokenizer, ids[:lo]), names)
    assert found is not None
    return lo, found[1], found[2]


class ToolWorkflow(TokenWorkflow):
    uses_tools = True  # EpisodeStack builds one registry (options.tools) for it and its eval variants

    @dataclass
    class Options:
        tools: list[ToolConfig] = field(default_factory=lambda: [ToolConfig(kind="calculator", name="calc")])
        """The tools the model may call, by name (``areal_mega.agent_tools``: calculator, python in the
        sandbox, user tools)."""
        timeout_s: float = 30.0
        """A tool call that takes longer returns "error: ... timed out" to the model."""
        max_output_chars: int = 4000
        """Longer tool outputs are cut (the model sees "...(truncated)")."""

        def validate(self) -> None:
            if not self.tools:
                raise ValueError("tools: kind 'tool' needs at least one tool")
            names = [t.tool_name() for t in self.tools]
            if len(set(names)) != len(names):
                raise ValueError(f"tools: tool names must be unique, got {names}")
            check_each("tools", self.tools)
            if self.timeout_s <= 0 or self.max_output_chars < 1:
                raise ValueError(f"timeout_s / max_output_chars: must be > 0, got {self.timeout_s}, "
                                 f"{self.max_output_chars}")

        def build(self) -> ToolRegistry:
            return build_tools(self.tools, timeout_s=self.timeout_s, max_output_chars=self.max_output_chars)

    def __init__(self, cfg: WorkflowConfig, tokenizer: Tokenizer, reward_fn: RewardFn,
                 tools: ToolRegistry | None = None) -> None:
        super().__init__(cfg, tokenizer, reward_fn, tools)
        self._own_tools = tools is None
        self.tools = tools if tools is not None else self.options.build()

    async def _sample(self, engine: InferenceEngine, data: dict[str, Any], gid: str) -> Trajectory:
        prompt_ids = encode(self.tokenizer, data["prompt"])
        b = TrajectoryBuilder(prompt_ids)
        calls: list[str] = []
        for _ in range(self.cfg.max_turns):
            if len(b.input_ids) + self.sampling.max_new_tokens > self.max_context_tokens:
                break
            res = await engine.agenerate(GenerationRequest(list(b.input_ids), self.sampling))
            cut = cut_after_tool_call(self.tokenizer, res.output_ids, self.tools.names())
            if cut is None:
                b.add_generated(res)
                break
            keep, name, text = cut
            b.add_generated(res, keep=keep)
            output = await self.tools.call(name, self.tools.args_from_text(name, text))
            b.add_env(encode(self.tokenizer, f"{RESULT_OPEN}{output}{RESULT_CLOSE}"))
            calls.append(name)
        transcript = decode(self.tokenizer, b.input_ids[len(prompt_ids) :])
        scored_data = {**data, COMPLETION_TOKENS: sum(b.loss_mask)}
        r = await score(self.reward_fn, data["prompt"], transcript, scored_data)
        await self.score_steps(b, data["prompt"], scored_data)
        return b.build(r.score, gid, {"num_tool_calls": len(calls), "tool_calls": calls, "completion": transcript,
                                      "reward_info": r.info})

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory]:
        gid = new_group_id(data)
        return list(await asyncio.gather(*[self._sample(engine, data, gid) for _ in range(self.cfg.group_size)]))

    def close(self) -> None:
        """The registry's tools (the python tool's sandbox workers), when this workflow built it."""
        if self._own_tools:
            self.tools.close()


__all__ = ["RESULT_CLOSE", "RESULT_OPEN", "ToolWorkflow", "calculator", "cut_after_tool_call", "find_call"]
