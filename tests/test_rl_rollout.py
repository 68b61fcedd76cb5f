"""Staleness manager and rollout controller with an in-process fake engine (~3 s).

The core check is a randomized simulation of the async RL loop (random generation lengths
with a heavy tail so episodes overtake each other, random training time): no batch ever
contains a generated token older than max_staleness versions, and max_staleness = 0 is
exactly synchronous (every token of batch v was sampled at version v).
"""

import asyncio
import io
import random
import threading

import pytest

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationRequest, GenerationResult, SamplingParams
from areal_mega.api.workflow import RolloutWorkflow, Trajectory
from areal_mega.rollout.config import RolloutConfig
from areal_mega.rollout.controller import RolloutController, StalenessViolation
from areal_mega.rollout.staleness import StalenessManager


class FakeEngine(InferenceEngine):
    """Generates tokens in chunks; each token records the engine version at the time it was
    sampled, like an interruptible server across weight updates."""

    def __init__(self, rng: random.Random, chunk_sleep=(0.0, 0.002), tail_p=0.1, tail_sleep=0.02, version_lag=0):
        self.rng, self.chunk_sleep, self.tail_p, self.tail_sleep = rng, chunk_sleep, tail_p, tail_sleep
        self.version = 0
        self.version_lag = version_lag
        self.calls = 0

    async def agenerate(self, req: GenerationRequest) -> GenerationResult:
        self.calls += 1
        n = self.rng.randint(1, req.sampling.max_new_tokens)
        ids, versions = [], []
        for i in range(n):
            if i % 3 == 0:
                slow = self.rng.random() < self.tail_p
                await asyncio.sleep(self.tail_sleep if slow else self.rng.uniform(*self.chunk_sleep))
            ids.append(self.rng.randint(1, 50))
            versions.append(self.version - self.version_lag)
        return GenerationResult(list(req.input_ids), ids, [-1.0] * n, versions, "stop")

    async def pause(self): ...
    async def resume(self): ...
    def get_version(self): return self.version
    def set_version(self, v): self.version = v


class GroupWorkflow(RolloutWorkflow):
    def __init__(self, group_size=2, rewards=None):
        self.group_size = group_size
        self.rewards = rewards  # callable(data, i) -> reward

    async def arun_episode(self, engine, data):
        sp = SamplingParams(max_new_tokens=12)
        results = await asyncio.gather(
            *[engine.agenerate(GenerationRequest(data["prompt_ids"], sp)) for _ in range(self.group_size)]
        )
        out = []
        for i, r in enumerate(results):
            p = len(r.input_ids)
            reward = self.rewards(data, i) if self.rewards else float(i % 2)
            out.append(Trajectory(
                r.input_ids + r.output_ids, [0] * p + [1] * len(r.output_ids), [0.0] * p + r.output_logprobs,
                [-1] * p + r.output_versions, reward, group_id=str(data["id"]),
            ))
        return out


def dataset(n=10):
    return [{"id": i, "prompt_ids": [1, 2, i + 3]} for i in range(n)]


def test_staleness_manager_formula():
    sm = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=6)
    # (1 + 0 + 1) * 4 - 0 = 8, but max_concurrent 6
    assert sm.capacity() == 6
    assert [sm.try_admit() for _ in range(7)] == [0] * 6 + [None]
    for _ in range(4):
        sm.on_accepted()
    # running 2, accepted 4: min(6 - 2, 8 - 6) = 2
    assert sm.capacity() == 2
    sm.on_rejected()  # a filtered episode gives its slot back
    assert sm.capacity() == 3
    sm.set_version(1)  # (1 + 1 + 1) * 4 - 5 = 7 -> min(5, 7)
    assert sm.capacity() == 5
    assert sm.snapshot() == {"version": 1, "running": 1, "accepted": 4, "rejected": 1, "capacity": 5}
    sync = StalenessManager(batch_size=2, max_staleness=0, max_concurrent=100, version=7)
    assert [sync.try_admit() for _ in range(3)] == [7, 7, None]  # resumed run: counts from version 7
    with pytest.raises(ValueError, match="version"):
        sync.set_version(3)


