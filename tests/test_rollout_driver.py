"""RolloutService (the trainer's generation side, ``areal_mega/rollout/service.py``) against
in-process fake SGLang servers (areal_mega/inference/fake_server.py): its interface (next batch, begin
update -> targets, end update(version, synced), close), the one version counter, and the case the
e2e failover test cannot force: the whole pool restarted while the learner waits for a batch.
~5 s. The same paths on real SGLang and megatron learners: tests/test_trainer_failover.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from areal_mega.config import from_dict
from areal_mega.inference import InferenceConfig
from areal_mega.rollout.config import RolloutConfig
from areal_mega.rollout.service import RolloutService
from areal_mega.inference.fake_server import FakeSGLang, serve
from tests.test_rl_rollout import GroupWorkflow, dataset

pytestmark = pytest.mark.timeout(60)


class Fakes:
    """Fake servers on a loop of their own (the service's pool talks to them over HTTP)."""

    def __init__(self, n: int) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.fakes = [FakeSGLang() for _ in range(n)]
        self.runners, self.ports = zip(*[self.run(serve(f)) for f in self.fakes])

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def service(self) -> RolloutService:
        return RolloutService(from_dict(InferenceConfig, {
            "addresses": [f"127.0.0.1:{p}" for p in self.ports], "client": {"health_check_interval_s": 0.1}}),
            server_wait_s=0)

    def close(self) -> None:
        for r in self.runners:
            self.run(r.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)


def _mark_down(svc: RolloutService, i: int) -> None:
    """A server restarted behind the pool's back: the pool finds it down, then back with old weights."""
    async def down() -> None:
        svc.pool._mark_down(svc.pool.servers[i], "test: server restarted")

    svc._run(down())


def _wait_parked(svc: RolloutService, url: str) -> None:
    async def wait() -> None:
        while url not in svc._parked:
            await asyncio.sleep(0.02)

    svc._run(asyncio.wait_for(wait(), 10))


def test_one_version_counter_and_update_cycle():
    """begin_update pauses and names the live servers; end_update(v) moves the ONE counter that
    the pool and the staleness manager read; end_update(None) (a failed sync) moves nothing and
    still resumes generation; batches admitted after the update carry the new version."""
    f = Fakes(2)
    svc = f.service()
    try:
        svc.start(GroupWorkflow(), dataset(), RolloutConfig(batch_size=2, max_staleness=0, show_progress=False))
        assert svc.next_batch().version == 0
        targets = svc.begin_update()
        assert targets == svc.pool.urls and all(fk.paused for fk in f.fakes)
        assert svc.begin_update() == targets  # a retry re-takes the targets, no second pause
        svc.end_update(None)  # failed sync: negative control, nothing moves
        assert svc.version == 0 and svc.pool.get_version() == 0 and svc.controller.staleness.version == 0
        assert not any(fk.paused for fk in f.fakes)
        svc.begin_update()
        for fk in f.fakes:
            fk.weight_version = "1"
        svc.end_update(1, targets)
        assert svc.version == svc.pool.get_version() == svc.controller.staleness.version == 1
        assert svc.pool.version is svc.controller.staleness.policy_version  # shared, not copied
        assert not any(fk.paused for fk in f.fakes)
        b = svc.next_batch()
        assert b.version == 1
        assert {v for g in b.groups for t in g for v in t.versions if v >= 0} == {1}
        with pytest.raises(ValueError, match="must not decrease"):
            svc.end_update(0, targets)
    finally:
        svc.close()
        f.close()


def test_parked_server_rejoins_only_after_a_sync_that_included_it():
    """A server back with old weights is parked: it is a target of the next update but takes no
    traffic until a sync naming it ends (a sync without it -- the negative control -- leaves it out)."""
    f = Fakes(2)
    svc = f.service()
    try:
        svc.start(GroupWorkflow(), dataset(), RolloutConfig(batch_size=2, max_staleness=1, show_progress=False))
        svc.next_batch()
        svc.begin_update()
        for fk in f.fakes:
            fk.weight_version = "1"
        svc.end_update(1, svc.pool.urls)
        f.fakes[1].weight_version = "0"  # server 1 restarts with the initial weights
        url = svc.pool.servers[1].url
        _mark_down(svc, 1)
        _wait_parked(svc, url)
        assert svc.pool.servers[1] not in svc.pool.healthy_servers()
        targets = svc.begin_update()
        assert url in targets
        svc.end_update(2, [u for u in targets if u != url])  # a sync that did not reach it
        assert url in svc._parked and svc.pool.servers[1] not in svc.pool.healthy_servers()
        svc.begin_update()
        f.fakes[1].weight_version = "2"
        svc.end_update(2, targets)
        svc._run(asyncio.wait_for(_until(lambda: svc.pool.servers[1] in svc.pool.healthy_servers()), 10))
        assert url not in svc._parked
    finally:
        svc.close()
        f.close()


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.02)


