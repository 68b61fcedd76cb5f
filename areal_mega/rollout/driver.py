"""The generation side of the trainer, living on learner rank 0.

    rank 0 main thread (trainer loop)          driver thread (one asyncio loop)
    ─────────────────────────────────          ─────────────────────────────────────
    driver.next_batch()  ── aget_batch ─────>  RolloutController ── workflow.arun_episode ──> InferencePool ──> SGLang
    driver.set_version(v) ─ set_version ────>  (admission by the staleness bound; never waits for training)
    driver.evaluate(...) ── coroutine ──────>  evaluate_items: greedy episodes over a held-out set

Generation runs continuously in the driver thread while the learner trains; the trainer
only blocks in ``next_batch`` when no admissible batch is ready yet. aiohttp sessions are
bound to the loop that made them, so the pool and the controller are both created in, and
only touched from, the driver's loop.

Failover and weights: a server that dies drops out of rotation (the pool resubmits its
requests elsewhere) and out of weight sync (``sync_targets``). When it answers again -- restarted
by the pool, or by whoever runs it -- it still holds old weights, so the pool's ``resync`` hook
parks it until the trainer's next weight sync has included it (``release_resynced``); only then
does it take traffic again, so no token is ever sampled by weights older than its label.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Awaitable, Iterable, TypeVar

from areal_mega.api.workflow import RolloutWorkflow
from areal_mega.inference.client import InferencePool
from areal_mega.inference.config import InferenceConfig
from areal_mega.rollout.config import RolloutConfig
from areal_mega.rollout.controller import RolloutBatch, RolloutController

T = TypeVar("T")
logger = logging.getLogger(__name__)


class RolloutDriver:
    def __init__(self, inference: InferenceConfig, *, capture_routes: bool = False) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-driver", daemon=True)
        self._thread.start()
        self.pool: InferencePool = self.run(InferencePool.launch(inference, capture_routes=capture_routes))
        self.pool.resync = self._await_next_sync
        self.controller: RolloutController | None = None
        self._awaiting: dict[str, asyncio.Event] = {}  # server address -> set once it has weights
        self._batch_task: asyncio.Future | None = None  # the batch next_batch is waiting for

    @property
    def server_urls(self) -> list[str]:
        return [h.url for h in self.pool.servers]

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the driver's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def start_rollout(self, workflow: RolloutWorkflow, dataset: Iterable[dict[str, Any]],
                      cfg: RolloutConfig, version: int) -> None:
        """Begin generating (at policy ``version``, which the servers must already hold)."""
        self.pool.set_version(version)

        async def start() -> RolloutController:
            c = RolloutController(self.pool, workflow, dataset, cfg, version=version)
            await c.astart()
            return c

        self.controller = self.run(start())

    def prompt_state(self) -> dict[str, Any]:
        """The prompt stream's ``state_dict`` with the prompts drawn but not yet in a batch given
        back -- taken on the controller's loop, the only thread that draws prompts, so no prompt
        is drawn between the two reads (it would be lost on resume)."""
        assert self.controller is not None, "start_rollout() first"
        c = self.controller

        async def get() -> dict[str, Any]:
            return c.dataset.state_dict(c.in_flight_positions())

        return self.run(get())

    def next_batch(self) -> RolloutBatch | None:
        """The next rollout batch, or None when none can come before a weight sync: no server
        is in rotation and those that answer are parked waiting for the current weights (the
        whole pool restarted). The caller syncs the current version and asks again; the batch
        being formed is kept, not lost."""
        assert self.controller is not None, "start_rollout() first"
        controller = self.controller

        async def get() -> RolloutBatch | None:
            if self._batch_task is None:
                self._batch_task = asyncio.ensure_future(controller.aget_batch())
            while not self._batch_task.done():
                if self._awaiting and not any(h.healthy for h in self.pool.servers):
                    return None
                await asyncio.wait({self._batch_task}, timeout=self.pool.cfg.client.health_check_interval_s)
            task, self._batch_task = self._batch_task, None
            return task.result()

        return self.run(get())

    async def _await_next_sync(self, handle: Any) -> None:
        event = self._awaiting.setdefault(handle.address, asyncio.Event())
        await event.wait()

    def sync_targets(self, wait_s: float) -> list[str]:
        """URLs the next weight sync must reach: servers in rotation plus those parked by
        ``_await_next_sync``; dead or still-restarting servers are left out. With none live
        (the only server recovering from a dropped connection, or restarting), wait up to
        ``wait_s`` for one rather than failing the run; [] after that."""

        async def targets() -> list[str]:
            deadline = time.monotonic() + wait_s
            warned = False
            while True:
                await self.pool.check_health()  # a server that died since the last pass drops out now
                urls = [h.url for h in self.pool.servers if h.healthy or h.address in self._awaiting]
                if urls or time.monotonic() >= deadline:
                    return urls
                if not warned:
                    logger.warning("weight sync: no live inference server; waiting up to %g s for one", wait_s)
                    warned = True
                await asyncio.sleep(self.pool.cfg.client.health_check_interval_s)

        return self.run(targets())

    def pause(self) -> None:
        """Pause generation on every server through the pool (in ``client.pause_mode``), so the
        pool treats the servers as paused, not dead; in-flight requests are held or resumed later."""
        self.run(self.pool.pause())

    def resume(self) -> None:
        self.run(self.pool.resume())

    def pool_stats(self) -> dict[str, float]:
        p = self.pool
        return {"inference/servers_in_rotation": float(sum(h.healthy for h in p.servers)),
                "inference/failovers": float(p.num_failovers), "inference/interruptions": float(p.num_interruptions)}

    def release_resynced(self, synced_urls: list[str]) -> None:
        """After a weight sync to ``synced_urls``: the parked servers among them now hold the
        current weights; let them rejoin. A server parked after the targets were taken stays
        parked until the next sync includes it."""

        async def release() -> None:
            for h in self.pool.servers:
                if h.url in synced_urls and h.address in self._awaiting:
                    self._awaiting.pop(h.address).set()

        self.run(release())

    def set_version(self, version: int) -> None:
        """Called after the servers hold weights of ``version``: admission moves on."""
        self.pool.set_version(version)
        if self.controller is not None:
            self.controller.set_version(version)

    def evaluate(self, greedy: RolloutWorkflow, dataset: list[dict[str, Any]], spec: Any = None,
                 sampled: RolloutWorkflow | None = None) -> dict[str, float]:
        """The summary of ``areal_mega.evaluation.evaluate_items`` (greedy accuracy, its binomial
        SE, mean reward; pass@k with ``sampled``) over ``dataset`` at the current weights. Runs
        beside training rollouts (they share the servers)."""
        from areal_mega.evaluation import EvalSpec, evaluate_items

        summary, _ = self.run(evaluate_items(self.pool, greedy, dataset, spec or EvalSpec(), sampled))
        return summary

    def close(self) -> None:
        async def shutdown() -> None:
            if self._batch_task is not None:
                self._batch_task.cancel()
            if self.controller is not None:
                await self.controller.aclose()
            await self.pool.close()

        try:
            self.run(shutdown(), timeout=180)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
