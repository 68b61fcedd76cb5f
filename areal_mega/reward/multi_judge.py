"""Several judges per sample (``reward.kind: multi_judge``): different models, servers or rubrics
grade the same completion concurrently; their verdicts are aggregated.

    reward = build_reward(RewardConfig(kind="multi_judge", multi_judge=MultiJudgeConfig(
        judges=[JudgeConfig(name="a", ...), JudgeConfig(name="b", rubric=...)], aggregation="median")))

Invariant: never blocked by one judge (each bounded by its ``timeout_s``, a failing one skipped
for ``retry_after_s``); failed verdicts are left out of the aggregate, not counted as 0.
Aggregations, info, metrics: docs/rewards.md ("Multi-judge").
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from areal_mega.config import check_each
from areal_mega.kinds import KindError, resolve
from areal_mega.reward.base import RewardResult
from areal_mega.reward.judge import JudgeConfig, Verdict



@dataclass
class MultiJudgeConfig:
    """The options of ``reward.kind: multi_judge``: the judges and how their verdicts combine."""

    judges: list[JudgeConfig] = field(default_factory=list)
    """Two or more judges (each a full ``JudgeConfig``: its servers, rubric, verdict format,
    timeout_s; names unique, default ``judge<i>``)."""
    aggregation: str = "mean"
    """"mean", "median", "majority" (more than half of the answering judges score >= 0.5),
    "min" (the strictest judge), or "package.module:function" (scores -> one score), over the
    judges that answered."""
    skip_after_failures: int = 3
    """A judge whose last this-many requests failed with error or timeout is skipped..."""
    retry_after_s: float = 60.0
    """...for this long, then tried again (one success closes the circuit)."""

    def names(self) -> list[str]:
        return [j.name or f"judge{i}" for i, j in enumerate(self.judges)]

    def validate(self) -> None:
        """Value checks (run for every experiment config); ``check_ready`` adds what a multi-judge
        about to be built needs."""
        try:
            resolve("judge_aggregation", self.aggregation)
        except KindError as e:
            raise ValueError(f"aggregation: {e}") from None
        names = self.names()
        if len(set(names)) != len(names):
            raise ValueError(f"judges: names must be unique, got {names}")
        if self.skip_after_failures < 1:
            raise ValueError(f"skip_after_failures: must be >= 1, got {self.skip_after_failures}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s: must be > 0, got {self.retry_after_s}")

    def check_ready(self) -> None:
        self.validate()
        if len(self.judges) < 2:
            raise ValueError(f"judges: multi_judge needs at least 2 judges, got {len(self.judges)}")
        check_each("judges", self.judges, "check_ready")


def mean(scores: Sequence[float]) -> float:
    return sum(scores) / len(scores)


def median(scores: Sequence[float]) -> float:
    return float(statistics.median(scores))


def majority(scores: Sequence[float]) -> float:
    return 1.0 if sum(s >= 0.5 for s in scores) * 2 > len(scores) else 0.0


def minimum(scores: Sequence[float]) -> float:
    return min(scores)


def aggregate(scores: Sequence[float], how: str) -> float:
    """The aggregation ``how`` names (a built-in above or "package.module:function", scores ->
    one score in [0, 1]) over the answering judges' scores."""
    return float(resolve("judge_aggregation", how)(scores))


class MultiJudgeReward:
    """``judges``: (name, JudgeReward) pairs (``build_multi_judge`` builds them from config)."""

    def __init__(self, judges: Sequence[tuple[str, Any]], aggregation: str = "mean", *,
                 skip_after_failures: int = 3, retry_after_s: float = 60.0) -> None:
        self.judges = list(judges)
        self.aggregation = aggregation
        aggregate([1.0], aggregation)  # unknown names fail here
        self.skip_after_failures, self.retry_after_s = skip_after_failures, retry_after_s
        self._consecutive = {n: 0 for n, _ in self.judges}
        self._open_until = {n: 0.0 for n, _ in self.judges}
        self.stats: dict[str, float] = {"samples": 0, "all_failed": 0, "failures": 0, "skipped": 0,
                                        "disagreement_sum": 0.0, "disagreement_n": 0}

    async def _one(self, name: str, judge: Any, prompt: str, completion: str, data: dict[str, Any]) -> Verdict:
        if time.monotonic() < self._open_until[name]:
            return Verdict(0.0, "skipped")
        try:
            v = await judge.judge(prompt, completion, data)
        except Exception as e:  # a judge that cannot even start its pool is a failed judge, not a failed episode
            v = Verdict(0.0, "error", f"{type(e).__name__}: {e}")
        if v.reason in ("error", "timeout"):
            self._consecutive[name] += 1
            if self._consecutive[name] >= self.skip_after_failures:
                self._open_until[name] = time.monotonic() + self.retry_after_s
        else:
            self._consecutive[name] = 0
        return v

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        verdicts = await asyncio.gather(*[self._one(n, j, prompt, completion, data) for n, j in self.judges])
        scores = {n: (v.reward if v.reason == "ok" else None) for (n, _), v in zip(self.judges, verdicts)}
        answered = [s for s in scores.values() if s is not None]
        reasons = [f"judge_{n}_{v.reason}" for (n, _), v in zip(self.judges, verdicts) if v.reason != "ok"]
        self.stats["samples"] += 1
        self.stats["failures"] += sum(v.reason not in ("ok", "skipped") for v in verdicts)
        self.stats["skipped"] += sum(v.reason == "skipped" for v in verdicts)
        disagreement = max(answered) - min(answered) if len(answered) >= 2 else 0.0
        if len(answered) >= 2:
            self.stats["disagreement_sum"] += disagreement
            self.stats["disagreement_n"] += 1
        if not answered:
            self.stats["all_failed"] += 1
            reasons.append("all_judges_failed")
            score = 0.0
        else:
            score = aggregate(answered, self.aggregation)
        info: dict[str, Any] = {"judge_scores": scores, "disagreement": disagreement, "num_answered": len(answered)}
        if reasons:
            info["reasons"] = reasons
        return RewardResult(score, info)

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, j in self.judges:
            for k, v in j.metrics().items():
                out[k.replace("reward/judge_", f"reward/judge/{name}/")] = v
        s = self.stats
        out.update({f"reward/multi_judge/{k}": float(s[k]) for k in ("samples", "all_failed", "failures", "skipped")})
        out["reward/multi_judge/disagreement_mean"] = s["disagreement_sum"] / max(s["disagreement_n"], 1)
        return out

    async def aclose(self) -> None:
        for _, j in self.judges:
            await j.aclose()

    def close(self) -> None:
        for _, j in self.judges:
            j.close()


def build_multi_judge(cfg: MultiJudgeConfig, *, policy_engine: Any = None, policy_tokenizer: Any = None) -> MultiJudgeReward:
    from areal_mega.reward.judge import build_judge

    try:
        cfg.check_ready()
    except ValueError as e:
        raise ValueError(f"multi_judge.{e}") from None
    built: list[tuple[str, Any]] = []
    try:
        for name, jc in zip(cfg.names(), cfg.judges):
            built.append((name, build_judge(jc, policy_engine=policy_engine, policy_tokenizer=policy_tokenizer)))
    except BaseException:
        for _, j in built:
            j.close()
        raise
    return MultiJudgeReward(built, cfg.aggregation, skip_after_failures=cfg.skip_after_failures,
                            retry_after_s=cfg.retry_after_s)
