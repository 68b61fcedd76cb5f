"""A multi-step calculator agent, written only against the OpenAI chat-completions interface
(it would run unchanged on ``openai.AsyncOpenAI``).

    workflow: {kind: agent, agent: "areal_mega.workflows.examples.calculator_agent:calculator_agent", max_turns: 4}

Each step asks the model; a tool call to ``calculator`` is evaluated (the safe AST calculator of
``areal_mega.workflows.tool``) and its result sent back as a tool message; a reply with
``Answer: <value>`` ends the episode with that answer (scored by the configured reward); any
other reply gets a nudge and another step, at most ``MAX_STEPS``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from areal_mega.workflows.tool import calculator

MAX_STEPS = 4
SYSTEM = "Solve the problem. Use the calculator tool for arithmetic. Finish with 'Answer: <number>'."
NUDGE = "Use the calculator tool, or give the final answer as 'Answer: <number>'."
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
_ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)


def run_tool(name: str, arguments: str) -> str:
    """The tool's reply as text; bad calls get an error message, as a real tool would send."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        expr = json.loads(arguments)["expression"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return 'error: arguments must be {"expression": "<arithmetic>"}'
    return calculator(str(expr))


async def calculator_agent(client: Any, sample: dict[str, Any]) -> str:
    """Returns the final answer ("" if the model never gave one)."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": sample.get("question") or sample["prompt"]}]
    for _ in range(MAX_STEPS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL])
        msg = reply.choices[0].message
        messages.append(msg)
        if msg.tool_calls:
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(call.function.name, call.function.arguments)})
            continue
        found = _ANSWER.findall(msg.content or "")
        if found:
            return found[-1].strip().rstrip(".")
        messages.append({"role": "user", "content": NUDGE})
    return ""