def test_next_batch_asks_for_a_resync_when_every_server_waits_for_weights():
    """The only server comes back with old weights while no batch is ready: the pool parks it
    until a weight sync includes it, and the sync only comes after the next batch -- a
    deadlock unless next_batch hands back None (the learner then syncs). After the sync the
    same batch wait completes, with tokens of the current version."""
    f = Fakes(1)
    fake = f.fakes[0]
    svc = f.service()
    ex = concurrent.futures.ThreadPoolExecutor(1)
    try:
        svc.start(GroupWorkflow(), dataset(), RolloutConfig(batch_size=2, max_staleness=0, show_progress=False))
        assert svc.next_batch().version == 0
        fake.hold_until = 10**6  # generation stalls: no batch can be ready for a while
        fake.weight_version = "1"  # the sync to version 1
        svc.begin_update()
        svc.end_update(1, svc.pool.urls)
        # The server restarts: it answers again, with the initial weights.
        fake.weight_version = "0"
        h = svc.pool.servers[0]
        _mark_down(svc, 0)
        got = ex.submit(svc.next_batch).result(timeout=10)  # blocked forever before the fix
        assert got is None and not h.healthy and h.url in svc._parked
        # The learner's resync, in Trainer.sync_weights' order: begin (pause, targets), push
        # version 1, end (release the parked server, resume). The server rejoins while the pool
        # resumes; it must not be left paused (it was, before the pause lock).
        targets = svc.begin_update()
        fake.weight_version = "1"
        assert targets == [h.url]
        svc.end_update(1, targets)
        fake.hold_until = 0
        f.loop.call_soon_threadsafe(fake._round_full.set)  # let the held requests finish
        batch = ex.submit(svc.next_batch).result(timeout=10)
        assert batch is not None and batch.version == 1 and h.healthy and fake._resumed.is_set()
        versions = [v for g in batch.groups for t in g for v in t.versions if v >= 0]
        assert versions and set(versions) == {1}
    finally:
        ex.shutdown(wait=False)
        svc.close()
        f.close()


class _RecordingSync:
    """Weight sync stand-in: records targets; fails the first ``fail`` syncs."""

    def __init__(self, fail: int = 0) -> None:
        self.fail, self.server_urls, self.calls = fail, [], []

    def set_targets(self, urls):
        self.server_urls = list(urls)

    def sync(self, version):
        from areal_mega.weight_sync.sync import SyncStats, WeightSyncError

        self.calls.append((version, list(self.server_urls)))
        if self.fail:
            self.fail -= 1
            raise WeightSyncError("test: a server died mid-sync")
        return SyncStats(version=version, bytes=0, seconds=0.0, num_buckets=0)

    def close(self):
        pass


def test_trainer_sync_weights_goes_through_the_service():
    """Trainer.sync_weights (world of one, gloo): targets come from begin_update, the version moves
    only after a sync succeeded (one retry after a WeightSyncError), a sync that fails twice moves
    nothing and still resumes generation."""
    import types

    import torch.distributed as dist

    from areal_mega.trainer.trainer import Trainer
    from areal_mega.utils.procs import free_port
    from areal_mega.weight_sync.sync import WeightSyncError

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    f = Fakes(2)
    svc = f.service()
    try:
        cfg = types.SimpleNamespace(weight_sync=types.SimpleNamespace(server_wait_s=0),
                                    trainer=types.SimpleNamespace(study_delay=0))
        ws = _RecordingSync(fail=1)
        t = Trainer(cfg=cfg, groups=types.SimpleNamespace(rank=0), actor=None, weight_sync=ws, advantage=None,
                    policy_loss=None, metrics=None,
                    ctrl_group=dist.group.WORLD, start_step=0, generation=svc)
        for fk in f.fakes:
            fk.weight_version = "1"
        t.sync_weights(version=1)
        assert ws.calls == [(1, svc.pool.urls), (1, svc.pool.urls)]  # the retry resent everything
        assert svc.version == 1 and not any(fk.paused for fk in f.fakes)
        ws.fail = 2
        with pytest.raises(WeightSyncError):
            t.sync_weights(version=2)
        assert svc.version == 1 and not any(fk.paused for fk in f.fakes)  # nothing moved, generation resumed
    finally:
        svc.close()
        f.close()
        dist.destroy_process_group()
