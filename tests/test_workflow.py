"""Workflows with a scripted in-process engine and a character tokenizer (< 2 s), plus one
pass through controller -> batch -> advantages -> decoupled PPO loss."""

import asyncio

import pytest
import torch

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationResult, SamplingParams
from areal_mega.reward.math import extract_answer
from areal_mega.reward.shaping import CompositeReward, FormatReward, OverlongPenalty
from areal_mega.algo.advantages import compute_advantages
from areal_mega.rollout.batch import trajectories_to_batch
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.rollout.config import RolloutConfig
from areal_mega.rollout.controller import RolloutController
from areal_mega.algo.losses import PPOActorLoss, global_counts
from areal_mega.workflows import WorkflowConfig, build_workflow, calculator
from areal_mega.workflows.multi_turn import MultiTurnWorkflow
from areal_mega.reward import COMPLETION_TOKENS
from areal_mega.agent_tools import FunctionTool, ToolRegistry, calculator_tool, schema_of
from areal_mega.workflows.tool import cut_after_tool_call

EOS = 3


class CharTok:
    """id = code point + 10 (0..9 reserved; 3 = EOS)."""

    eos_token_id = EOS

    def encode(self, text, add_special_tokens=False):
        return [ord(c) + 10 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 10) for i in ids if i >= 10)


class ScriptedEngine(InferenceEngine):
    """Replies with script(prompt_text, call_no) + EOS; logprob of token j = -(j+1)/100."""

    def __init__(self, script):
        self.script, self.tok, self.version, self.calls = script, CharTok(), 0, 0
        self.requests = []

    async def agenerate(self, req):
        text = self.tok.decode(req.input_ids)
        self.requests.append((text, req.sampling))
        out = self.tok.encode(self.script(text, self.calls)) + [EOS]
        self.calls += 1
        await asyncio.sleep(0)
        return GenerationResult(list(req.input_ids), out, [-(j + 1) / 100 for j in range(len(out))],
                                [self.version] * len(out), "stop")

    async def pause(self): ...
    async def resume(self): ...
    def get_version(self): return self.version
    def set_version(self, v): self.version = v


async def exact_reward(prompt, completion, data):
    return float(extract_answer(completion) == data["answer"])


SAMPLE = {"id": "s1", "prompt": "Q: 3+4?\nA:", "answer": "7"}


def test_single_turn_group():
    eng = ScriptedEngine(lambda text, n: "The answer is 7." if n % 2 == 0 else "It is 8")
    wf = build_workflow(WorkflowConfig(group_size=4, sampling=SamplingParams(max_new_tokens=32)), CharTok(), exact_reward)
    trajs = asyncio.run(wf.arun_episode(eng, SAMPLE))
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0]
    assert len({t.group_id for t in trajs}) == 1 and trajs[0].group_id.startswith("s1#")
    p = len(SAMPLE["prompt"])
    t = trajs[0]
    assert t.loss_mask == [0] * p + [1] * (len("The answer is 7.") + 1)
    assert t.input_ids[-1] == EOS and t.logprobs[p] == -0.01 and t.versions[:p] == [-1] * p
    assert eng.requests[0][1].stop_token_ids == [EOS]  # EOS added to the stop ids


def test_single_turn_shaping_sees_token_counts_and_reasons_reach_the_stats():
    """The workflow passes the generated-token count (reply + EOS) to the reward; a composite
    of format + DAPO overlong (L_max 8, L_cache 4) then scores by hand: "ab"+EOS = 3 tokens ->
    0 + 0 (no digit); "12345"+EOS = 6 -> 1 + (4 - 6) / 4 = 0.5; "1234567"+EOS = 8 -> 1 - 1 = 0.
    The failure reasons are counted in the controller's batch stats."""
    replies = ["ab", "12345", "1234567"]
    eng = ScriptedEngine(lambda text, n: replies[n % 3])
    fn = CompositeReward([(1.0, "format", FormatReward(r"\d")), (1.0, "overlong", OverlongPenalty(8, 4))])
    wf = build_workflow(WorkflowConfig(group_size=3, sampling=SamplingParams(max_new_tokens=32)), CharTok(), fn)
    trajs = asyncio.run(wf.arun_episode(eng, SAMPLE))
    assert [t.reward for t in trajs] == [0.0, 0.5, 0.0]
    assert [t.info["reward_info"]["overlong"]["num_tokens"] for t in trajs] == [3, 6, 8]

    async def run():
        ctrl = RolloutController(ScriptedEngine(lambda text, n: replies[n % 3]), wf, [SAMPLE],
                                 RolloutConfig(batch_size=1, max_staleness=0, show_progress=False))
        await ctrl.astart()
        try:
            return await ctrl.aget_batch()
        finally:
            await ctrl.aclose()

    stats = asyncio.run(run()).stats
    assert stats["reward/reason/format"] == 1.0 and stats["reward/reason/overlong"] == 2.0


