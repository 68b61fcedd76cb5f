"""Async client for a pool of SGLang servers: the ``InferenceEngine`` the rollout side uses.

    workflows --agenerate(req)--> InferencePool --POST /generate--> server with least in-flight
        ^                              |  abort (pause / weight update): wait, resubmit prompt + tokens so far
        |                              |  connection error / 5xx / timeout: mark down, retry elsewhere
        +------ GenerationResult <-----+
                                   health monitor --> restart (managed) --> resync(server) --> rotation

Invariants: one result per ``agenerate`` (or a raise after ``max_retries``); ``output_versions[i]``
is the weight version that sampled token i; a restarted server takes traffic only after
``resync``. Every call is built by ``inference.sglang_api``. More: docs/inference.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Awaitable, Callable, Sequence

import aiohttp
import numpy as np

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.generation import PolicyVersion
from areal_mega.api.io import GenerationRequest, GenerationResult, SamplingParams
from areal_mega.inference import sglang_api as api
from areal_mega.inference.config import InferenceConfig
from areal_mega.inference.server import SGLangServer, ServedLora, make_servers

logger = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    """A request could not be completed (all retries failed, or no server is healthy)."""


# A server's non-2xx answer: one error type for the pool and weight sync.
InferenceServerError = api.SGLangError


class _ServerFailure(Exception):
    """Internal: the server itself failed (unreachable, 5xx, timeout) -- retry elsewhere.

    ``connection`` marks a failure of the connection only (reset, closed before the answer):
    the server may be fine, so the pool asks it before taking it out of rotation."""

    def __init__(self, message: str, *, connection: bool = False) -> None:
        super().__init__(message)
        self.connection = connection


def _connection_dropped(e: BaseException) -> bool:
    """A connection that broke after it was opened (reset, closed before the answer): says little
    about the server, unlike a refused connect (ClientConnectorError) or a timeout."""
    broke = isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                           aiohttp.ClientPayloadError, ConnectionResetError))
    return broke and not isinstance(e, aiohttp.ClientConnectorError)


class ServerHandle:
    """One SGLang server as the pool sees it: address, rotation state and load, and ``send`` for
    the calls ``sglang_api`` builds.

    ``process`` is the managed ``SGLangServer`` (None for servers started by someone else, which
    the pool can route around but not restart).
    """

    def __init__(self, index: int, address: str, process: SGLangServer | None = None) -> None:
        self.index = index
        self.address = address
        self.url = f"http://{address}"
        self.process = process
        self.healthy = False
        self.in_flight = 0
        self.num_restarts = 0
        self.num_failures = 0
        self.num_served = 0  # /generate calls answered (including interrupted ones)
        self.health_failures = 0  # consecutive failed health checks while in rotation
        self.capabilities: api.ServerCapabilities | None = None
        self._api_key: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._headers: dict[str, str] = {}
        self._json_headers: dict[str, str] = {}
        self._control_timeout = aiohttp.ClientTimeout(total=600)
        self._health_timeout = aiohttp.ClientTimeout(total=5)
        self._recovery: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"ServerHandle({self.index}, {self.address}, healthy={self.healthy}, in_flight={self.in_flight})"

    # -- plumbing -----------------------------------------------------------------------------
    def _bind(self, session: aiohttp.ClientSession, headers: dict[str, str],
              control_timeout_s: float, health_timeout_s: float, api_key: str | None) -> None:
        self._session = session
        self._api_key = api_key
        self._headers = headers
        self._json_headers = {**headers, "Content-Type": "application/json"}
        self._control_timeout = aiohttp.ClientTimeout(total=control_timeout_s)
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)

    async def send(self, call: api.Call, timeout: aiohttp.ClientTimeout | None = None) -> Any:
        """One call from ``sglang_api``; JSON in, JSON (or text) out. Raises InferenceServerError
        on a non-2xx status."""
        assert self._session is not None, "pool not started"
        data = None if call.body is None else json.dumps(call.body)
        headers = self._json_headers if data is not None else self._headers
        async with self._session.request(call.method, self.url + call.path, data=data, headers=headers,
                                         timeout=timeout or self._control_timeout) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise InferenceServerError(self.url, call.path, resp.status, text)
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    async def health_ok(self, paused: bool = False) -> bool:
        """True if the server answers. SGLang's /health runs a one-token generation: it cannot
        finish while the server is paused, and behind a long batch on a busy CPU server it can
        outlast any timeout while the server is fine (such a server was once taken out of
        rotation mid-run, tests/test_inference_client.py). So a paused server, or one with
        requests of ours in flight (their own progress and ``request_timeout_s`` judge the
        scheduler), is asked /model_info, which the HTTP front end answers by itself."""
        probe = api.model_info() if paused or self.in_flight > 0 else api.health()
        try:
            await self.send(probe, timeout=self._health_timeout)
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, InferenceServerError, OSError):
            return False

    async def detect_capabilities(self) -> api.ServerCapabilities:
        """``sglang_api``'s one detection, run in a thread (it is blocking)."""
        client = api.SGLangClient(self.url, timeout_s=self._control_timeout.total or 600, api_key=self._api_key)
        self.capabilities = await asyncio.to_thread(client.capabilities)
        return self.capabilities

    async def get_weight_version(self) -> str:
        """The server's current weight_version string (0.5.23 has no /get_weight_version)."""
        return str((await self.send(api.model_info()))["weight_version"])


