"""Rewards: answer extraction, math-verify in worker processes, timeouts/crashes score 0,
user functions by dotted path, shaping (format, DAPO overlong penalty, weighted composition;
hand-computed), the sandbox's refusal without namespaces and its verdict (~8 s: worker start-up imports
math-verify). The worker-pool tests start processes: ``slow``; the sandbox's attack suite is
tests/test_sandbox.py."""

import asyncio
import os
import textwrap

import pytest

from areal_mega.config import ConfigError, from_dict
from areal_mega.reward import (COMPLETION_TOKENS, FormatOptions, FunctionOptions, RewardConfig, RewardWorkerPool, build_reward,
                               evaluate)
from areal_mega.reward.math import MathReward, extract_answer
from areal_mega.reward.shaping import overlong_penalty


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
    fn = build_reward(RewardConfig(kind="function", options=FunctionOptions(function=f"{m}:alength", isolate=False)))
    assert asyncio.run(fn("p", "hello", {})) == 5.0
    with pytest.raises(ValueError, match="no callable 'nope'"):
        build_reward(RewardConfig(kind="function", options=FunctionOptions(function=f"{m}:nope")))
    with pytest.raises(ConfigError, match="function"):
        from_dict(RewardConfig, {"kind": "function", "options": {"function": "no_colon"}})


def test_sandbox_refuses_without_namespaces(monkeypatch):
    """Where namespaces are unavailable, the default mode refuses to run untrusted code and
    names the key that opts into the weaker mode (no process is started)."""
    import areal_mega.sandbox as sandbox

    monkeypatch.setattr(sandbox, "namespaces_unavailable", lambda: "needs root")
    with pytest.raises(sandbox.SandboxUnavailable, match=r"sandbox.mode: 'namespaces' is unavailable .*needs root.*rlimits_only_unsafe"):
        build_reward(RewardConfig(kind="code"))
    with pytest.raises(ConfigError, match="reward.options.mode"):
        from_dict(RewardConfig, {"kind": "code", "options": {"mode": "bwrap"}}, prefix="reward.")


def test_sandbox_verdict_is_the_runners():
    """The reason comes from what the runner observed (its timer, the cgroup, PID 1's report of
    the exit status or the signal), never from the program's exit code or stderr: the exit codes
    the old classifier read as signals or set-up failures are runtime_error (issue #24)."""
    import signal

    from areal_mega.sandbox.runner import verdict

    for forged in (121, 137, 128 + signal.SIGXCPU, 128 + signal.SIGXFSZ, 1):
        assert verdict(None, False, {"exit": forged}) == "runtime_error"
    assert verdict(None, False, {"exit": 0}) == "ok"
    assert verdict(None, False, {"signal": signal.SIGXCPU}) == "timeout"
    assert verdict(None, False, {"signal": signal.SIGXFSZ}) == "file_size"
    assert verdict(None, False, {"signal": signal.SIGKILL}) == "killed"
    assert verdict(None, True, {"signal": signal.SIGKILL}) == "memory"  # the cgroup's OOM killer
    assert verdict(None, True, {"exit": 0}) == "memory"  # it killed a child; the main process went on
    assert verdict("timeout", True, {}) == "timeout" and verdict("output_limit", False, {"exit": 0}) == "output_limit"
    assert verdict(None, False, {"syntax_error": True}) == "syntax_error"
    assert verdict(None, False, {"setup_error": "mount"}) == "sandbox_error"
    assert verdict(None, False, {}) == "sandbox_error"  # PID 1 gone without a report


@pytest.mark.parametrize("n,expected", [(0, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0), (21, -1.0), (500, -1.0)])
def test_overlong_penalty_hand_computed(n, expected):
    # DAPO eq. 13 with L_max = 20, L_cache = 5: 0 up to 15 tokens, then (15 - L) / 5, -1 past 20.
    assert overlong_penalty(n, 20, 5) == pytest.approx(expected, abs=1e-12)


def test_format_reward():
    fmt = build_reward(RewardConfig(kind="format"))  # default: a non-empty \boxed{...}
    assert [asyncio.run(fmt("q", c, {})) for c in ("so \\boxed{42}.", "42", "\\boxed{}")] == [1.0, 0.0, 0.0]
    custom = build_reward(RewardConfig(kind="format", options=FormatOptions(r"^<think>.*</think>\s*Answer: \d+$")))
    assert asyncio.run(custom("q", "<think>a\nb</think> Answer: 7", {})) == 1.0
    assert asyncio.run(custom("q", "Answer: 7", {})) == 0.0
    with pytest.raises(ConfigError, match=r"reward.options.regex: '\(' is not a valid regex"):
        from_dict(RewardConfig, {"kind": "format", "options": {"regex": "("}}, prefix="reward.")


def test_composite_reward_weights_and_info(helper_module):
    m = helper_module
    cfg = from_dict(RewardConfig, {"kind": "composite", "options": {"components": [
        {"kind": "function", "options": {"function": f"{m}:length", "isolate": False}},
        {"kind": "format", "weight": 0.5},
        {"kind": "overlong", "weight": 2.0, "options": {"max_tokens": 20, "buffer_tokens": 5}},
    ]}}, prefix="reward.")
    fn = build_reward(cfg)
    # "\boxed{7}" has 9 characters: 9 (length) + 0.5 * 1 (format) + 2 * (15 - 18) / 5 (overlong) = 8.3
    r = asyncio.run(evaluate(fn, "q", "\\boxed{7}", {COMPLETION_TOKENS: 18}))
    assert r.score == pytest.approx(9 + 0.5 - 1.2, abs=1e-12)
    assert r.info["components"] == {"function": 9.0, "format": 1.0, "overlong": pytest.approx(-0.6)}
    assert r.info["reasons"] == ["overlong"]
    # plain text, short: 4 + 0 + 0, and the failed format is a reason
    r = asyncio.run(evaluate(fn, "q", "abcd", {COMPLETION_TOKENS: 3}))
    assert (r.score, r.info["reasons"]) == (4.0, ["format"])
    assert asyncio.run(fn("q", "abcd", {COMPLETION_TOKENS: 3})) == 4.0  # the float interface
    with pytest.raises(ValueError, match=COMPLETION_TOKENS):
        asyncio.run(fn("q", "abcd", {}))  # the length term needs the workflow's token count
    fn.close()


@pytest.mark.parametrize("components,match", [
    ([], "reward.options.components: kind 'composite' needs at least one component"),
    ([{"kind": "overlong", "options": {"max_tokens": 4, "buffer_tokens": 5}}], r"reward.options.components\[0\].options.buffer_tokens"),
    ([{"kind": "composite", "options": {"components": [{"kind": "format"}]}}], r"reward.options.components\[0\].kind: a composite cannot contain"),
    ([{"kind": "format"}, {"kind": "format", "options": {"regex": "x"}}], None),
])
def test_composite_config_refusals(components, match):
    if match is None:  # repeated kinds get positional names
        cfg = from_dict(RewardConfig, {"kind": "composite", "options": {"components": components}}, prefix="reward.")
        assert cfg.options.names() == ["format0", "format1"]
        return
    with pytest.raises(ConfigError, match=match):
        from_dict(RewardConfig, {"kind": "composite", "options": {"components": components}}, prefix="reward.")
