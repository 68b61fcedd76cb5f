"""A multi-step calculator agent, written only against the OpenAI chat-completions interface
(it would run unchanged on ``openai.AsyncOpenAI``).

    workflow: {kind: agent, agent: "areal_mega.workflows.examples.calculator_agent:calculator_agent", max_turns: 4}

Each step asks the model; a tool call is run by the project's tool registry
(``areal_mega.agent_tools``: the same tools the tool workflow calls, here the safe AST calculator),
its result sent back as a tool message; a reply with ``Answer: <value>`` ends the episode with
that answer (scored by the configured reward); any other reply gets a nudge and another step,
at most ``MAX_STEPS``.
"""

from __future__ import annotations

import re
from typing import Any

from areal_mega.agent_tools import ToolRegistry, calculator_tool

MAX_STEPS = 4
SYSTEM = "Solve the problem. Use the calculator tool for arithmetic. Finish with 'Answer: <number>'."
NUDGE = "Use the calculator tool, or give the final answer as 'Answer: <number>'."
TOOLS = ToolRegistry([calculator_tool("calculator")])  # no processes: nothing to close
_ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)


async def calculator_agent(client: Any, sample: dict[str, Any]) -> str:
    """Returns the final answer ("" if the model never gave one)."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": sample.get("question") or sample["prompt"]}]
    for _ in range(MAX_STEPS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS.schemas())
        msg = reply.choices[0].message
        messages.append(msg)
        if msg.tool_calls:
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": await TOOLS.call_openai(call.function.name, call.function.arguments)})
            continue
        found = _ANSWER.findall(msg.content or "")
        if found:
            return found[-1].strip().rstrip(".")
        messages.append({"role": "user", "content": NUDGE})
    return ""
