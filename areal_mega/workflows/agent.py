"""Agents written against the OpenAI chat-completions interface, trained as RL episodes.

    async def my_agent(client, sample):            # workflow.options.function: "my_pkg.agents:my_agent"
        r = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        return "42"                                # final answer (scored by the reward) or a float

Token ids in, token ids out: a trajectory's ``input_ids`` are exactly the ids the server was sent
and generated, never re-tokenized; ``loss_mask`` is 1 exactly on generated tokens. The dataflow
of a call, the concatenation rule and the tool-call format: docs/agents.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationRequest, GenerationResult, SamplingParams
from areal_mega.api.workflow import Trajectory
from areal_mega.reward import COMPLETION_TOKENS, RewardFn
from areal_mega.kinds import resolve
from areal_mega.rollout.failures import EpisodeFailure, failure_reason, is_context_overflow
from areal_mega.workflows.base import Tokenizer, TokenWorkflow, TrajectoryBuilder, WorkflowConfig, new_group_id, score


# -- the OpenAI response shape (the subset agent code reads) ----------------------------------------
@dataclass
class Function:
    name: str
    arguments: str
    """JSON text, as in the OpenAI API."""


@dataclass
class ChatCompletionMessageToolCall:
    id: str
    function: Function
    type: str = "function"


@dataclass
class ChatCompletionMessage:
    content: str | None
    role: str = "assistant"
    tool_calls: list[ChatCompletionMessageToolCall] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message as the OpenAI API's JSON (what agents append to ``messages``)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [{"id": tc.id, "type": tc.type, "function": {"name": tc.function.name,
                                                                         "arguments": tc.function.arguments}}
                               for tc in self.tool_calls]
        return d

    model_dump = to_dict  # the pydantic name agent code written for the openai package uses


@dataclass
class Choice:
    index: int
    message: ChatCompletionMessage
    finish_reason: str
    """"stop", "length" or "tool_calls"."""


@dataclass
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletion:
    id: str
    choices: list[Choice]
    created: int
    model: str
    usage: CompletionUsage
    object: str = "chat.completion"


class AgentBudgetExceeded(RuntimeError):
    """The episode ran out of model calls (``workflow.max_turns``) or context (the smaller of
    ``workflow.max_context_tokens`` and the model's own length, or the server refused the prompt
    as too long); the workflow ends it with reward 0."""


# -- tool calls ---------------------------------------------------------------------------------------
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[ChatCompletionMessageToolCall], int]:
    """(content, tool calls, number of malformed calls) of a model output in the Qwen format."""
    calls, bad = [], 0
    first = None
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name is not a string")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            bad += 1
            continue
        first = m.start() if first is None else first
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(ChatCompletionMessageToolCall(f"call_{uuid.uuid4().hex[:12]}", Function(name, arguments)))
    if not calls:
        return text, [], bad
    content = text[:first].strip()
    return content or None, calls, bad


# -- the client ------------------------------------------------------------------------------------------
@dataclass
class CallRecord:
    """One model call as the trainer sees it."""

    prompt_ids: list[int]
    result: GenerationResult
    parent: int | None
    """Index of the record whose whole context (prompt + output) this call's prompt extends."""
    completion: ChatCompletion
    context_text: str
    """Decoded prompt + output (special tokens kept): what a later prompt must start with."""
    num_bad_tool_calls: int = 0


def _message_key(m: Any) -> tuple | None:
    """(content, tool calls) of an assistant message given as our dataclass or as a dict."""
    if isinstance(m, ChatCompletionMessage):
        m = m.to_dict()
    if not isinstance(m, dict) or m.get("role") != "assistant":
        return None
    tcs = []
    for tc in m.get("tool_calls") or []:
        fn = tc["function"] if isinstance(tc, dict) else tc.function
        tcs.append((fn["name"], fn["arguments"]) if isinstance(fn, dict) else (fn.name, fn.arguments))
    return (m.get("content"), tuple(tcs))


class _Completions:
    def __init__(self, client: "AgentClient") -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> ChatCompletion:
        return await self._client._create(**kwargs)


class _Chat:
    def __init__(self, client: "AgentClient") -> None:
        self.completions = _Completions(client)


