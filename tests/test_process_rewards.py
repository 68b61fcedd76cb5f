"""Process rewards: step boundaries, step-reward batches, process-supervised advantages (GRPO,
Dr.GRPO, REINFORCE++, GAE, outcome/process mixes) against hand-computed and independently
computed values; outcome-only configs bit-identical to the estimators before steps existed
(hashes of their outputs, computed by the previous code at bbc660e); step splitting by
regex and by turns; the consistency checker. Fast (no processes)."""

from __future__ import annotations

import asyncio
import hashlib
import math

import pytest
import torch

from areal_mega.algo.advantages import compute_advantages
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.api.workflow import Trajectory
from areal_mega.batching.packing import shift_to_next_token
from areal_mega.rollout.batch import to_engine_alignment, trajectories_to_batch

# --------------------------------------------------------------------------- batches


def traj(num_prompt, step_ends, step_rewards, reward, gid, *, num_gen=None, env_at=None):
    """A trajectory with ``num_prompt`` prompt tokens, then generated tokens (an env span of 2
    tokens after generated index ``env_at``, if given)."""
    n = num_gen if num_gen is not None else (step_ends[-1] if step_ends else 3)
    mask = [0] * num_prompt
    for k in range(n):
        mask.append(1)
        if env_at is not None and k + 1 == env_at:
            mask += [0, 0]
    ids = list(range(3, 3 + len(mask)))
    return Trajectory(ids, mask, [-0.5 * m for m in mask], [0 if m else -1 for m in mask], reward, gid,
                      step_ends=list(step_ends), step_rewards=list(step_rewards))


