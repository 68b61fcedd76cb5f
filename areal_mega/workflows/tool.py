"""Tool-using agent workflow with a calculator.

Tool-call format (what the prompt should teach the model)::

    ... <calc>12 * (3 + 4)</calc>          model: an arithmetic expression in the tags
    <result>84</result>                     environment: the value (or "error: ...")
    ... The answer is 84.                   model continues; no tool call = final turn

Generation is cut right after the first ``</calc>`` (tokens sampled past it are dropped:
the kept prefix is exactly what the policy sampled, so it stays on-policy), the tool output
is appended with loss_mask 0, and the model is called again on the whole sequence. At most
``max_turns`` generation calls per sample. The reward sees the full transcript after the
prompt. The calculator evaluates +, -, *, /, //, %, ** and parentheses over numbers only (an
AST walk, no eval), with bounded exponents.
"""

from __future__ import annotations

import ast
import asyncio
import operator
from typing import Any

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationRequest
from areal_mega.api.workflow import Trajectory
from areal_mega.workflows.base import Tokenizer, TokenWorkflow, TrajectoryBuilder, decode, encode, new_group_id

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expr: str) -> str:
    """Evaluate an arithmetic expression safely; the result or "error: ..." as text."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("exponent too large")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {type(node).__name__}")

    if len(expr) > 200:
        return "error: expression too long"
    try:
        value = ev(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def cut_after_tool_call(tokenizer: Tokenizer, ids: list[int]) -> tuple[int, str] | None:
    """(k, expression) with k the fewest tokens whose text contains a complete tool call,
    or None if there is no complete call. Binary search: containing the closing tag is
    monotone in the prefix length."""
    text = decode(tokenizer, ids)
    start = text.find(CALL_OPEN)
    if start < 0 or text.find(CALL_CLOSE, start) < 0:
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        t = decode(tokenizer, ids[:mid])
        s = t.find(CALL_OPEN)
        if s >= 0 and t.find(CALL_CLOSE, s) >= 0:
            hi = mid
        else:
            lo = mid + 1
    prefix = decode(tokenizer, ids[:lo])
    s = prefix.find(CALL_OPEN)
    return lo, prefix[s + len(CALL_OPEN) : prefix.find(CALL_CLOSE, s)]


class ToolWorkflow(TokenWorkflow):
    async def _sample(self, engine: InferenceEngine, data: dict[str, Any], gid: str) -> Trajectory:
        prompt_ids = encode(self.tokenizer, data["prompt"])
        b = TrajectoryBuilder(prompt_ids)
        calls = 0
        for _ in range(self.cfg.max_turns):
            if len(b.input_ids) + self.sampling.max_new_tokens > self.cfg.max_context_tokens:
                break
            res = await engine.agenerate(GenerationRequest(list(b.input_ids), self.sampling))
            cut = cut_after_tool_call(self.tokenizer, res.output_ids)
            if cut is None:
                b.add_generated(res)
                break
            keep, expr = cut
            b.add_generated(res, keep=keep)
            b.add_env(encode(self.tokenizer, f"<result>{calculator(expr)}</result>"))
            calls += 1
        transcript = decode(self.tokenizer, b.input_ids[len(prompt_ids) :])
        reward = float(await self.reward_fn(data["prompt"], transcript, data))
        return b.build(reward, gid, {"num_tool_calls": calls, "completion": transcript})

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory]:
        gid = new_group_id(data)
        return list(await asyncio.gather(*[self._sample(engine, data, gid) for _ in range(self.cfg.group_size)]))