class AgentClient:
    """An OpenAI-client look-alike (``client.chat.completions.create(...)``, async) bound to one
    episode: every call goes to ``engine`` as token ids and is recorded (``records``). See the
    module docstring for the contract. Supported arguments: model (ignored: the policy answers),
    messages, tools, tool_choice ("auto" / "none"), temperature, top_p, max_tokens /
    max_completion_tokens, n (1 only); others raise TypeError, like an unknown keyword."""

    def __init__(self, engine: InferenceEngine, tokenizer: Any, sampling: SamplingParams, *,
                 max_calls: int | None = None, max_context_tokens: int | None = None, model: str = "policy") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling.with_stop_token(getattr(tokenizer, "eos_token_id", None))
        self.max_calls = max_calls
        self.max_context_tokens = max_context_tokens
        self.model = model
        self.chat = _Chat(self)
        self.base_url: str | None = None
        """With ``workflow.options.http``: this episode's OpenAI-compatible endpoint (``/v1``)."""
        self.records: list[CallRecord] = []
        self.budget_exceeded = False
        self._raw: dict[tuple, str] = {}  # (content, tool calls) of our replies -> the model's text

    def _render_form(self, m: Any) -> dict[str, Any]:
        key = _message_key(m)
        if key is not None and key in self._raw:
            return {"role": "assistant", "content": self._raw[key]}
        return m.to_dict() if isinstance(m, ChatCompletionMessage) else m

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, text: str) -> tuple[list[int], int | None]:
        """The ids for prompt ``text``: the longest recorded context it extends + the new text's
        tokens, or all of its tokens (parent None)."""
        parent = None
        for i, r in enumerate(self.records):
            if text.startswith(r.context_text) and (parent is None or len(r.context_text) > len(self.records[parent].context_text)):
                parent = i
        if parent is None:
            return self._encode(text), None
        r = self.records[parent]
        return r.prompt_ids + r.result.output_ids + self._encode(text[len(r.context_text):]), parent

    async def _create(self, *, messages: list[Any], model: str | None = None, tools: list[dict] | None = None,
                      tool_choice: Any = None, temperature: float | None = None, top_p: float | None = None,
                      max_tokens: int | None = None, max_completion_tokens: int | None = None, n: int | None = None,
                      **unsupported: Any) -> ChatCompletion:
        if unsupported:
            raise TypeError(f"chat.completions.create: unsupported arguments {sorted(unsupported)} "
                            "(supported: model, messages, tools, tool_choice, temperature, top_p, max_tokens, n=1)")
        if n not in (None, 1):
            raise ValueError(f"n: only n=1 is supported (run more episodes for more samples), got {n}")
        if tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice: only 'auto' and 'none' are supported, got {tool_choice!r}")
        if self.max_calls is not None and len(self.records) >= self.max_calls:
            self.budget_exceeded = True
            raise AgentBudgetExceeded(f"episode made {len(self.records)} model calls (workflow.max_turns)")
        rendered = [self._render_form(m) for m in messages]
        kw = {"tools": tools} if tools and tool_choice != "none" else {}
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **kw)
        ids, parent = self.prompt_ids(text)
        sampling = dataclasses.replace(self.sampling, **{k: v for k, v in {
            "temperature": temperature, "top_p": top_p, "max_new_tokens": max_completion_tokens or max_tokens}.items()
            if v is not None})
        if self.max_context_tokens is not None and len(ids) + sampling.max_new_tokens > self.max_context_tokens:
            self.budget_exceeded = True
            raise AgentBudgetExceeded(f"prompt of {len(ids)} tokens + max_tokens {sampling.max_new_tokens} > "
                                      f"context budget {self.max_context_tokens} (workflow.max_context_tokens "
                                      "or the model's max_position_embeddings)")
        try:
            res = await self.engine.agenerate(GenerationRequest(list(ids), sampling))
        except Exception as e:
            if not is_context_overflow(e):
                raise
            # The server's own limit is lower than ours (e.g. --context-length): the same budget rule.
            self.budget_exceeded = True
            raise AgentBudgetExceeded(f"the server refused a prompt of {len(ids)} tokens as too long: {e}") from e
        out = list(res.output_ids)
        body = out[:-1] if res.finish_reason == "stop" and out and out[-1] in sampling.stop_token_ids else out
        raw = self.tokenizer.decode(body, skip_special_tokens=False)
        content, calls, bad = parse_tool_calls(self.tokenizer.decode(out, skip_special_tokens=True))
        msg = ChatCompletionMessage(content=content, tool_calls=calls or None)
        finish = "tool_calls" if calls else ("length" if res.finish_reason == "length" else "stop")
        completion = ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex[:16]}", choices=[Choice(0, msg, finish)], created=int(time.time()),
            model=model or self.model,
            usage=CompletionUsage(len(ids), len(out), len(ids) + len(out)))
        self._raw[_message_key(msg)] = raw
        context_text = self.tokenizer.decode(ids + out, skip_special_tokens=False)
        self.records.append(CallRecord(list(ids), res, parent, completion, context_text, bad))
        return completion

    def trajectory_builders(self, *, concat: bool = True) -> tuple[list[TrajectoryBuilder], list[int], list[int]]:
        """The recorded calls assembled into builders (module docstring: concatenation), with
        each builder's last call and each call's builder."""
        builders: list[TrajectoryBuilder] = []
        last_call: list[int] = []      # per trajectory: index of its last call
        segment_of: list[int] = []     # per call: its trajectory
        for i, r in enumerate(self.records):
            seg = segment_of[r.parent] if concat and r.parent is not None else None
            if seg is not None and last_call[seg] == r.parent:
                b = builders[seg]
                assert r.prompt_ids[: len(b.input_ids)] == b.input_ids, "a child's prompt must extend its parent's context"
                b.add_env(r.prompt_ids[len(b.input_ids):])
            else:  # a new context, a branch off an earlier call, or per-call trajectories
                seg = len(builders)
                builders.append(TrajectoryBuilder(r.prompt_ids))
                last_call.append(i)
            builders[seg].add_generated(r.result)
            last_call[seg] = i
            segment_of.append(seg)
        return builders, last_call, segment_of

    def trajectories(self, reward: float, group_id: str, *, concat: bool = True, turn_discount: float = 1.0,
                     info: dict[str, Any] | None = None,
                     builders: tuple[list[TrajectoryBuilder], list[int], list[int]] | None = None) -> list[Trajectory]:
        """The recorded calls as trajectories (module docstring: concatenation and discounting);
        ``builders``: ``trajectory_builders(concat=concat)``'s result, e.g. with steps scored."""
        builders, last_call, segment_of = builders or self.trajectory_builders(concat=concat)
        n = len(self.records)
        out = []
        for seg, b in enumerate(builders):
            calls = [i for i, s in enumerate(segment_of) if s == seg]
            k = n - 1 - last_call[seg]
            out.append(b.build(reward * turn_discount ** k, group_id, {
                **(info or {}), "num_calls": len(calls), "num_episode_calls": n, "num_trajectories": len(builders),
                "num_bad_tool_calls": sum(self.records[i].num_bad_tool_calls for i in calls)}))
        return out