def random_batch(with_steps: bool, seed: int = 0):
    """A deterministic packed batch of 4 groups (sizes 3, 1, 4, 2), engine-aligned, with
    values and kl for gae / kl_in_reward; ``with_steps`` adds step rewards (2 steps each)."""
    g = torch.Generator().manual_seed(seed)
    g_steps = torch.Generator().manual_seed(seed + 1)  # own stream: the rest of the batch is the same either way
    trajs = []
    for gi, size in enumerate([3, 1, 4, 2]):
        for _ in range(size):
            n_prompt = int(torch.randint(1, 5, (), generator=g))
            n_gen = int(torch.randint(2, 9, (), generator=g))
            r = float(torch.randint(0, 3, (), generator=g)) * 0.5
            ends = [n_gen // 2, n_gen] if with_steps else []
            srs = torch.rand(2, generator=g_steps).tolist() if with_steps else []
            trajs.append(traj(n_prompt, ends, srs, r, f"g{gi}", num_gen=n_gen))
    batch = to_engine_alignment(trajectories_to_batch(trajs))
    t = batch["loss_mask"].numel()
    batch["values"] = torch.randn(t, generator=g)
    batch["kl"] = torch.rand(t, generator=g) * 0.1
    return batch


OUTCOME_CONFIGS = {
    "grpo": dict(adv_estimator="grpo"),
    "grpo_scaled": dict(adv_estimator="grpo", reward_scale=2.0, reward_bias=-0.5, adv_eps=0.0),
    "dr_grpo": dict(adv_estimator="dr_grpo"),
    "rloo": dict(adv_estimator="rloo"),
    "reinforce_pp": dict(adv_estimator="reinforce_pp", gamma=0.9),
    "reinforce_pp_kl": dict(adv_estimator="reinforce_pp", kl_in_reward=True, kl_coef=0.1),
    "gae": dict(adv_estimator="gae", gamma=0.95, lam=0.9),
}


def digest(res: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(res):
        h.update(k.encode())
        h.update(res[k].float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# Computed by the estimators as they were before process rewards (bbc660e's
# areal_mega/algo/advantages.py, loaded from `git show`) on random_batch(with_steps=False).
GOLDEN = {
    "grpo": "690c7ffb0ca17fb8",
    "grpo_scaled": "03134a3b6891d6de",
    "dr_grpo": "c7b70cd9491ccc14",
    "rloo": "4a4d99f2cb206d9b",
    "reinforce_pp": "f7a42a046405e516",
    "reinforce_pp_kl": "4350071ed6329c0b",
    "gae": "8ca961f579e052b4",
}


@pytest.mark.parametrize("name", sorted(OUTCOME_CONFIGS))
def test_outcome_only_is_bit_identical_to_before(name):
    cfg = AlgorithmConfig(**OUTCOME_CONFIGS[name])
    assert digest(compute_advantages(random_batch(with_steps=False), cfg)) == GOLDEN[name]
    # step rewards present but process_weight 0: ignored, the same bits
    with_steps = random_batch(with_steps=True)
    assert "step_rewards" in with_steps
    assert digest(compute_advantages(with_steps, cfg)) == GOLDEN[name]
    # negative control: the process term changes them
    if name not in ("rloo",):
        mixed = AlgorithmConfig(**OUTCOME_CONFIGS[name], process_weight=0.5)
        assert digest(compute_advantages(with_steps, mixed)) != GOLDEN[name]


def test_outcome_only_batch_has_no_step_keys():
    b = trajectories_to_batch([traj(2, [], [], 1.0, "a"), traj(1, [], [], 0.0, "a")])
    assert sorted(b) == ["cu_seqlens", "group_index", "input_ids", "logprobs", "loss_mask", "rewards", "versions"]


# --------------------------------------------------------------------------- hand-computed

# Groups: A = two trajectories with 2 and 3 steps; B = 1 step, step-less, 2 steps; C = one
# trajectory of 2 steps; D = two equal 1-step trajectories. The first has an env span inside.
HAND = [
    traj(2, [2, 5], [1.0, 0.0], 1.0, "A", env_at=2),
    traj(1, [1, 2, 3], [1.0, 1.0, 0.0], 0.0, "A"),
    traj(3, [4], [0.5], 1.0, "B"),
    traj(2, [], [], 0.0, "B", num_gen=3),
    traj(1, [1, 3], [0.0, 1.0], 1.0, "B"),
    traj(2, [2, 4], [1.0, 0.0], 1.0, "C"),
    traj(1, [3], [0.7], 0.0, "D"),
    traj(1, [3], [0.7], 1.0, "D"),
]


def per_gen_token(values_per_traj):
    """Per-trajectory lists over generated tokens -> this-token-aligned [T] -> engine-aligned."""
    out, cu = [], [0]
    for t, vals in zip(HAND, values_per_traj):
        it = iter(vals)
        out += [next(it) if m else 0.0 for m in t.loss_mask]
        cu.append(len(out))
    return shift_to_next_token(torch.tensor(out, dtype=torch.float32), torch.tensor(cu))


def test_process_grpo_hand_computed():
    s6, s24 = math.sqrt(1 / 6), math.sqrt(0.24)
    a1, a0 = 0.4 / s24, -0.6 / s24        # group A's steps [1, 0, 1, 1, 0]: mean .6, std sqrt(.24)
    b0, b5, b1 = -0.5 / s6, 0.0, 0.5 / s6  # group B's steps [.5, 0, 1]: mean .5, std sqrt(1/6)
    expected = [
        [a1 + a0] * 2 + [a0] * 3,             # steps [0,2) [2,5): step 0 = own + later, step 1 = own
        [a1 + a1 + a0, a1 + a0, a0],
        [b5] * 4,
        [0.0] * 3,                            # step-less: no process advantage
        [b0 + b1, b1, b1],
        [1 - 1, 1 - 1, -1.0, -1.0],           # C's steps [1, 0]: +-1 (normalised over steps)
        [0.0] * 3, [0.0] * 3,                 # D: equal step rewards -> exactly 0
    ]
    batch = to_engine_alignment(trajectories_to_batch(HAND))
    cfg = AlgorithmConfig(adv_estimator="grpo", process_weight=1.0, outcome_weight=0.0, adv_eps=0.0)
    adv = compute_advantages(batch, cfg)["advantages"]
    assert torch.allclose(adv, per_gen_token(expected), atol=1e-6), adv
    assert (adv[per_gen_token([[1.0] * len(e) for e in expected]) == 0] == 0).all()  # 0 off the mask
    # D is exactly 0 (not round-off), and the step-less trajectory too
    exact = per_gen_token([[1.0 if i in (3, 6, 7) else 0.0] * len(e) for i, e in enumerate(expected)]).bool()
    assert adv[exact].abs().max() == 0


def test_process_dr_grpo_and_mix_hand_computed():
    batch = to_engine_alignment(trajectories_to_batch(HAND))
    # dr_grpo: centred only. A: [1,0,1,1,0] - .6; B: [.5,0,1] - .5; C: [1,0] - .5
    a1, a0, b0, b5, b1 = 0.4, -0.6, -0.5, 0.0, 0.5
    proc = [[a1 + a0] * 2 + [a0] * 3, [a1 + a1 + a0, a1 + a0, a0], [b5] * 4, [0.0] * 3, [b0 + b1, b1, b1],
            [0.0, 0.0, -0.5, -0.5], [0.0] * 3, [0.0] * 3]
    cfg = AlgorithmConfig(adv_estimator="dr_grpo", process_weight=1.0, outcome_weight=0.0)
    assert torch.allclose(compute_advantages(batch, cfg)["advantages"], per_gen_token(proc), atol=1e-6)
    # mix: 0.5 * outcome Dr.GRPO (A: [1,0] - .5; B: [1,0,1] - 2/3; C: 0 (one sample); D: [0,1] - .5) + 2 * process
    out = [0.5, -0.5, 1 / 3, -2 / 3, 1 / 3, 0.0, -0.5, 0.5]
    mix = [[0.5 * o + 2 * p for p in ps] for o, ps in zip(out, proc)]
    cfg = AlgorithmConfig(adv_estimator="dr_grpo", process_weight=2.0, outcome_weight=0.5)
    assert torch.allclose(compute_advantages(batch, cfg)["advantages"], per_gen_token(mix), atol=1e-6)


def _token_rewards(ow, pw, scale=1.0):
    """Per generated token: ow * outcome on the last token + pw * step reward on each step's end."""
    rows = []
    for t in HAND:
        n = t.num_generated
        r = [0.0] * n
        r[-1] += ow * t.reward * scale
        for e, s in zip(t.step_ends, t.step_rewards):
            r[e - 1] += pw * s * scale
        rows.append(r)
    return rows


def test_process_reinforce_pp_hand_computed():
    gamma = 0.9
    rows = _token_rewards(0.5, 2.0)
    returns = []
    for r in rows:
        g, out = 0.0, []
        for x in reversed(r):
            g = x + gamma * g
            out.append(g)
        returns.append(out[::-1])
    flat = [x for r in returns for x in r]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    adv = [[(x - mean) / (std + 1e-6) for x in r] for r in returns]
    batch = to_engine_alignment(trajectories_to_batch(HAND))
    cfg = AlgorithmConfig(adv_estimator="reinforce_pp", gamma=gamma, process_weight=2.0, outcome_weight=0.5)
    res = compute_advantages(batch, cfg)
    assert torch.allclose(res["returns"], per_gen_token(returns), atol=1e-6)
    assert torch.allclose(res["advantages"], per_gen_token(adv), atol=1e-5)


def test_process_gae_hand_computed():
    gamma, lam = 0.95, 0.8
    rows = _token_rewards(1.0, 1.0)
    values = [[0.1 * (i + 1) * (k % 3) for k in range(t.num_generated)] for i, t in enumerate(HAND)]
    advs = []
    for r, v in zip(rows, values):
        a, out = 0.0, []
        for k in reversed(range(len(r))):
            nv = v[k + 1] if k + 1 < len(r) else 0.0
            a = r[k] + gamma * nv - v[k] + gamma * lam * a
            out.append(a)
        advs.append(out[::-1])
    batch = to_engine_alignment(trajectories_to_batch(HAND))
    batch["values"] = per_gen_token(values)
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=gamma, lam=lam, process_weight=1.0)
    res = compute_advantages(batch, cfg)
    assert torch.allclose(res["advantages"], per_gen_token(advs), atol=1e-6)
    assert torch.allclose(res["returns"], per_gen_token([[a + x for a, x in zip(ar, vr)] for ar, vr in zip(advs, values)]),
                          atol=1e-6)


def test_step_rewards_are_shaped_on_their_own_positions():
    batch = to_engine_alignment(trajectories_to_batch(HAND))
    plain = compute_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_pp", process_weight=1.0, outcome_weight=0.0))
    # a bias shifts every step reward (not the non-step tokens): returns change by bias * (steps at or after)
    biased = compute_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_pp", process_weight=1.0,
                                                       outcome_weight=0.0, reward_bias=1.0))
    counts = [[sum(1 for e in t.step_ends if e > k) for k in range(t.num_generated)] for t in HAND]
    assert torch.allclose(biased["returns"] - plain["returns"], per_gen_token(counts), atol=1e-6)


