"""The OpenAI-style agent client and AgentWorkflow with the REAL BPE tokenizer (trained offline,
chat template applied learner-side) and a scripted in-process engine: tool calls parsed, the
trajectory = exactly the ids sent + the ids generated, loss mask 1 only on generated tokens,
concatenation by the prefix rule (and a new trajectory when the agent rewrites history),
per-turn discount, budgets. Real-server episodes: tests/test_agents_sglang.py."""

import asyncio
import json
from pathlib import Path

import pytest

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationResult, SamplingParams
from areal_mega.workflows import WorkflowConfig, build_workflow
from areal_mega.workflows.agent import AgentBudgetExceeded, AgentClient, AgentWorkflow, parse_tool_calls
from areal_mega.workflows.examples.calculator_agent import calculator_agent
from tests.support.models import bpe_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


class ScriptedEngine(InferenceEngine):
    """Replies with tokens of script(call_no, prompt_text) + EOS; log-prob of token j = -(j+1)/100."""

    def __init__(self, tok, script):
        self.tok, self.script, self.version = tok, script, 0
        self.sent, self.results = [], []

    async def agenerate(self, req):
        n = len(self.sent)
        self.sent.append(list(req.input_ids))
        out = self.tok.encode(self.script(n, self.tok.decode(req.input_ids)), add_special_tokens=False)
        out = out[: req.sampling.max_new_tokens - 1] + [self.tok.eos_token_id]
        await asyncio.sleep(0)
        res = GenerationResult(list(req.input_ids), out, [-(j + 1) / 100 for j in range(len(out))],
                               [self.version] * len(out), "stop")
        self.results.append(res)
        return res

    async def pause(self): ...
    async def resume(self): ...
    def get_version(self): return self.version
    def set_version(self, v): self.version = v


def test_parse_tool_calls():
    content, calls, bad = parse_tool_calls('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                           '{"expression": "2*3"}}</tool_call><tool_call>{"name": "calculator", '
                                           '"arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>')
    assert content == "Let me compute." and bad == 0
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "2*3"}), ("calculator", {"expression": "1"})]
    content, calls, bad = parse_tool_calls('<tool_call>{"name": calculator}</tool_call> hm')
    assert calls == [] and bad == 1 and content == '<tool_call>{"name": calculator}</tool_call> hm'


def _script(n, text):
    return ['First <tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>',
            "I think it is big.", "Answer: 84."][n]


def _spans(mask):
    return [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]


def test_calculator_agent_episode_is_one_exact_trajectory(tok):
    eng = ScriptedEngine(tok, _script)

    async def exact(prompt, completion, data):
        return float(completion == data["answer"])

    cfg = WorkflowConfig(kind="agent", options=AgentWorkflow.Options("areal_mega.workflows.examples.calculator_agent:calculator_agent"),
                         group_size=1, max_turns=4, sampling=SamplingParams(max_new_tokens=64))
    wf = build_workflow(cfg, tok, exact)
    (t,) = asyncio.run(wf.arun_episode(eng, {"id": "c", "question": "What is 12 * (3 + 4)?", "answer": "84"}))
    assert t.reward == 1.0 and t.info["answer"] == "84" and t.info["num_calls"] == 3
    # the trajectory is exactly: ids sent on call 1, generated 1, new env ids, generated 2, ...
    sent, res = eng.sent, eng.results
    assert sent[1][: len(sent[0]) + len(res[0].output_ids)] == sent[0] + res[0].output_ids
    assert sent[2][: len(sent[1]) + len(res[1].output_ids)] == sent[1] + res[1].output_ids
    assert t.input_ids == sent[2] + res[2].output_ids
    gen = [i for i, m in enumerate(t.loss_mask) if m]
    assert [t.input_ids[i] for i in gen] == res[0].output_ids + res[1].output_ids + res[2].output_ids
    assert _spans(t.loss_mask) == [0, 1, 0, 1, 0, 1]
    assert [t.logprobs[i] for i in gen] == res[0].output_logprobs + res[1].output_logprobs + res[2].output_logprobs
    assert all(t.versions[i] == -1 and t.logprobs[i] == 0.0 for i in range(len(t.input_ids)) if not t.loss_mask[i])
    # the tool result and the nudge are environment tokens (mask 0), rendered by the chat template
    env_text = tok.decode([x for x, m in zip(t.input_ids, t.loss_mask) if not m], skip_special_tokens=False)
    assert "<tool_response>\n84\n</tool_response>" in env_text and "Use the calculator tool" in env_text
    # ... and the whole sequence is the chat template's rendering of the conversation
    assert "<tools>" in tok.decode(sent[0], skip_special_tokens=False)