ResyncHook = Callable[[ServerHandle], Awaitable[None]]


class InferencePool(InferenceEngine):
    """N SGLang servers behind one ``agenerate``. See the module docstring for the dataflow.

    Use ``pool = await InferencePool.launch(cfg)`` (starts servers; ``close()`` stops them) or
    ``InferencePool(cfg, servers_or_addresses)`` + ``await pool.start()``.

    ``resync`` (given at construction by whoever owns the weights: the rollout service) brings a
    server that rejoins with weights older than ``version`` up to date before it takes traffic
    again. Without one, the pool reloads its last ``update_weights_from_disk`` checkpoint, if
    any (a restart already loads the initial model under ``client.initial_version``).
    ``version`` is the counter the pool reads (the rollout service's :class:`PolicyVersion`,
    shared with the staleness manager); default: a counter of its own.
    """

    def __init__(self, cfg: InferenceConfig, servers: Sequence[SGLangServer | str] = (),
                 *, own_servers: bool = False, version: PolicyVersion | None = None,
                 resync: ResyncHook | None = None, capture_routes: bool = False,
                 lora: ServedLora | None = None) -> None:
        self.cfg = cfg
        ccfg = cfg.client
        # MoE routing replay: every /generate asks for the experts of each token (GenerationResult.routes).
        self.capture_routes = capture_routes
        # weight_sync.lora adapter: every /generate runs with the adapter the weight sync loads.
        self.lora = lora
        if not servers:
            servers = list(cfg.addresses)
        if not servers:
            raise ValueError("addresses: no servers given (launch them with InferencePool.launch)")
        self.servers: list[ServerHandle] = [
            ServerHandle(i, s.address, s) if isinstance(s, SGLangServer) else ServerHandle(i, s)
            for i, s in enumerate(servers)
        ]
        self._resync = resync
        self._own_servers = own_servers
        self.version = version if version is not None else PolicyVersion(ccfg.initial_version)
        self._last_disk_update: tuple[str, int] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._monitor_task: asyncio.Task | None = None
        self._resumed = asyncio.Event()   # set <=> not paused; agenerate waits on it
        self._resumed.set()
        # Held while the pause state changes on the servers (pause/resume) or a server rejoins in
        # that state: a server rejoining during a resume would otherwise stay paused for good.
        self._pause_lock = asyncio.Lock()
        self._membership = asyncio.Event()  # pulsed when a server (re)joins the rotation
        self._generate_timeout = aiohttp.ClientTimeout(total=ccfg.request_timeout_s,
                                                       sock_connect=ccfg.connect_timeout_s)
        # Counters that benchmarks and tests read
        self.num_submitted = 0
        self.num_completed = 0
        self.num_interruptions = 0
        self.num_failovers = 0
        self.num_segments = 0  # /generate calls that ended at client.segment_tokens and continued
        # Per request in flight (rid -> its token lists so far), read by checkpoints (partial()).
        self._partial: dict[str, tuple[list[int], list[float], list[int]]] = {}
        self._calls = 0  # /generate calls awaiting their answer
        self._no_calls = asyncio.Event()
        self._no_calls.set()

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    async def launch(cls, cfg: InferenceConfig, *, version: PolicyVersion | None = None,
                     resync: ResyncHook | None = None, capture_routes: bool = False,
                     lora: ServedLora | None = None) -> "InferencePool":
        """Start ``cfg.num_servers`` SGLang servers (in parallel) and a pool that owns them, or
        connect to ``cfg.addresses`` when set. ``capture_routes``: the servers record MoE routes;
        ``lora``: they serve LoRA adapters and every request names ``lora.name``
        (``build_launch_command``)."""
        if cfg.addresses:
            pool = cls(cfg, cfg.addresses, version=version, resync=resync, capture_routes=capture_routes, lora=lora)
            await pool.start()
            return pool
        servers = make_servers(cfg, capture_routes=capture_routes, lora=lora)
        pool = cls(cfg, servers, own_servers=True, version=version, resync=resync, capture_routes=capture_routes,
                   lora=lora)
        try:
            for s in servers:
                s.start(weight_version=cfg.client.initial_version)
            # Waiting happens in threads; if this coroutine is cancelled (e.g. by a timeout), the
            # except below stops the processes, and the waiting threads then end on their own.
            await asyncio.gather(*(asyncio.to_thread(s.wait_ready) for s in servers))
            await pool.start()
        except BaseException:
            await pool.close()
            raise
        return pool

    async def start(self) -> None:
        """Open the HTTP session, check every server once, detect capabilities, start the monitor."""
        ccfg = self.cfg.client
        # Idle connections are dropped before the server's own keep-alive timeout (uvicorn: 5 s)
        # can close them: reusing one the server is closing at that moment fails the request.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=ccfg.max_connections_per_server,
                                         keepalive_timeout=ccfg.keepalive_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector)
        key = self.cfg.resolved_api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for h in self.servers:
            h._bind(self._session, headers, ccfg.control_timeout_s, ccfg.health_check_timeout_s, key)

        async def first_contact(h: ServerHandle) -> None:
            if not await h.health_ok():
                raise InferenceError(f"server {h.address} is not healthy at pool start")
            await h.detect_capabilities()
            h.healthy = True

        await asyncio.gather(*(first_contact(h) for h in self.servers))
        self._monitor_task = asyncio.create_task(self._monitor(), name="inference-pool-monitor")

    async def close(self) -> None:
        """Stop the monitor and recoveries, close the session, stop servers the pool launched."""
        tasks = [t for t in [self._monitor_task] + [h._recovery for h in self.servers] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._own_servers:
            await asyncio.gather(*(asyncio.to_thread(h.process.close) for h in self.servers if h.process))

    async def __aenter__(self) -> "InferencePool":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- InferenceEngine ------------------------------------------------------------------------
    def get_version(self) -> int:
        return self.version.get()

    def set_version(self, version: int) -> None:
        """Record the policy version the servers now hold (whoever pushed weights tagged with
        ``version``: the rollout service after a weight sync). Rejoining servers are resynced to it."""
        self.version.set(version)

    def healthy_servers(self) -> list[ServerHandle]:
        """Servers in rotation now (the ones a weight update must reach)."""
        return [h for h in self.servers if h.healthy]

    @property
    def urls(self) -> list[str]:
        return [h.url for h in self.servers]

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause(self, mode: str | None = None) -> None:
        """Stop generation on every server, per ``mode`` (default ``client.pause_mode``). In abort
        mode the servers return in-flight requests at once; ``agenerate`` holds them (and new
        ones) until resume(). A checkpoint pauses in abort mode whatever the setting: each
        request then holds every token it has (``partial``)."""
        async with self._pause_lock:
            self._resumed.clear()  # first, so that aborted requests see the pause and wait
            await self._on_all(lambda h: h.send(api.pause_generation(mode or self.cfg.client.pause_mode)))

    async def resume(self) -> None:
        async with self._pause_lock:
            await self._on_all(lambda h: h.send(api.continue_generation()))
            self._resumed.set()

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Load an HF checkpoint on every healthy server, tagged ``version``; remembered for the
        default resync of restarted servers."""
        await self._on_all(lambda h: h.send(api.update_weights_from_disk(model_path, version)))
        self._last_disk_update = (model_path, version)
        self.version.set(version)

    @property
    def capabilities(self) -> api.ServerCapabilities:
        """Capabilities of the pool's servers (all run the same SGLang)."""
        caps = [h.capabilities for h in self.servers if h.capabilities is not None]
        assert caps, "pool not started"
        return caps[0]

    def partial(self, rid: str) -> tuple[list[int], list[float], list[int]] | None:
        """The tokens, behaviour log-probs and versions request ``rid`` holds so far (None when
        it is not in flight): what a checkpoint saves of it. Loop thread only."""
        got = self._partial.get(rid)
        return None if got is None else (list(got[0]), list(got[1]), list(got[2]))

    async def settle(self, timeout_s: float | None = None) -> bool:
        """After ``pause()`` in abort mode: wait (at most ``timeout_s``, default
        ``client.health_check_timeout_s``: an abort is answered as fast as a health check) until
        every /generate call has returned its partial tokens to its request, so ``partial`` is
        complete. False after the timeout (a hung server, or a retract / in_place pause holding
        the calls): ``partial`` is then still consistent, only without the tokens still out."""
        try:
            await asyncio.wait_for(self._no_calls.wait(), timeout_s or self.cfg.client.health_check_timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def agenerate(self, req: GenerationRequest) -> GenerationResult:
        req.sampling.validate()
        if not req.input_ids:
            raise ValueError("input_ids: empty prompt")
        if req.rid is None:
            req.rid = uuid.uuid4().hex
        t0 = time.monotonic()
        sampling = _sampling_dict(req.sampling)
        max_new = req.sampling.max_new_tokens
        prefix = req.prefix  # a resumed request: its saved tokens come first, generation continues after them
        out_ids: list[int] = list(prefix.output_ids) if prefix else []
        out_lps: list[float] = list(prefix.output_logprobs) if prefix else []
        out_vers: list[int] = list(prefix.output_versions) if prefix else []
        if len(out_ids) >= max_new:
            raise ValueError(f"prefix: {len(out_ids)} tokens already, max_new_tokens={max_new}")
        self._partial[req.rid] = (out_ids, out_lps, out_vers)
        try:
            return await self._generate(req, sampling, max_new, out_ids, out_lps, out_vers, t0)
        finally:
            self._partial.pop(req.rid, None)

    async def _generate(self, req: GenerationRequest, sampling: dict[str, Any], max_new: int, out_ids: list[int],
                        out_lps: list[float], out_vers: list[int], t0: float) -> GenerationResult:
        ccfg = self.cfg.client
        routes = None  # rows [len(input) + len(out) - 1, layers * top_k]; first call covering a row wins
        num_interruptions = num_failures = attempt = 0
        self.num_submitted += 1
        while True:
            await self._resumed.wait()
            handle = await self._pick()
            asked = max_new - len(out_ids)
            if ccfg.segment_tokens:
                asked = min(asked, ccfg.segment_tokens)
            sampling["max_new_tokens"] = asked
            call = api.generate(req.input_ids + out_ids, sampling, rid=f"{req.rid}-{attempt}",
                                return_routes=self.capture_routes,
                                lora=self.lora.name if self.lora is not None else None)
            attempt += 1
            handle.in_flight += 1
            self._calls += 1
            self._no_calls.clear()
            try:
                data = await self._post_generate(handle, call)
            except _ServerFailure as e:
                num_failures += 1
                self.num_failovers += 1
                # A dropped connection to a server whose front end still answers is a transport
                # hiccup, not a dead server: retry (on the least-loaded server, maybe the same)
                # without taking it out of rotation -- with a single server that would stall
                # generation and weight sync until the health monitor let it back in.
                if not (e.connection and await handle.health_ok(paused=True)):
                    self._mark_down(handle, str(e))
                if num_failures > ccfg.max_retries:
                    raise InferenceError(
                        f"request {req.rid}: {num_failures} server failures (client.max_retries="
                        f"{ccfg.max_retries}); last: {e}") from None
                await asyncio.sleep(ccfg.retry_backoff_s * 2 ** (num_failures - 1))
                continue
            finally:
                handle.in_flight -= 1
                self._calls -= 1
                if not self._calls:
                    self._no_calls.set()
            handle.num_served += 1
            ids, lps, vers, finish = self._parse(data, handle)
            out_ids += ids
            out_lps += lps
            out_vers += vers
            if self.capture_routes:
                rows = len(req.input_ids) + len(out_ids) - 1
                new = api.decode_routes(data["meta_info"], rows) if rows > 0 else None
                routes = new if routes is None else np.concatenate([routes, new[len(routes):]])
            if finish == "length" and len(ids) == asked and len(out_ids) < max_new:
                self.num_segments += 1  # a segment ended (client.segment_tokens): continue the request
                continue
            if finish != "abort":
                break
            num_interruptions += 1
            if len(out_ids) >= max_new:
                finish = "length"
                break
            if not ids and not self.paused:
                # Aborted before producing anything and not by our pause: a server-side abort
                # (e.g. a weight update with abort_all_requests). Bounded like a failure.
                num_failures += 1
                if num_failures > ccfg.max_retries:
                    raise InferenceError(f"request {req.rid}: aborted {num_failures} times without progress")
        self.num_completed += 1
        self.num_interruptions += num_interruptions
        return GenerationResult(
            input_ids=req.input_ids, output_ids=out_ids, output_logprobs=out_lps,
            output_versions=out_vers, finish_reason=finish, rid=req.rid,
            num_interruptions=num_interruptions, latency_s=time.monotonic() - t0, routes=routes,
        )

    # -- internals ------------------------------------------------------------------------------
    async def _post_generate(self, h: ServerHandle, call: api.Call) -> dict:
        assert self._session is not None, "pool not started (call start() or use launch())"
        try:
            async with self._session.post(h.url + call.path, data=json.dumps(call.body), headers=h._json_headers,
                                          timeout=self._generate_timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, OSError) as e:
            raise _ServerFailure(f"{h.address}: {type(e).__name__}: {e}", connection=_connection_dropped(e)) from None
        if status >= 500:
            raise _ServerFailure(f"{h.address}: HTTP {status}: {raw[:300]!r}")
        if status >= 300:
            # 4xx is our request's fault (bad sampling key, prompt too long, missing API key):
            # retrying elsewhere would fail the same way.
            raise InferenceServerError(h.url, call.path, status, raw.decode(errors="replace"))
        return json.loads(raw)

    def _parse(self, data: dict, h: ServerHandle) -> tuple[list[int], list[float], list[int], str]:
        ids = list(data["output_ids"])
        meta = data["meta_info"]
        n = len(ids)
        lp_triples = meta.get("output_token_logprobs") or []
        if len(lp_triples) < n or any(t[0] is None for t in lp_triples[:n]):
            # Behaviour log-probs feed the importance weights: a filled-in value (0.0 = prob 1)
            # would bias every weight of the sequence. Never guess.
            raise InferenceError(
                f"{h.url}/generate: {n} tokens but {sum(t[0] is not None for t in lp_triples[:n])} log-probs "
                "(return_logprob was sent; the server must return one per generated token)")
        lps = [float(t[0]) for t in lp_triples[:n]]
        fallback = self._parse_version(meta.get("weight_version"))
        vers = [fallback] * n
        for span in meta.get("weight_versions") or []:
            v = self._parse_version(span["version"])
            for i in range(span["start"], min(span["end"], n)):
                vers[i] = v
        finish = meta["finish_reason"]["type"] if isinstance(meta.get("finish_reason"), dict) else "stop"
        return ids, lps, vers, finish

    def _parse_version(self, v: Any) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            # An external server launched without --weight-version reports "default".
            return self.cfg.client.initial_version

    async def _pick(self) -> ServerHandle:
        """The healthy server with the fewest requests in flight (waits if none is healthy)."""
        deadline = time.monotonic() + self.cfg.client.request_timeout_s
        while True:
            best = None
            for h in self.servers:
                if h.healthy and (best is None or h.in_flight < best.in_flight):
                    best = h
            if best is not None:
                return best
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceError("no healthy inference server (all down or restarting)")
            self._membership.clear()
            try:
                await asyncio.wait_for(self._membership.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    async def _on_all(self, fn: Callable[[ServerHandle], Awaitable[Any]]) -> None:
        """Run a control call on every healthy server concurrently. A server that fails at the
        transport level is marked down (its recovery resyncs it); HTTP errors propagate."""
        healthy = [h for h in self.servers if h.healthy]
        results = await asyncio.gather(*(self._control(fn, h) for h in healthy), return_exceptions=True)
        for h, r in zip(healthy, results):
            if isinstance(r, (aiohttp.ClientError, asyncio.TimeoutError, OSError)):
                self._mark_down(h, f"{type(r).__name__}: {r}")
            elif isinstance(r, BaseException):
                raise r

    async def _control(self, fn: Callable[[ServerHandle], Awaitable[Any]], h: ServerHandle) -> Any:
        """``fn(h)``, once more if the connection dropped but the server still answers (as in
        agenerate); control calls are idempotent (pause, continue, load weights)."""
        try:
            return await fn(h)
        except (aiohttp.ClientError, OSError) as e:
            if not (_connection_dropped(e) and await h.health_ok(paused=True)):
                raise
            return await fn(h)

    def _mark_down(self, h: ServerHandle, reason: str) -> None:
        if h.healthy:
            logger.warning("inference server %s marked down: %s", h.address, reason)
            h.healthy = False
            h.num_failures += 1
        if h._recovery is None:
            h._recovery = asyncio.create_task(self._recover(h), name=f"recover-{h.address}")

    async def _recover(self, h: ServerHandle) -> None:
        """Bring ``h`` back: it may have been a transient failure (it answers again), else restart
        it if the pool manages it. Either way it rejoins only after ``_rejoin`` (resync)."""
        ccfg = self.cfg.client
        try:
            alive = h.process is None or h.process.is_running()
            if alive:
                # Give a loaded-but-alive server a few chances before restarting it.
                for _ in range(3):
                    if await h.health_ok(paused=self.paused):
                        await self._rejoin(h)
                        return
                    await asyncio.sleep(ccfg.health_check_interval_s)
                if h.process is not None and await h.health_ok(paused=True):
                    # The HTTP front end answers but /health does not (paused by someone else, or
                    # overloaded): not dead, so no restart. A truly stuck scheduler is killed by
                    # SGLang's own watchdog, and then the exited process is restarted.
                    return
            if h.process is None or not ccfg.restart_dead_servers or h.num_restarts >= ccfg.max_restarts:
                return  # stays out; the monitor retries the health check
            h.num_restarts += 1
            logger.warning("restarting inference server %s (restart #%d)", h.address, h.num_restarts)
            await asyncio.to_thread(h.process.restart, ccfg.initial_version)
            await self._rejoin(h)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("recovery of inference server %s failed", h.address)
        finally:
            h._recovery = None

    async def _rejoin(self, h: ServerHandle) -> None:
        await h.detect_capabilities()
        if self._parse_version(await h.get_weight_version()) != self.version.get():
            await (self._resync or self._default_resync)(h)
        async with self._pause_lock:
            if self.paused:
                await h.send(api.pause_generation(self.cfg.client.pause_mode))
            h.healthy = True
            h.health_failures = 0
        self._membership.set()
        logger.warning("inference server %s back in rotation", h.address)

    async def _default_resync(self, h: ServerHandle) -> None:
        if self._last_disk_update is not None:
            path, version = self._last_disk_update
            await h.send(api.update_weights_from_disk(path, version))
        else:
            logger.warning(
                "server %s restarted with the initial weights (version %d) while the pool is at "
                "version %d and no resync hook is set: its tokens carry the old version",
                h.address, self.cfg.client.initial_version, self.version.get())

    async def check_health(self) -> None:
        """One health pass, now: servers that exited or do not answer leave the rotation and are
        recovered (restarted if the pool launched them, then resynced). The monitor runs this
        every ``client.health_check_interval_s``; weight sync runs it to pick its targets."""
        candidates = [h for h in self.servers if h._recovery is None]
        for h in candidates:
            if h.process is not None and not h.process.is_running() and h.healthy:
                self._mark_down(h, "server process exited")
        candidates = [h for h in candidates if h._recovery is None]
        oks = list(await asyncio.gather(*(h.health_ok(paused=self.paused) for h in candidates)))
        if self.paused:
            # A /health check that began before a pause cannot finish during it (it runs a
            # one-token generation): ask those servers again the paused way before judging them.
            oks = [ok or await h.health_ok(paused=True) for h, ok in zip(candidates, oks)]
        for h, ok in zip(candidates, oks):
            if not h.healthy:  # a down one worth another try
                self._mark_down(h, "health check failed")
            elif ok:
                h.health_failures = 0
            else:
                # Out of rotation only after client.health_check_failures misses in a row: one
                # slow answer on a loaded machine is not a dead server.
                h.health_failures += 1
                if h.health_failures >= self.cfg.client.health_check_failures:
                    self._mark_down(h, f"health check failed {h.health_failures} times in a row "
                                       f"(client.health_check_timeout_s={self.cfg.client.health_check_timeout_s:g})")

    async def _monitor(self) -> None:
        interval = self.cfg.client.health_check_interval_s
        while True:
            await asyncio.sleep(interval)
            await self.check_health()


def _sampling_dict(sp: SamplingParams) -> dict[str, Any]:
    """SamplingParams -> SGLang sampling_params (unknown keys make SGLang answer 400)."""
    d: dict[str, Any] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                         "max_new_tokens": sp.max_new_tokens}
    if sp.stop_token_ids:
        d["stop_token_ids"] = list(sp.stop_token_ids)
    return d
