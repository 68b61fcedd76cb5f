"""Rewards: answer extraction, math-verify in worker processes, timeouts/crashes score 0,
user functions by dotted path, the code sandbox (~8 s: worker start-up imports math-verify).
The worker-pool and sandbox tests start processes: ``slow``."""

import asyncio
import os
import textwrap

import pytest

from areal_mega.config import ConfigError, from_dict
from areal_mega.reward import RewardConfig, RewardWorkerPool, build_reward
from areal_mega.reward.math import MathReward, extract_answer


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so the total is \\boxed{\\frac{1}{2}} and 3 more", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{{2}+3}", "{2}+3"),
        ("We get 12 apples. The answer is 42.", "42"),
        ("Answer: $x = 7$\nmore text 9", "x = 7"),
        ("first 3, then 1,250 and finally -4.5 is left", "-4.5"),
        ("1,250 coins", "1250"),
        ("no digits here", None),
        ("cut off \\boxed{12", "12"),  # unbalanced box: falls back to the last number
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.slow
def test_math_reward_in_worker():
    reward = MathReward(num_workers=1, timeout_s=20.0)
    try:
        cases = [
            ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
            ("so it is 1,000", "1000", 1.0),
            ("The answer is 50%", "0.5", 1.0),
            ("I think \\boxed{7}", "8", 0.0),
            ("nothing", "3", 0.0),
        ]

        async def run():
            return await asyncio.gather(*[reward("q", c, {"answer": a}) for c, a, _ in cases])

        assert asyncio.run(run()) == [e for *_, e in cases]
        assert reward.pool.stats["ok"] == len(cases)
    finally:
        reward.close()


@pytest.fixture
def helper_module(tmp_path, monkeypatch):
    (tmp_path / "reward_helpers_t.py").write_text(textwrap.dedent("""
        import os, time
        def hang(p, c, d): time.sleep(600); return 1.0
        def crash(p, c, d): os._exit(3)
        def boom(p, c, d): raise RuntimeError("bad sample")
        def length(p, c, d): return float(len(c)) + d.get("bonus", 0)
        async def alength(p, c, d): return float(len(c))
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # seen by the worker processes
    monkeypatch.syspath_prepend(str(tmp_path))
    return "reward_helpers_t"


@pytest.mark.slow
def test_pool_timeout_crash_error_score_default(helper_module):
    m = helper_module
    with RewardWorkerPool(num_workers=1, timeout_s=1.0, default=0.0) as pool:
        assert pool.call(f"{m}:length", "p", "abc", {"bonus": 1}) == 4.0
        pid = next(iter(pool._all)).proc.pid
        assert pool.call(f"{m}:hang", "p", "c", {}) == 0.0
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert pool.call(f"{m}:crash", "p", "c", {}) == 0.0
        assert pool.call(f"{m}:boom", "p", "c", {}) == 0.0
        assert pool.call(f"{m}:length", "p", "abcd", {}) == 4.0  # a fresh worker took over
        assert pool.stats == {"ok": 2, "timeout": 1, "crash": 1, "error": 1}


def test_user_function_registry(helper_module):
    m = helper_module
    fn = build_reward(RewardConfig(kind="function", function=f"{m}:alength", isolate=False))
    assert asyncio.run(fn("p", "hello", {})) == 5.0
    with pytest.raises(ValueError, match="no callable 'nope'"):
        build_reward(RewardConfig(kind="function", function=f"{m}:nope"))
    with pytest.raises(ConfigError, match="function"):
        from_dict(RewardConfig, {"kind": "function", "function": "no_colon"})


def test_sandbox_refuses_without_namespaces(monkeypatch):
    """Where namespaces are unavailable, the default mode refuses to run untrusted code and
    names the key that opts into the weaker mode (no process is started)."""
    import areal_mega.sandbox as sandbox

    monkeypatch.setattr(sandbox, "namespaces_unavailable", lambda: "needs root")
    with pytest.raises(sandbox.SandboxUnavailable, match=r"sandbox.mode: 'namespaces' is unavailable .*needs root.*rlimits_only_unsafe"):
        build_reward(RewardConfig(kind="code"))
    with pytest.raises(ConfigError, match="reward.sandbox.mode"):
        from_dict(RewardConfig, {"kind": "code", "sandbox": {"mode": "bwrap"}}, prefix="reward.")