def test_process_config_refusals():
    with pytest.raises(ValueError, match="process_weight"):
        AlgorithmConfig(adv_estimator="rloo", process_weight=1.0).validate()
    with pytest.raises(ValueError, match="outcome_weight"):
        AlgorithmConfig(process_weight=0.0, outcome_weight=0.0).validate()
    with pytest.raises(ValueError, match="process_weight / outcome_weight"):
        AlgorithmConfig(process_weight=-1.0).validate()
    no_steps = to_engine_alignment(trajectories_to_batch([traj(2, [], [], 1.0, "a"), traj(1, [], [], 0.0, "a")]))
    with pytest.raises(ValueError, match="step_rewards"):
        compute_advantages(no_steps, AlgorithmConfig(process_weight=1.0))


def test_trajectory_step_fields_are_checked():
    with pytest.raises(ValueError, match="step_ends"):
        traj(1, [2, 2], [1.0, 1.0], 0.0, "a", num_gen=2)
    with pytest.raises(ValueError, match="step_ends"):
        traj(1, [2], [1.0], 0.0, "a", num_gen=3)             # last end != generated count
    with pytest.raises(ValueError, match="step_rewards"):
        traj(1, [1, 3], [1.0], 0.0, "a")
    with pytest.raises(ValueError, match="step_ends"):
        Trajectory([1, 2], [0, 1], [0.0, 0.0], [-1, 0], 0.0, step_rewards=[1.0])