def test_client_response_shape_and_arguments(tok):
    eng = ScriptedEngine(tok, _script)
    client = AgentClient(eng, tok, SamplingParams(max_new_tokens=64, temperature=1.0), max_calls=2)

    async def run():
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 tools=[{"type": "function", "function": {"name": "calculator"}}],
                                                 temperature=0.5, max_tokens=40)
        with pytest.raises(TypeError, match="unsupported arguments"):
            await client.chat.completions.create(messages=[], frequency_penalty=1.0)
        with pytest.raises(ValueError, match="n: only n=1"):
            await client.chat.completions.create(messages=[], n=2)
        await client.chat.completions.create(messages=[{"role": "user", "content": "again"}])
        with pytest.raises(AgentBudgetExceeded):
            await client.chat.completions.create(messages=[{"role": "user", "content": "third"}])
        return r

    r = asyncio.run(run())
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "First" and r.model == "m"
    assert c.message.tool_calls[0].function.name == "calculator" and c.message.tool_calls[0].type == "function"
    assert r.usage.prompt_tokens == len(eng.sent[0]) and r.usage.completion_tokens == len(eng.results[0].output_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert c.message.to_dict()["tool_calls"][0]["function"]["name"] == "calculator"


def test_rewritten_history_starts_a_new_trajectory_and_discount(tok):
    """The agent drops the model's first reply from the history: call 2 does not extend call 1's
    context, so it is a second trajectory; with options.turn_discount 0.5 the first gets R * 0.5."""

    async def agent(client, sample):
        m = [{"role": "user", "content": "one"}]
        await client.chat.completions.create(messages=m)
        await client.chat.completions.create(messages=m + [{"role": "user", "content": "two"}])
        return 1.0

    eng = ScriptedEngine(tok, lambda n, text: "reply")
    cfg = WorkflowConfig(kind="agent", options=AgentWorkflow.Options("x:y", turn_discount=0.5), group_size=2)

    wf = AgentWorkflow(cfg, tok, None, agent=agent)
    trajs = asyncio.run(wf.arun_episode(eng, {"id": "h"}))
    assert len(trajs) == 4 and len({t.group_id for t in trajs}) == 1
    assert [t.reward for t in trajs] == [0.5, 1.0, 0.5, 1.0]
    assert all(_spans(t.loss_mask) == [0, 1] for t in trajs)
    # per_call: every call its own trajectory even when it extends the previous context
    eng = ScriptedEngine(tok, _script)
    cfg = WorkflowConfig(kind="agent", options=AgentWorkflow.Options(
        "areal_mega.workflows.examples.calculator_agent:calculator_agent", trajectories="per_call", turn_discount=0.9),
                         group_size=1)

    async def score(prompt, completion, data):
        return 1.0

    trajs = asyncio.run(build_workflow(cfg, tok, score).arun_episode(eng, {"id": "p", "question": "q"}))
    assert [round(t.reward, 4) for t in trajs] == [0.81, 0.9, 1.0]
    assert [t.input_ids for t in trajs] == [s + r.output_ids for s, r in zip(eng.sent, eng.results)]


def test_agent_workflow_config_errors(tok):
    with pytest.raises(ValueError, match="options.function: kind 'agent' needs 'module:function'"):
        build_workflow(WorkflowConfig(kind="agent"), tok, None)
    with pytest.raises(ValueError, match="must be an async function"):
        build_workflow(WorkflowConfig(kind="agent", options=AgentWorkflow.Options("areal_mega.workflows.tool:calculator")), tok, None)
    assert calculator_agent  # importable by path (the config above names it)


def test_http_endpoint_records_like_the_in_process_client(tok):
    """workflow.options.http: an agent speaking OpenAI JSON over HTTP to client.base_url (aiohttp here,
    in this process) gets the chat.completion JSON, and its calls become the same exact trajectory;
    a bad request is a 400 with an OpenAI-style error, an unknown episode a 404, the exhausted
    budget a 400 that ends the episode with reward 0."""
    import aiohttp

    seen = {}

    async def http_agent(client, sample):
        url = client.base_url + "/chat/completions"
        messages = [{"role": "user", "content": sample["question"]}]
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"model": "m", "messages": messages, "max_tokens": 64}) as r:
                first = await r.json()
            async with s.post(url, json={"messages": messages, "logit_bias": {}}) as r:
                seen["bad"] = (r.status, (await r.json())["error"]["type"])
            async with s.post(url.replace(client.endpoint_key, "nope"), json={"messages": messages}) as r:
                seen["unknown"] = r.status
            messages += [first["choices"][0]["message"], {"role": "tool", "tool_call_id": "x", "content": "84"}]
            async with s.post(url, json={"messages": messages}) as r:
                seen["second"] = await r.json()
            async with s.post(url, json={"messages": messages}) as r:  # max_turns=2: over budget
                seen["budget"] = (r.status, (await r.json())["error"]["type"])
                r.raise_for_status()
        return 1.0

    eng = ScriptedEngine(tok, _script)
    cfg = WorkflowConfig(kind="agent", options=AgentWorkflow.Options("x:y", http=True), group_size=1, max_turns=2)

    wf = AgentWorkflow(cfg, tok, None, agent=http_agent)

    async def run():
        try:
            return await wf.arun_episode(eng, {"id": "http", "question": "What is 12 * (3 + 4)?"})
        finally:
            await wf.aclose()

    (t,) = asyncio.run(run())
    assert seen["bad"] == (400, "invalid_request_error") and seen["unknown"] == 404
    assert seen["budget"] == (400, "budget_exceeded") and t.reward == 0.0 and t.info["status"] == "budget"
    second = seen["second"]
    assert second["object"] == "chat.completion" and second["choices"][0]["message"]["content"] == "I think it is big."
    assert second["usage"]["prompt_tokens"] == len(eng.sent[1])
    assert t.input_ids == eng.sent[1] + eng.results[1].output_ids  # the JSON round trip kept the prefix
    assert _spans(t.loss_mask) == [0, 1, 0, 1]


