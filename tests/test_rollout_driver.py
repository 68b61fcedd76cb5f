"""RolloutDriver (the trainer's generation side) against an in-process fake SGLang server
(tests/support/fake_sglang.py), for the case the e2e failover test cannot force: the whole
pool restarted while the learner waits for a batch. ~3 s. The same path on real SGLang and
megatron learners: tests/test_trainer_failover.py (the only server SIGKILLed mid-run)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from areal_mega.config import from_dict
from areal_mega.inference import InferenceConfig
from tests.support.fake_sglang import FakeSGLang, serve
from areal_mega.rollout.config import RolloutConfig
from areal_mega.rollout.driver import RolloutDriver
from tests.test_rl_rollout import GroupWorkflow, dataset

pytestmark = pytest.mark.timeout(60)


def test_next_batch_asks_for_a_resync_when_every_server_waits_for_weights():
    """The only server comes back with old weights while no batch is ready: the pool parks it
    until a weight sync includes it, and the sync only comes after the next batch -- a
    deadlock unless next_batch hands back None (the learner then syncs). After the sync the
    same batch wait completes, with tokens of the current version."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    on_fake_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(10)  # noqa: E731
    fake = FakeSGLang()
    runner, port = on_fake_loop(serve(fake))
    driver = RolloutDriver(from_dict(InferenceConfig, {
        "addresses": [f"127.0.0.1:{port}"], "client": {"health_check_interval_s": 0.1}}))
    ex = concurrent.futures.ThreadPoolExecutor(1)
    try:
        driver.start_rollout(GroupWorkflow(), dataset(), RolloutConfig(batch_size=2, max_staleness=0,
                                                                         show_progress=False), version=0)
        assert driver.next_batch().version == 0
        fake.hold_until = 10**6  # generation stalls: no batch can be ready for a while
        fake.weight_version = "1"  # the sync to version 1
        driver.set_version(1)
        # The server restarts: it answers again, with the initial weights.
        fake.weight_version = "0"
        h = driver.pool.servers[0]
        driver.run(_mark_down(driver, h))
        got = ex.submit(driver.next_batch).result(timeout=10)  # blocked forever before the fix
        assert got is None and not h.healthy and h.address in driver._awaiting
        # The learner's resync, in Trainer.sync_weights' order: pause, pick the targets, push
        # version 1, release the parked server, resume. The server rejoins while the pool
        # resumes; it must not be left paused (it was, before the pause lock).
        driver.pause()
        fake.weight_version = "1"
        assert driver.sync_targets(wait_s=0) == [h.url]
        driver.release_resynced([h.url])
        driver.set_version(1)
        driver.resume()
        fake.hold_until = 0
        loop.call_soon_threadsafe(fake._round_full.set)  # let the held requests finish
        batch = ex.submit(driver.next_batch).result(timeout=10)
        assert batch is not None and batch.version == 1 and h.healthy and fake._resumed.is_set()
        versions = [v for g in batch.groups for t in g for v in t.versions if v >= 0]
        assert versions and set(versions) == {1}
    finally:
        ex.shutdown(wait=False)
        driver.close()
        on_fake_loop(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)


async def _mark_down(driver: RolloutDriver, h) -> None:
    driver.pool._mark_down(h, "test: server restarted")