def test_batch_places_step_rewards_on_step_ends():
    b = trajectories_to_batch([HAND[0]])  # prompt 2, gen 0-1, env 2 tokens, gen 2-4; steps end at gen 2, 5
    assert b["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert b["step_mask"].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert b["step_rewards"].tolist() == [0, 0, 0, 1.0, 0, 0, 0, 0, 0.0]


# --------------------------------------------------------------------------- steps in the workflows
from areal_mega.api.io import SamplingParams  # noqa: E402
from areal_mega.reward import CompositeOptions, FunctionOptions, RewardConfig, build_reward  # noqa: E402
from areal_mega.reward.consistency import check_trace, equations  # noqa: E402
from areal_mega.workflows import WorkflowConfig, build_workflow  # noqa: E402
from areal_mega.workflows.steps import StepConfig, split_steps  # noqa: E402
from tests.test_workflow import EOS, CharTok, ScriptedEngine  # noqa: E402


class PairTok(CharTok):
    """Two characters per token (a token may straddle a delimiter)."""

    def encode(self, text, add_special_tokens=False):
        return [(ord(text[i]) << 8) + (ord(text[i + 1]) if i + 1 < len(text) else 1) for i in range(0, len(text), 2)]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i >> 8) + (chr(i & 255) if i & 255 > 1 else "") for i in ids)


def test_split_steps_regex_and_turns():
    tok = CharTok()
    t1, t2 = tok.encode("2+3=5\n5*4=20\n"), tok.encode("so 20")
    ends, texts = split_steps(tok, [t1, t2], StepConfig(split="regex", delimiter=r"\n+"))
    assert texts == ["2+3=5\n", "5*4=20\n", "so 20"] and ends == [6, 13, 18]  # a turn end is a step end
    assert split_steps(tok, [t1, t2], StepConfig(split="turns")) == ([13, 18], ["2+3=5\n5*4=20\n", "so 20"])
    assert split_steps(tok, [t1, t2], StepConfig()) == ([], [])
    # at most max_steps: the rest is one last step
    assert split_steps(tok, [t1, t2], StepConfig(split="regex", max_steps=2))[0] == [6, 18]
    # a token straddling the delimiter ("5\n" as one token) stays in the step it starts
    pt = PairTok()
    ids = pt.encode("ab5\ncd")                      # tokens "ab", "5\n", "cd"
    assert split_steps(pt, [ids], StepConfig(split="regex", delimiter="\n")) == ([2, 3], ["ab5\n", "cd"])
    with pytest.raises(ValueError, match="steps.delimiter"):
        WorkflowConfig(steps=StepConfig(split="regex", delimiter="(")).validate()


TRACE_OK, TRACE_BAD = "2+3=5\n5*4=20\nThe answer is 20.", "2+3=6\n6*4=24\nThe answer is 24."


