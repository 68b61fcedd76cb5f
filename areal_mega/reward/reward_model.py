"""Reward models served by SGLang (``reward.kind: reward_model``): a one-label sequence-classification
model scores prompt + completion; with ``step_scoring: prefix`` it is a process reward model
scoring each step's prefix.

    (prompt, completion) --template / chat template (learner-side tokenizer)--> token ids
        --(at most max_concurrent in flight, round robin over the servers)--> POST /classify
        <-- embedding[0] = the score head on the last token --> transform (raw | sigmoid) -> score

A failed or timed-out request scores 0 (``rm_error`` / ``rm_timeout``); the episode goes on.
Servers, the SGLang score-bias defect: docs/rewards.md ("Reward models on SGLang").
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from areal_mega.inference import sglang_api
from areal_mega.inference.config import InferenceConfig, check_pool_named
from areal_mega.reward.base import RewardResult


@dataclass
class RewardModelConfig:
    """The options of ``reward.kind: reward_model``: the RM's servers and how a sample becomes its input."""

    inference: InferenceConfig | str | None = None
    """The RM's servers: launch settings (``server.model_path`` = the RM's HF directory) or
    ``addresses`` of servers already started with ``--is-embedding``; or the name of a pool
    defined once under the experiment's ``servers``."""
    tokenizer_path: str = ""
    """HF directory of the RM's tokenizer; empty: ``inference.server.model_path``."""
    chat_template: bool = False
    """Render [user: prompt, assistant: completion] with the tokenizer's chat template (as chat
    RMs are trained); off: the text ``template`` fills."""
    template: str = "{prompt}{completion}"
    """chat_template off: the RM's input text, placeholders {prompt} and {completion}."""
    transform: Literal["raw", "sigmoid"] = "raw"
    """The score: the RM's output as is, or its sigmoid (a Bradley-Terry logit as a probability)."""
    max_concurrent: int = 64
    """RM requests in flight at once."""
    timeout_s: float = 60.0
    """Per-request limit; a slower request scores 0 (reason ``rm_timeout``)."""

    def validate(self) -> None:
        if "{completion}" not in self.template:
            raise ValueError("template: must contain the {completion} placeholder")
        if self.transform not in ("raw", "sigmoid"):
            raise ValueError(f"transform: must be raw or sigmoid, got {self.transform!r}")
        if self.max_concurrent < 1 or self.timeout_s <= 0:
            raise ValueError(f"max_concurrent / timeout_s: must be >= 1 / > 0, got {self.max_concurrent}, {self.timeout_s}")

    def check_ready(self) -> None:
        self.validate()
        check_pool_named(self.inference)
        if self.inference is None:
            raise ValueError("inference: kind 'reward_model' needs the RM's servers (launch settings or addresses)")
        try:
            self.inference.validate()
        except ValueError as e:
            raise ValueError(f"inference.{e}") from None
        if not self.tokenizer_path and not self.inference.server.model_path:
            raise ValueError("tokenizer_path: needed when the RM's servers are given by inference.addresses")


class RewardModelReward:
    """``await rm(prompt, completion, data) -> float``; ``score_ids(ids)`` scores token ids."""

    def __init__(self, cfg: RewardModelConfig, tokenizer: Any) -> None:
        cfg.check_ready()
        assert cfg.inference is not None
        self.cfg, self.tokenizer = cfg, tokenizer
        self._servers: list[Any] = []
        inf = cfg.inference
        if not inf.addresses:
            from areal_mega.inference.server import make_servers

            extra = list(inf.server.extra_args)
            if "--is-embedding" not in extra:
                extra.append("--is-embedding")
            inf = dataclasses.replace(inf, server=dataclasses.replace(inf.server, extra_args=extra))
            self._servers = make_servers(inf)
            for s in self._servers:
                s.start()
            urls = [s.url for s in self._servers]
        else:
            urls = list(inf.addresses)
        key = inf.resolved_api_key()
        self._clients = [sglang_api.SGLangClient(u, timeout_s=cfg.timeout_s, api_key=key) for u in urls]
        self._next = itertools.cycle(range(len(self._clients)))
        self._ready = not self._servers
        self._ready_lock: asyncio.Lock | None = None
        self._sem: asyncio.Semaphore | None = None
        self.stats: dict[str, float] = {"requests": 0, "ok": 0, "rm_error": 0, "rm_timeout": 0, "latency_s": 0.0}

    async def _wait_ready(self) -> None:
        if self._ready:
            return
        if self._ready_lock is None:
            self._ready_lock = asyncio.Lock()
        async with self._ready_lock:
            if not self._ready:
                await asyncio.gather(*(asyncio.to_thread(s.wait_ready) for s in self._servers))
                self._ready = True

    def input_ids(self, prompt: str, completion: str) -> list[int]:
        if self.cfg.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False)
        else:
            text = self.cfg.template.replace("{prompt}", prompt).replace("{completion}", completion)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def score_ids(self, ids: list[int]) -> tuple[float, str]:
        """(score, "ok") or (0.0, "rm_error" | "rm_timeout")."""
        await self._wait_ready()
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.cfg.max_concurrent)
        self.stats["requests"] += 1
        async with self._sem:
            client = self._clients[next(self._next)]
            t0 = time.monotonic()
            try:
                out = await asyncio.wait_for(asyncio.to_thread(client.send, sglang_api.classify(ids)), self.cfg.timeout_s)
                raw = float(out["embedding"][0])
                reason = "ok"
            except asyncio.TimeoutError:
                raw, reason = 0.0, "rm_timeout"
            except Exception:  # a failed RM request scores 0; never kills the episode
                raw, reason = 0.0, "rm_error"
            self.stats["latency_s"] += time.monotonic() - t0
        self.stats[reason] += 1
        if reason != "ok":
            return 0.0, reason
        return (1.0 / (1.0 + math.exp(-raw)) if self.cfg.transform == "sigmoid" else raw), reason

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        score, reason = await self.score_ids(self.input_ids(prompt, completion))
        return RewardResult(score, {} if reason == "ok" else {"reasons": [reason]})

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    def metrics(self) -> dict[str, float]:
        out = {f"reward/rm_{k}" if not k.startswith("rm_") else f"reward/{k}": float(v)
               for k, v in self.stats.items() if k != "latency_s"}
        out["reward/rm_latency_s"] = self.stats["latency_s"] / max(self.stats["requests"], 1)
        return out

    def close(self) -> None:
        for s in self._servers:
            s.close()


def build_reward_model(cfg: RewardModelConfig) -> RewardModelReward:
    try:
        cfg.check_ready()
    except ValueError as e:
        raise ValueError(f"reward_model.{e}") from None
    from transformers import AutoTokenizer

    assert cfg.inference is not None
    return RewardModelReward(cfg, AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.inference.server.model_path))