def test_openai_tool_calls_run_through_the_registry():
    """The example agent's tools are the registry's (the tool workflow's): OpenAI-format schemas,
    JSON-text arguments, errors as text the model sees."""
    import asyncio

    from areal_mega.workflows.examples.calculator_agent import TOOLS

    assert TOOLS.schemas() == [{"type": "function", "function": {
        "name": "calculator", "description": TOOLS.get("calculator").description,
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

    async def calls():
        return [await TOOLS.call_openai("calculator", '{"expression": "12 * (3 + 4)"}'),
                await TOOLS.call_openai("calculator", "12*"),
                await TOOLS.call_openai("calculator", "[1]"),
                await TOOLS.call_openai("search", "{}")]

    ok, not_json, not_object, unknown = asyncio.run(calls())
    assert ok == "84"
    assert not_json.startswith("error: calculator arguments are not JSON")
    assert not_object == "error: calculator arguments must be a JSON object, got list"
    assert unknown.startswith("error: unknown tool 'search'")


def test_model_context_caps_the_budget_and_failures_carry_reasons(tmp_path):
    """The agent's context budget is min(workflow.max_context_tokens, the model's
    max_position_embeddings from the config.json beside the tokenizer); a server's 400 "longer than
    the context" ends the episode by the same budget rule; the agent's own exception and the
    reward's fail the episode with their reasons (areal_mega.rollout.failures)."""
    from areal_mega.inference.client import InferenceServerError
    from areal_mega.rollout.failures import EpisodeFailure, failure_reason
    from areal_mega.workflows import WorkflowConfig

    tok = bpe_tokenizer(tmp_path / "tok")
    (Path(tok.name_or_path) / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 48}))

    async def grow(client, sample):
        messages = [{"role": "user", "content": "What is 2+3?"}]
        for _ in range(20):
            r = await client.chat.completions.create(messages=messages, max_tokens=4)
            if sample.get("raise"):
                raise ZeroDivisionError("the agent's own tool")
            if sample.get("bad_reward"):
                return "5"  # scored by the reward, which raises
            messages += [r.choices[0].message, {"role": "user", "content": "More, please."}]
        return "5"

    async def reward(prompt, completion, data):
        if data.get("bad_reward"):
            raise KeyError("gold")
        return 1.0

    cfg = WorkflowConfig(kind="agent", options=AgentWorkflow.Options("x:y"), group_size=1, max_turns=20, sampling=SamplingParams(max_new_tokens=4))
    wf = AgentWorkflow(cfg, tok, reward, agent=grow)
    assert wf.max_context_tokens == 48  # not workflow.max_context_tokens (4096)
    eng = ScriptedEngine(tok, lambda n, text: "ok")
    (t,) = asyncio.run(wf.arun_episode(eng, {"id": "a"}))
    assert t.info["status"] == "budget" and t.reward == 0.0 and len(t.input_ids) <= 48 and len(eng.sent) >= 2
    assert all(len(ids) + 4 <= 48 for ids in eng.sent)

    class Refusing(ScriptedEngine):
        async def agenerate(self, req):  # the second call is refused as too long
            if self.sent:
                raise InferenceServerError("http://s", "/generate", 400,
                                           '{"error": "Input length (250 tokens) exceeds the maximum allowed length"}')
            return await super().agenerate(req)

    wf_big = AgentWorkflow(WorkflowConfig(kind="agent", options=AgentWorkflow.Options("x:y"), group_size=1, max_turns=20,
                                          sampling=SamplingParams(max_new_tokens=4)), tok, reward, agent=grow)
    (t,) = asyncio.run(wf_big.arun_episode(Refusing(tok, lambda n, text: "ok"), {"id": "b"}))
    assert t.info["status"] == "budget" and t.reward == 0.0
    for data, reason in (({"id": "c", "raise": True}, "agent_exception"), ({"id": "d", "bad_reward": True}, "reward_exception")):
        with pytest.raises(EpisodeFailure) as e:
            asyncio.run(wf.arun_episode(ScriptedEngine(tok, lambda n, text: "ok"), data))
        assert failure_reason(e.value) == reason


def test_agent_episode_saved_after_two_calls_resumes_at_the_third(tok):
    """The replay contract with the calculator agent (rollout/journal.py): an episode checkpointed
    after two of its three calls (the third in flight with no tokens yet) runs again through a
    journal of the saved calls: the agent gets the two recorded replies without the engine being
    asked, the engine answers only the third call, and the trajectory equals the uninterrupted
    one token for token (ids, log-probs, versions). Negative control: a saved reply altered
    changes the agent's next call, which the log then does not have (``diverged``)."""
    from areal_mega.rollout.journal import EpisodeJournal

    async def exact(prompt, completion, data):
        return float(completion == data["answer"])

    cfg = WorkflowConfig(kind="agent", options=AgentWorkflow.Options("areal_mega.workflows.examples.calculator_agent:calculator_agent"),
                         group_size=1, max_turns=4, sampling=SamplingParams(max_new_tokens=64))
    wf = build_workflow(cfg, tok, exact)
    sample = {"id": "c", "question": "What is 12 * (3 + 4)?", "answer": "84"}
    whole = EpisodeJournal(ScriptedEngine(tok, _script))
    (ref,) = asyncio.run(wf.arun_episode(whole, sample))
    saved = whole.snapshot()
    assert len(saved) == 3 and all(c["finish"] == "stop" for c in saved)
    at_kill = [*saved[:2], {**saved[2], "ids": [], "lps": [], "vers": [], "finish": None}]

    eng = ScriptedEngine(tok, lambda n, text: _script(n + 2, text))  # a fresh engine: it is asked call 3 only
    resumed = EpisodeJournal(eng, at_kill)
    (t,) = asyncio.run(wf.arun_episode(resumed, sample))
    assert len(eng.sent) == 1 and resumed.replayed_tokens == len(saved[0]["ids"]) + len(saved[1]["ids"])
    assert (t.input_ids, t.logprobs, t.versions, t.loss_mask, t.reward) == \
        (ref.input_ids, ref.logprobs, ref.versions, ref.loss_mask, ref.reward)
    assert not resumed.diverged

    bad = [{**saved[0], "ids": saved[0]["ids"][:-3] + saved[0]["ids"][-1:]}, saved[1]]  # reply 1 altered
    eng = ScriptedEngine(tok, lambda n, text: _script(n + 1, text))
    resumed = EpisodeJournal(eng, bad)
    asyncio.run(wf.arun_episode(resumed, sample))
    assert resumed.diverged and resumed.unused_tokens == len(saved[1]["ids"])