def test_staleness_manager_thread_safe():
    sm = StalenessManager(batch_size=50, max_staleness=1, max_concurrent=1000)
    got = []

    def worker():
        n = 0
        for _ in range(200):
            if sm.try_admit() is not None:
                n += 1
        got.append(n)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sum(got) == 100 and sm.snapshot()["running"] == 100


async def _simulate(eta, seed, steps=10, batch_size=4, max_concurrent=16):
    rng = random.Random(seed)
    engine = FakeEngine(rng)
    cfg = RolloutConfig(batch_size=batch_size, max_staleness=eta, max_concurrent=max_concurrent, show_progress=False)
    ctrl = RolloutController(engine, GroupWorkflow(), dataset(), cfg)
    await ctrl.astart()
    seen_max = 0
    try:
        for v in range(steps):
            batch = await ctrl.aget_batch()
            assert batch.version == v and len(batch.groups) == batch_size
            for t in batch.trajectories:
                gen = [tv for tv, m in zip(t.versions, t.loss_mask) if m]
                assert min(gen) >= v - eta, (eta, v, gen)
                if eta == 0:
                    assert set(gen) == {v}
                seen_max = max(seen_max, v - min(gen))
            assert batch.stats["staleness/max"] <= eta
            assert sum(batch.staleness_counts.values()) == batch.stats["rollout/num_generated_tokens"]
            await asyncio.sleep(rng.uniform(0, 0.01))  # "training"
            engine.set_version(v + 1)  # weight sync, then tell the controller
            ctrl.set_version(v + 1)
    finally:
        await ctrl.aclose()
    return seen_max


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_randomized_bound_holds(eta):
    seen = [asyncio.run(_simulate(eta, seed, batch_size=2 + seed % 3, max_concurrent=4 + 6 * seed)) for seed in range(4)]
    assert max(seen) <= eta
    if eta > 0:
        assert max(seen) > 0, "the simulation never overlapped generation and training"


def test_simulation_catches_completion_order_batching(monkeypatch):
    # Negative control: forming batches in completion order with only the admission rule
    # (no wait for older episodes) lets a slow episode fall behind; the invariant check fires.
    monkeypatch.setattr(RolloutController, "_can_form", lambda self, n, version: len(self._ready) >= n)
    violations = 0
    for seed in range(6):
        try:
            asyncio.run(_simulate(1, seed, steps=12, batch_size=2, max_concurrent=32))
        except StalenessViolation:
            violations += 1
    assert violations > 0


def test_violation_is_detected():
    # The engine reports tokens 2 versions older than the controller thinks: must raise.
    async def run():
        engine = FakeEngine(random.Random(0), version_lag=2)
        engine.version = 5
        cfg = RolloutConfig(batch_size=2, max_staleness=1, show_progress=False)
        ctrl = RolloutController(engine, GroupWorkflow(), dataset(), cfg, version=5)
        await ctrl.astart()
        try:
            await ctrl.aget_batch()
        finally:
            await ctrl.aclose()

    with pytest.raises(StalenessViolation, match="older than max_staleness=1"):
        asyncio.run(run())


def test_dynamic_filter_oversamples_and_progress_only_on_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    async def run(stream):
        engine = FakeEngine(random.Random(1))
        # even prompt ids: all rewards equal (rejected); odd: rewards 0/1
        wf = GroupWorkflow(rewards=lambda d, i: float(i % 2) if d["id"] % 2 else 1.0)
        cfg = RolloutConfig(batch_size=3, max_staleness=0, filter_zero_variance=True)
        ctrl = RolloutController(engine, wf, dataset(10), cfg, progress_stream=stream)
        await ctrl.astart()
        try:
            b0 = await ctrl.aget_batch()
            engine.set_version(1)
            ctrl.set_version(1)
            b1 = await ctrl.aget_batch()
        finally:
            await ctrl.aclose()
        return b0, b1

    tty = Tty()
    b0, b1 = asyncio.run(run(tty))
    for b in (b0, b1):
        assert len(b.groups) == 3
        assert all(int(g[0].group_id) % 2 == 1 for g in b.groups)
        assert b.stats["rollout/reward_mean"] == 0.5
    assert b0.stats["rollout/rejected_episodes"] >= 2
    assert "[rollout]" in tty.getvalue()
    plain = io.StringIO()
    asyncio.run(run(plain))
    assert plain.getvalue() == ""