# -- the workflow ----------------------------------------------------------------------------------------
AgentFn = Callable[[AgentClient, dict[str, Any]], Awaitable[Any]]


class AgentWorkflow(TokenWorkflow):
    """``workflow.kind: agent``: ``group_size`` episodes of the agent function ``options.function``
    ("module:function", ``async def agent(client, sample)``) per sample, one ``AgentClient`` each.

    The agent's return value decides the reward: a number is the reward itself; a string is the
    final answer, scored by the configured reward as ``reward(prompt, answer, sample)``; None
    scores the last reply's content the same way. An episode that exceeds its budget
    (``AgentBudgetExceeded``) gets reward 0. ``prompt`` is the sample's "prompt" (or "question").
    With ``options.http`` each episode's client also has ``base_url``, a local
    OpenAI-compatible endpoint recording into the same client (``agent_http.py``)."""

    @dataclass
    class Options:
        function: str = ""
        """"module:function", an ``async def agent(client, sample)`` returning the reward (a number)
        or the final answer (a string, scored by the configured reward)."""
        trajectories: Literal["concat", "per_call"] = "concat"
        """"concat" joins calls whose prompt extends the previous call's whole context into one
        trajectory (others start a new one); "per_call": one trajectory per model call."""
        http: bool = False
        """Also serve each episode's client as a local OpenAI-compatible HTTP endpoint
        (``client.base_url``, for agent code that needs a URL)."""
        turn_discount: float = 1.0
        """A trajectory's reward is the episode's times this ** (calls made after its last call);
        1.0 = no discount."""
        replayable: bool = True
        """The agent keeps the replay contract (``RolloutWorkflow``, docs/resume.md): given the same
        replies it makes the same calls (its tools deterministic), so an episode a checkpoint saved
        resumes at the call it had reached, the earlier replies answered from the checkpoint.
        False (it reads a clock, a live service, unseeded randomness): saved episodes restart."""

        def validate(self) -> None:
            if ":" not in self.function:
                raise ValueError(f"function: kind 'agent' needs 'module:function', got {self.function!r}")
            if not 0 < self.turn_discount <= 1:
                raise ValueError(f"turn_discount: must be in (0, 1], got {self.turn_discount}")

    def __init__(self, cfg: WorkflowConfig, tokenizer: Tokenizer, reward_fn: RewardFn,
                 tools: Any = None, *, agent: AgentFn | None = None) -> None:
        super().__init__(cfg, tokenizer, reward_fn, tools)
        if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("kind: workflow 'agent' needs a tokenizer with a chat template")
        if agent is None:
            try:
                self.options.validate()
            except ValueError as e:
                raise ValueError(f"options.{e}") from None
        self.agent = agent or resolve("agent", self.options.function)
        self.replayable = self.options.replayable
        self._server: Any = None  # options.http: the ChatCompletionsServer, started on first use
        if not inspect.iscoroutinefunction(self.agent):
            raise ValueError(f"agent: {self.options.function!r} must be an async function (client, sample)")

    async def client(self, engine: InferenceEngine) -> AgentClient:
        client = AgentClient(engine, self.tokenizer, self.sampling, max_calls=self.cfg.max_turns,
                             max_context_tokens=self.max_context_tokens)
        if self.options.http:
            if self._server is None:  # on the rollout loop, at first use
                from areal_mega.workflows.agent_http import ChatCompletionsServer

                server = ChatCompletionsServer()
                await server.start()
                self._server = server
            self._server.open_episode(client)
        return client

    async def aclose(self) -> None:
        """Stop the HTTP endpoint (``options.http``), if it was started."""
        if self._server is not None:
            server, self._server = self._server, None
            await server.close()

    async def _episode(self, engine: InferenceEngine, data: dict[str, Any], gid: str) -> list[Trajectory]:
        client = await self.client(engine)
        prompt = str(data.get("prompt", data.get("question", "")))
        status = "ok"
        try:
            result = await self.agent(client, data)
        except Exception as e:
            # Out of budget: the episode ends with reward 0, whatever the agent made of the refusal
            # (an HTTP agent sees a 400 and raises its own error). Other errors fail the episode
            # (areal_mega.rollout.failures): the server's, or the agent's own (e.g. its tool raised).
            if not client.budget_exceeded:
                if failure_reason(e) == "error":
                    raise EpisodeFailure("agent_exception", f"{type(e).__name__}: {e}") from e
                raise
            result, status = 0.0, "budget"
        finally:
            if self._server is not None:
                self._server.close_episode(client)
        # As the other workflows score: the detailed result (reasons for the metrics) and the
        # model's generated-token count of the episode (length shaping).
        scored_data = {**data, COMPLETION_TOKENS: sum(len(r.result.output_ids) for r in client.records)}
        if not isinstance(result, (int, float)):
            if result is None:
                last = client.records[-1].completion.choices[0].message if client.records else None
                result = (last.content or "") if last else ""
            answer = str(result)
            scored = await score(self.reward_fn, prompt, answer, scored_data)
            reward, reward_info = scored.score, scored.info
        else:
            answer, reward, reward_info = None, float(result), {}
        concat = self.options.trajectories == "concat"
        builders = client.trajectory_builders(concat=concat)
        # Steps of each trajectory: its calls' outputs ("turns") or their regex cuts.
        await asyncio.gather(*[self.score_steps(b, prompt, scored_data) for b in builders[0]])
        return client.trajectories(reward, gid, concat=concat, builders=builders,
                                   turn_discount=self.options.turn_discount,
                                   info={"answer": answer, "status": status, "episode_reward": reward,
                                         "reward_info": reward_info})

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory]:
        gid = new_group_id(data)
        episodes = await asyncio.gather(*[self._episode(engine, data, gid) for _ in range(self.cfg.group_size)])
        return [t for ep in episodes for t in ep]