def test_single_turn_steps_scored_by_consistency():
    eng = ScriptedEngine(lambda text, n: TRACE_OK if n % 2 == 0 else TRACE_BAD)
    reward = build_reward(RewardConfig(kind="composite", options=CompositeOptions([
        RewardConfig(kind="function", options=FunctionOptions(function="tests.test_process_rewards:answer_20", isolate=False)),
        RewardConfig(kind="consistency", step_scoring="step", weight=0.5)])))
    wf = build_workflow(WorkflowConfig(group_size=2, sampling=SamplingParams(max_new_tokens=64),
                                       steps=StepConfig(split="regex")), CharTok(), reward)
    good, bad = asyncio.run(wf.arun_episode(eng, {"id": "s", "prompt": "Q:", "answer": "20"}))
    # outcome: answer_20 + 0.5 * consistency of the whole trace
    assert good.reward == 1.5 and bad.reward == 0.0
    # steps "2+3=5\n" | "5*4=20\n" | "The answer is 20." + EOS; step scores 0.5 * consistency(step)
    assert good.step_ends == [6, 13, good.num_generated] and good.step_rewards == [0.5, 0.5, 0.0]
    assert bad.step_rewards == [0.0, 0.5, 0.0]  # 2+3=6 is false; 6*4=24 alone is true
    batch = to_engine_alignment(trajectories_to_batch([good, bad]))
    adv = compute_advantages(batch, AlgorithmConfig(process_weight=1.0))["advantages"]
    assert adv.abs().sum() > 0


def answer_20(prompt, completion, data):
    return float("answer is 20" in completion)


def test_bad_trace_steps_each_scored_alone():
    steps = ["2+3=6\n", "6*4=24\n", "The answer is 24."]
    scored = build_reward(RewardConfig(kind="consistency", step_scoring="step"))
    assert asyncio.run(scored.evaluate_steps("", steps, {})) == [0.0, 1.0, 0.0]  # a step alone: its own equations
    prefix = build_reward(RewardConfig(kind="consistency", step_scoring="prefix"))
    assert asyncio.run(prefix.evaluate_steps("", steps, {})) == [0.0, 0.0, 0.0]  # the prefix holds the false one


def test_multi_turn_and_tool_turns_are_steps():
    eng = ScriptedEngine(lambda text, n: ["It is 8", "It is 9", "The answer is 7."][n % 3])

    async def per_attempt(prompt, completion, data):
        return float("answer is 7" in completion)

    class TurnScores:
        async def __call__(self, prompt, completion, data):
            return await per_attempt(prompt, completion, data)

        async def evaluate_steps(self, prompt, steps, data):
            return [float("answer is 7" in s) for s in steps]

        def close(self): ...

    wf = build_workflow(WorkflowConfig(kind="multi_turn", group_size=1, max_turns=3, steps=StepConfig(split="turns")),
                        CharTok(), TurnScores())
    (t,) = asyncio.run(wf.arun_episode(eng, {"id": "m", "prompt": "Q: 3+4?\nA:", "answer": "7"}))
    assert t.step_ends == [8, 16, 33] and t.step_rewards == [0.0, 0.0, 1.0]
    b = trajectories_to_batch([t])
    # the step rewards sit on each attempt's last generated token (its EOS), not on feedback tokens
    ends = b["step_mask"].nonzero().flatten().tolist()
    assert all(b["loss_mask"][i] == 1 and b["input_ids"][i] == EOS for i in ends)


# --------------------------------------------------------------------------- consistency


@pytest.mark.parametrize("text,score,reasons", [
    ("12 * 3 = 36\n36 + 4 = 40\nThe answer is 40.", 1.0, None),
    ("(2+3)*4 = 20. Then 20 - 1 = 19. The answer is \\boxed{19}", 1.0, None),
    ("10/3 = 3.33, so 3.33", 1.0, None),                    # to the written precision
    ("10/3 = 3.3", 1.0, None),
    ("10/3 = 3.4", 0.0, ["false_equation"]),
    ("1,000 + 5 = 1,005", 1.0, None),
    ("7 × 6 = 42 = 6 * 7. Answer: 42", 1.0, None),                      # a chain: both links
    ("12*3=35\nanswer: 35", 0.0, ["false_equation"]),
    ("2+2=4 so \\boxed{5}", 0.0, ["answer_mismatch"]),
    ("2+2=4, 4*2=9, answer 9", 0.0, ["false_equation"]),
    ("no arithmetic at all", 0.0, ["no_equation"]),
    ("3x + 2 = 11", 0.0, ["no_equation"]),                  # algebra is not an arithmetic equation
    ("1/0 = 5", 0.0, ["false_equation"]),
])
def test_consistency_checker(text, score, reasons):
    s, info = check_trace(text)
    assert s == score and info.get("reasons") == reasons, info


