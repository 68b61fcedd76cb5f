"""Agents for tests that run the real trainer (``workflow.kind: agent``, ``options.function``)."""

from __future__ import annotations

from typing import Any

TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}a:{% endif %}")
"""A chat template short enough for the tiny task model's 256-token context (3 turns fit)."""


async def three_calls(client: Any, sample: dict[str, Any]) -> str:
    """Three chat calls whatever the model says, written only against the OpenAI interface;
    the last reply is the answer."""
    messages: list[Any] = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "?"}]
    return reply.choices[0].message.content or ""