def test_multi_turn_feedback_masked_and_discounted():
    eng = ScriptedEngine(lambda text, n: "The answer is 4." if "not correct" in text else "The answer is 5.")
    cfg = WorkflowConfig(kind="multi_turn", group_size=1, max_turns=3,
                         options=MultiTurnWorkflow.Options(turn_discount=0.5, feedback=" No, not correct. A:"))
    (t,) = asyncio.run(build_workflow(cfg, CharTok(), exact_reward).arun_episode(eng, {**SAMPLE, "answer": "4"}))
    a1, fb, a2 = "The answer is 5.", " No, not correct. A:", "The answer is 4."
    tok = CharTok()
    assert tok.decode(t.input_ids) == SAMPLE["prompt"] + a1 + fb + a2
    p = len(SAMPLE["prompt"])
    assert t.loss_mask == [0] * p + [1] * (len(a1) + 1) + [0] * len(fb) + [1] * (len(a2) + 1)
    assert t.reward == 0.5 and t.info["num_turns"] == 2
    # never right: max_turns attempts, reward 0
    eng = ScriptedEngine(lambda text, n: "The answer is 5.")
    (t,) = asyncio.run(build_workflow(cfg, CharTok(), exact_reward).arun_episode(eng, {**SAMPLE, "answer": "4"}))
    assert t.reward == 0.0 and t.info["num_turns"] == 3


def test_tool_call_cut_and_result_masked():
    def script(text, n):
        if "<result>" not in text:
            return "Compute <calc>12 * (3 + 4)</calc> junk after the call"
        return "So the answer is 84."

    eng = ScriptedEngine(script)
    cfg = WorkflowConfig(kind="tool", group_size=1, max_turns=3)
    (t,) = asyncio.run(build_workflow(cfg, CharTok(), exact_reward).arun_episode(eng, {**SAMPLE, "answer": "84"}))
    tok = CharTok()
    call, result, final = "Compute <calc>12 * (3 + 4)</calc>", "<result>84</result>", "So the answer is 84."
    assert tok.decode(t.input_ids) == SAMPLE["prompt"] + call + result + final
    p = len(SAMPLE["prompt"])
    assert t.loss_mask == [0] * p + [1] * len(call) + [0] * len(result) + [1] * (len(final) + 1)
    # kept tokens keep their own behaviour log-probs (the cut drops the tail, not the head)
    assert t.logprobs[p : p + len(call)] == [-(j + 1) / 100 for j in range(len(call))]
    assert t.reward == 1.0 and t.info["num_tool_calls"] == 1
    assert cut_after_tool_call(tok, tok.encode("no call here")) is None


def test_tool_workflow_dispatches_by_name_from_the_registry():
    """Two tools, JSON and plain-text arguments, an unknown tool name (not a call: only registered
    names are tags), a tool error shown to the model, the token count passed to the reward."""

    async def lookup(key: str, upper: bool = False) -> str:
        """Look a key up."""
        value = {"x": "forty"}.get(key, "missing")
        return value.upper() if upper else value

    reg = ToolRegistry([calculator_tool("calc"), FunctionTool("lookup", "Look a key up.", schema_of(lookup), lookup)])
    replies = iter(['<nope>1</nope> <lookup>{"key": "x", "upper": true}</lookup> tail', "<calc>40 + 2</calc>",
                    "<calc>1/0</calc>", "<lookup>{\"bad\": 1}</lookup>", "done 42"])
    eng = ScriptedEngine(lambda text, n: next(replies))
    seen = {}

    async def reward(prompt, completion, data):
        seen.update(data)
        return float("42" in completion)

    cfg = WorkflowConfig(kind="tool", group_size=1, max_turns=5)  # its tools: the registry passed
    wf = build_workflow(cfg, CharTok(), reward, reg)
    (t,) = asyncio.run(wf.arun_episode(eng, SAMPLE))
    tok = CharTok()
    expected = ('<nope>1</nope> <lookup>{"key": "x", "upper": true}</lookup><result>FORTY</result>'
                "<calc>40 + 2</calc><result>42</result><calc>1/0</calc><result>error: division by zero</result>"
                '<lookup>{"bad": 1}</lookup><result>error: lookup takes [\'key\', \'upper\'], got [\'bad\']</result>done 42')
    assert tok.decode(t.input_ids) == SAMPLE["prompt"] + expected
    assert t.info["tool_calls"] == ["lookup", "calc", "calc", "lookup"] and t.reward == 1.0
    assert seen[COMPLETION_TOKENS] == sum(t.loss_mask)
    assert reg.schemas()[1] == {"type": "function", "function": {"name": "lookup", "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "upper": {"type": "boolean"}},
                       "required": ["key"]}}}
    assert asyncio.run(reg.call("nope", {})).startswith("error: unknown tool 'nope'")