def test_consistency_equations_stay_on_one_line():
    assert equations("12 * 3 = 36\n36 + 4 = 40") == [("12 * 3", "36"), ("36 + 4", "40")]


# --------------------------------------------------------------------------- multi-judge (scripted engines)
from areal_mega.reward.judge import JudgeConfig, JudgeReward  # noqa: E402
from areal_mega.reward.multi_judge import MultiJudgeConfig, MultiJudgeReward, aggregate  # noqa: E402
from tests.test_judge import JudgeEngine, WordTok  # noqa: E402


def _judge(script, delay=0.01, timeout_s=5.0):
    cfg = JudgeConfig(servers="policy", timeout_s=timeout_s)
    return JudgeReward(cfg, WordTok(), JudgeEngine(script, delay=delay))


@pytest.mark.parametrize("how,scores,out", [
    ("mean", [0.2, 0.4, 0.9], 0.5), ("median", [0.2, 0.4, 0.9], 0.4), ("median", [0.2, 0.4], 0.3),
    ("majority", [0.6, 0.4, 0.9], 1.0), ("majority", [0.6, 0.4], 0.0), ("min", [0.6, 0.4, 0.9], 0.4),
])
def test_aggregations(how, scores, out):
    assert aggregate(scores, how) == pytest.approx(out)


def test_multi_judge_failures_excluded_and_a_dead_judge_is_skipped():
    class Dead(JudgeEngine):
        async def agenerate(self, req):
            raise ConnectionError("server gone")

    class Hung(JudgeEngine):
        async def agenerate(self, req):
            await asyncio.sleep(3600)

    a, b = _judge(lambda p: "Score: 8"), _judge(lambda p: "Score: 4")
    dead = JudgeReward(JudgeConfig(servers="policy"), WordTok(), Dead(None))
    hung = JudgeReward(JudgeConfig(servers="policy", timeout_s=0.2), WordTok(), Hung(None))
    mj = MultiJudgeReward([("a", a), ("b", b), ("dead", dead), ("hung", hung)], "mean", skip_after_failures=2,
                          retry_after_s=3600)

    async def run():
        return [await mj.evaluate("q", f"r{i}", {"answer": "x"}) for i in range(4)]

    res = asyncio.run(run())
    assert [r.score for r in res] == [pytest.approx(0.6)] * 4          # mean of the two that answered
    assert res[0].info["judge_scores"] == {"a": 0.8, "b": 0.4, "dead": None, "hung": None}
    assert res[0].info["disagreement"] == pytest.approx(0.4)
    assert res[0].info["reasons"] == ["judge_dead_error", "judge_hung_timeout"]
    assert res[3].info["reasons"] == ["judge_dead_skipped", "judge_hung_skipped"]  # circuit open after 2
    m = mj.metrics()
    assert m["reward/multi_judge/failures"] == 4 and m["reward/multi_judge/skipped"] == 4
    assert m["reward/judge/dead/error"] == 2 and m["reward/judge/hung/timeout"] == 2 and m["reward/judge/a/ok"] == 4
    assert m["reward/multi_judge/disagreement_mean"] == pytest.approx(0.4)


def test_multi_judge_all_failed_and_config_errors():
    bad = _judge(lambda p: "no verdict")
    mj = MultiJudgeReward([("x", bad), ("y", _judge(lambda p: "Score: eleven"))], "median")
    r = asyncio.run(mj.evaluate("q", "r", {}))
    assert r.score == 0.0 and "all_judges_failed" in r.info["reasons"]
    with pytest.raises(ValueError, match="options.judges: multi_judge needs at least 2"):
        RewardConfig(kind="multi_judge").validate()
    with pytest.raises(ValueError, match="options.aggregation"):
        RewardConfig(kind="multi_judge", options=MultiJudgeConfig(aggregation="vote")).validate()
    two = [JudgeConfig(servers="policy", name="j"), JudgeConfig(servers="policy", name="j")]
    with pytest.raises(ValueError, match="names must be unique"):
        RewardConfig(kind="multi_judge", options=MultiJudgeConfig(judges=two)).validate()
    RewardConfig().validate()  # another kind has no judges to check