def test_thread_mode_and_error_propagation():
    """The product's threading: the controller's loop in one thread, the trainer's
    ``set_version`` from another (here a worker thread of the loop)."""
    engine = FakeEngine(random.Random(2))
    cfg = RolloutConfig(batch_size=2, max_staleness=1, show_progress=False)

    async def run_versions():
        ctrl = RolloutController(engine, GroupWorkflow(), dataset(3), cfg)
        await ctrl.astart()
        try:
            for v in range(4):  # 4 * 2 episodes over 3 prompts: cycles epochs
                b = await asyncio.wait_for(ctrl.aget_batch(), 10)
                assert b.version == v and len(b.trajectories) == 4
                engine.set_version(v + 1)
                await asyncio.to_thread(ctrl.set_version, v + 1)
            assert ctrl.epoch >= 2
        finally:
            await ctrl.aclose()

    asyncio.run(run_versions())

    class Boom(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            raise KeyError("answer")

    # Every episode fails: counted, retried, skipped, until the failure budget stops the run with
    # a message naming its key (a run of failures, never the first one).
    async def run_boom():
        ctrl = RolloutController(engine, Boom(), dataset(3), cfg)
        await ctrl.astart()
        try:
            with pytest.raises(RuntimeError, match=r"rollout.max_failure_rate: 51 of the last 100 episodes failed"):
                await asyncio.wait_for(ctrl.aget_batch(), 10)
        finally:
            await ctrl.aclose()

    asyncio.run(run_boom())


def test_failed_episodes_are_counted_retried_and_skipped_never_lost():
    """Episode failures are data: a prompt that fails once is run again and trained; one that
    always fails is skipped after 1 + max_episode_retries attempts and handed out in
    ``batch.skipped``; every prompt is trained or skipped, none twice; failures by reason."""
    from areal_mega.inference.client import InferenceServerError
    from areal_mega.rollout.failures import EpisodeFailure

    attempts: dict[int, int] = {}

    class Flaky(GroupWorkflow):
        async def arun_episode(self, engine, data):
            i = data["id"]
            attempts[i] = attempts.get(i, 0) + 1
            if i == 5:  # always: a server 4xx
                raise InferenceServerError("http://s", "/generate", 400, "bad sampling key")
            if i == 2 and attempts[i] == 1:
                raise InferenceServerError("http://s", "/generate", 400,
                                           "Input length (250 tokens) exceeds the maximum allowed length")
            if i == 7 and attempts[i] == 1:
                raise EpisodeFailure("reward_exception", "ZeroDivisionError")
            if i == 8 and attempts[i] == 1:
                raise asyncio.TimeoutError()
            return await super().arun_episode(engine, data)

    async def run():
        engine = FakeEngine(random.Random(3))
        cfg = RolloutConfig(batch_size=3, max_staleness=0, max_episode_retries=2, show_progress=False)
        ctrl = RolloutController(engine, Flaky(), dataset(10), cfg)
        await ctrl.astart()
        batches = []
        try:
            for v in range(3):
                batches.append(await ctrl.aget_batch())
                engine.set_version(v + 1)
                ctrl.set_version(v + 1)
        finally:
            await ctrl.aclose()
        return batches

    batches = asyncio.run(run())
    trained = [int(g[0].group_id) for b in batches for g in b.groups]
    skipped = [s for b in batches for s in b.skipped]
    assert sorted(trained) == [0, 1, 2, 3, 4, 6, 7, 8, 9]  # all but 5, each once
    assert [(s["id"], s["reason"]) for s in skipped] == [(5, "server_4xx")]
    assert attempts[5] == 3 and attempts[2] == attempts[7] == attempts[8] == 2
    failed: dict[str, float] = {}
    for b in batches:
        for k, v in b.stats.items():
            if k.startswith("rollout/failed/"):
                failed[k] = failed.get(k, 0) + v
    assert failed == {"rollout/failed/server_4xx": 3, "rollout/failed/context_overflow": 1,
                      "rollout/failed/reward_exception": 1, "rollout/failed/timeout": 1}
    assert sum(b.stats["rollout/skipped_prompts"] for b in batches) == 1
    assert sum(b.stats["rollout/retried_episodes"] for b in batches) == 5


def test_pause_stops_admission():
    async def run():
        engine = FakeEngine(random.Random(4))
        cfg = RolloutConfig(batch_size=2, max_staleness=4, max_concurrent=4, show_progress=False)
        ctrl = RolloutController(engine, GroupWorkflow(), dataset(), cfg)
        ctrl.pause()
        await ctrl.astart()
        await asyncio.sleep(0.05)
        assert engine.calls == 0 and ctrl.snapshot()["running"] == 0
        ctrl.resume()
        b = await ctrl.aget_batch()
        await ctrl.aclose()
        return b

    assert len(asyncio.run(run()).groups) == 2


def test_inflight_time_is_logged_per_batch():
    """rollout/gen_inflight_s (what the simulator's calibration fits each run's decode speed on):
    in synchronous mode nothing is in flight while the learner "trains", so the in-flight times
    and the training sleeps add up to at most the wall time; every batch waited for at least one
    episode's generation (>= the engine's minimum sleep)."""
    import time

    async def run():
        rng = random.Random(0)
        engine = FakeEngine(rng, chunk_sleep=(0.004, 0.004), tail_p=0.0)
        cfg = RolloutConfig(batch_size=2, max_staleness=0, max_concurrent=2, show_progress=False)
        ctrl = RolloutController(engine, GroupWorkflow(), dataset(), cfg)
        t0 = time.monotonic()
        await ctrl.astart()
        inflight, train = [], 0.05
        try:
            for v in range(4):
                batch = await ctrl.aget_batch()
                inflight.append(batch.stats["rollout/gen_inflight_s"])
                await asyncio.sleep(train)  # "training": admission is closed at max_staleness 0
                engine.set_version(v + 1)
                ctrl.set_version(v + 1)
        finally:
            await ctrl.aclose()
        return inflight, time.monotonic() - t0, train

    inflight, wall, train = asyncio.run(run())
    assert all(x >= 0.004 for x in inflight), inflight  # >= one chunk's sleep of one episode
    assert sum(inflight) + 4 * train <= wall, (inflight, wall)


def test_batch_stats_pool_step_rewards():
    """rollout/step_reward_mean pools every step reward of the batch; absent without steps."""
    class Steps(GroupWorkflow):
        async def arun_episode(self, engine, data):
            out = await super().arun_episode(engine, data)
            for i, t in enumerate(out):  # trajectory i: up to i + 1 steps, the last rewarded 1.0, the rest 0.5
                n = sum(t.loss_mask)
                t.step_ends = list(range(1, i + 1)) + [n] if n > i else [n]
                t.step_rewards = [0.5] * (len(t.step_ends) - 1) + [1.0]
            return out

    async def run(wf):
        ctrl = RolloutController(FakeEngine(random.Random(3)), wf, dataset(4), RolloutConfig(batch_size=2))
        await ctrl.astart()
        try:
            return await ctrl.aget_batch()
        finally:
            await ctrl.aclose()

    b = asyncio.run(run(Steps()))
    steps = [r for g in b.groups for t in g for r in t.step_rewards]
    assert b.stats["rollout/step_reward_mean"] == sum(steps) / len(steps) < 1.0
    assert b.stats["rollout/steps_per_trajectory"] == len(steps) / 4
    assert "rollout/step_reward_mean" not in asyncio.run(run(GroupWorkflow())).stats