@pytest.mark.parametrize(
    "expr,out",
    [("12*(3+4)", "84"), ("7/2", "3.5"), ("2**10", "1024"), ("-3 + 10 // 3", "0"), ("1/0", "error: division by zero")],
)
def test_calculator(expr, out):
    assert calculator(expr) == out


@pytest.mark.parametrize("expr", ["2**100000", "__import__('os')", "x + 1", "[1, 2]"])
def test_calculator_rejects(expr):
    assert calculator(expr).startswith("error")


def test_controller_to_loss_end_to_end():
    eng = ScriptedEngine(lambda text, n: "The answer is 7." if n % 4 in (0, 3) else "Hmm 2")
    wf = build_workflow(WorkflowConfig(group_size=2, sampling=SamplingParams(max_new_tokens=32)), CharTok(), exact_reward)
    data = [{"id": f"s{i}", "prompt": f"Q{i}:", "answer": "7"} for i in range(4)]

    async def run():
        ctrl = RolloutController(eng, wf, data, RolloutConfig(batch_size=2, max_staleness=0, show_progress=False))
        await ctrl.astart()
        try:
            return await ctrl.aget_batch()
        finally:
            await ctrl.aclose()

    rb = asyncio.run(run())
    batch = trajectories_to_batch(rb.trajectories)
    assert batch["cu_seqlens"].tolist()[-1] == batch["input_ids"].numel()
    assert batch["group_index"].tolist() == [0, 0, 1, 1]
    cfg = AlgorithmConfig(adv_estimator="grpo", decoupled=True)
    batch.update(compute_advantages(batch, cfg))
    # each group has one right and one wrong answer -> advantages +-1 on generated tokens
    mask = batch["loss_mask"].bool()
    assert set(torch.round(batch["advantages"][mask]).tolist()) == {1.0, -1.0}
    n_tok, n_seq = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    batch["prox_logprobs"] = batch["logprobs"].clone()
    cur = batch["logprobs"].clone().requires_grad_(True)
    loss, stats = PPOActorLoss(cfg, total_tokens=n_tok, total_seqs=n_seq)(cur, None, batch)
    # at ratio 1 the PPO loss is -mean(A) over tokens; gradient -A / n_tok
    assert torch.isclose(loss, -(batch["advantages"][mask]).sum() / n_tok)
    loss.backward()
    assert torch.allclose(cur.grad, -batch["advantages"] * mask / n_tok)
    assert float(stats["clip_frac"]) == 0.0


def test_trajectories_to_batch_accepts_groups_and_broadcasts(tmp_path):
    from areal_mega.api.workflow import Trajectory

    g = [[Trajectory([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], [-1, 2, 3], 1.0, "a"),
          Trajectory([5, 8], [0, 1], [0.0, -1.0], [-1, 3], 0.0, "a")],
         [Trajectory([9, 9, 9, 9], [0, 0, 1, 1], [0.0, 0.0, -2.0, -3.0], [-1, -1, 3, 3], 0.5, "b")]]
    b = trajectories_to_batch(g)
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert b["versions"].tolist() == [-1, 2, 3, -1, 3, -1, -1, 3, 3]
    assert b["rewards"].tolist() == [1.0, 0.0, 0.5] and b["group_index"].tolist() == [0, 0, 1]
    # broadcast_batch's call path on a 1-rank gloo group (the multi-rank path is exercised by
    # the trainer's torchrun tests; a 2-process launch here would cost ~10 s of imports)
    import torch.distributed as dist

    from areal_mega.rollout.batch import broadcast_batch

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = broadcast_batch({"batch": b, "stats": {"s": 1.5}}, src=0, group=dist.group.WORLD)
        assert torch.equal(got["batch"]["input_ids"], b["input_ids"]) and got["stats"] == {"s": 1.5}
    finally:
        dist.destroy_process_group()


def test_engine_alignment_shifts_per_token_fields_within_each_sequence() -> None:
    """[prompt p0 p1 | gen g0 g1] -> the prediction at i is of token i+1: loss_mask/logprobs/
    versions move one to the left, the last position of every sequence predicts nothing."""
    from areal_mega.api.workflow import Trajectory
    from areal_mega.rollout.batch import to_engine_alignment, trajectories_to_batch

    a = Trajectory([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25], [-1, -1, 3, 4], reward=1.0, group_id="g")
    b = Trajectory([9, 10, 11], [0, 1, 1], [0.0, -1.0, -2.0], [-1, 2, 2], reward=0.0, group_id="g")
    batch = to_engine_alignment(trajectories_to_batch([[a, b]]))
    assert batch["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert batch["loss_mask"].tolist() == [0, 1, 1, 0, 1, 1, 0]
    assert batch["logprobs"].tolist() == [0.0, -0.5, -0.25, 0.0, -1.0, -2.0, 0.0]
    assert batch["versions"].tolist() == [-1, 3, 4, -1, 2, 2, -1]
    assert batch["rewards"].tolist() == [1.0, 0.0] and batch["cu_seqlens"].tolist() == [0, 4, 7]