def test_experiment_refuses_unusable_process_configs():
    from areal_mega.experiment import ExperimentConfig

    def exp(**kw):
        e = ExperimentConfig(model_path="m")
        for k, v in kw.items():
            obj, name = e, k.split("__")
            for part in name[:-1]:
                obj = getattr(obj, part)
            setattr(obj, name[-1], v)
        return e

    with pytest.raises(ValueError, match="algorithm.process_weight: process rewards need step boundaries"):
        exp(algorithm__process_weight=1.0).validate()
    with pytest.raises(ValueError, match="algorithm.process_weight: process rewards need a reward that scores steps"):
        exp(algorithm__process_weight=1.0, workflow__steps=StepConfig(split="turns")).validate()
    with pytest.raises(ValueError, match="reward.step_scoring: there are no steps"):
        exp(reward=RewardConfig(kind="consistency", step_scoring="step")).validate()
    with pytest.raises(ValueError, match="reward.step_scoring: the step scores would be unused"):
        exp(reward=RewardConfig(kind="consistency", step_scoring="step"), workflow__steps=StepConfig(split="regex")).validate()
    exp(reward=RewardConfig(kind="consistency", step_scoring="step"), workflow__steps=StepConfig(split="regex"),
        algorithm__process_weight=1.0).validate()


def test_generative_judge_per_step():
    """The judge asked once per step (step_scoring "step") / per prefix ("prefix"): each request's
    {response} is that step's text / the completion up to it, and its verdict the step score."""
    from areal_mega.reward.steps import StepScored

    def script(prompt):  # the rubric holds the response: grade it by its own last equation
        response = prompt.split("Response:\n", 1)[1].split("\n\nReference answer:", 1)[0]
        return "Score: 10" if check_trace(response)[0] == 1.0 else "Score: 0"

    judge = _judge(script)
    steps = ["2+3=5\n", "5*4=21\n", "So 21."]
    assert asyncio.run(StepScored(judge, "step").evaluate_steps("q", steps, {})) == [1.0, 0.0, 0.0]
    assert asyncio.run(StepScored(judge, "prefix").evaluate_steps("q", steps, {})) == [1.0, 0.0, 0.0]
    assert judge.stats["requests"] == 6 and judge.stats["ok"] == 6
    seen = [p for p in judge._engine.prompts]
    assert any("2+3=5\n5*4=21\nSo 21." in p for p in seen)  # the last prefix is the whole completion


def test_chain_task_outcome_and_step_scores(tmp_path):
    """The LM run's task (areal_mega/demo/chain.py): the outcome is the chain's answer; a step is
    right given the step before it as written, so one wrong step costs its own step score only,
    and the outcome. Step prefixes are what the product's splitter makes at "="."""
    import json

    from areal_mega.demo.chain import chain_reward, chains, reduce_first, write_data
    from areal_mega.workflows.steps import StepConfig, split_steps

    p, d = "Q:5+3-4+2=?A:", {"answer": "6"}
    assert reduce_first("8-4+2") == "4+2" and reduce_first("6") is None
    right, one_wrong = "8-4+2=4+2=6", "9-4+2=5+2=7"

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    for text, outcome, steps in ((right, 1.0, [1.0, 1.0, 1.0]), (one_wrong, 0.0, [0.0, 1.0, 0.0])):
        _, parts = split_steps(Chars(), [[ord(c) for c in text]], StepConfig(split="regex", delimiter="="))
        assert [chain_reward(p, "".join(parts[:j + 1]), d) for j in range(len(parts))] == steps
        assert chain_reward(p, text, d) == outcome
    assert chain_reward(p, "8-4+2=4+2", d) == 0.0  # finished without an answer
    assert chain_reward(p, "", d) == 0.0 and chain_reward(p, "6", d) == 1.0
    # the held-out chains are in neither train nor sft; the right answer alone is a right outcome
    assert len(chains(3)) == 2268  # every true value in [0, 6]
    write_data(tmp_path, num_steps=3, num_test=5, num_sft=50, sft_noise=0.6, seed=0)
    rows = {n: [json.loads(x) for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in ("train", "test", "sft")}
    test_ids = {r["id"] for r in rows["test"]}
    assert len(test_ids) == 5 and not test_ids & {r["id"] for r in rows["train"] + rows["sft"]}
    assert all(chain_reward(r["prompt"], r["answer"], r) == 1.0 for r in rows["train"][:20])
