"""A local OpenAI-compatible HTTP endpoint in front of the episodes' ``AgentClient``s, for agent
code that wants a URL (an ``openai.AsyncOpenAI(base_url=...)``, an agent framework, a subprocess):

    POST {base_url}/chat/completions      base_url = http://127.0.0.1:<port>/episodes/<key>/v1

The body is the OpenAI JSON (model, messages, tools, temperature, max_tokens, ...), the answer
the OpenAI ``chat.completion`` JSON. Each episode gets its own ``key``, so its calls are recorded
by its own client, exactly as in-process calls are (same template, token and version rules;
``areal_mega.workflows.agent``). Bad requests answer 400 with an OpenAI-style error object
(``invalid_request_error``; ``budget_exceeded`` when the episode's call/context budget is spent),
an unknown episode 404. The server lives on the rollout event loop (aiohttp), bound to loopback.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from aiohttp import web

from areal_mega.workflows.agent import AgentBudgetExceeded, AgentClient


class ChatCompletionsServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self._clients: dict[str, AgentClient] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/episodes/{key}/v1/chat/completions", self._create)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_episode(self, client: AgentClient) -> str:
        """Serve ``client`` under a new key; returns its base URL (also set as ``client.base_url``)."""
        assert self._runner is not None, "start() first"
        key = uuid.uuid4().hex
        self._clients[key] = client
        client.base_url = f"http://{self.host}:{self.port}/episodes/{key}/v1"
        client.endpoint_key = key
        return client.base_url

    def close_episode(self, client: AgentClient) -> None:
        self._clients.pop(getattr(client, "endpoint_key", ""), None)

    async def _create(self, request: web.Request) -> web.Response:
        client = self._clients.get(request.match_info["key"])
        if client is None:
            return _error(404, "no such episode (finished, or never opened)", "not_found")
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ValueError("messages: a list of messages is required")
            completion = await client.chat.completions.create(**body)
        except AgentBudgetExceeded as e:
            return _error(400, str(e), "budget_exceeded")
        except (TypeError, ValueError, KeyError) as e:  # bad arguments / messages: the caller's fault
            return _error(400, f"{type(e).__name__}: {e}", "invalid_request_error")
        return web.json_response(_to_json(completion))


def _to_json(completion: Any) -> dict[str, Any]:
    d = dataclasses.asdict(completion)
    for choice in d["choices"]:
        if choice["message"]["tool_calls"] is None:
            del choice["message"]["tool_calls"]
    return d


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": kind}}, status=status)
