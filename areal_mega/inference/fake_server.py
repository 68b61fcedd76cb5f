"""A fake SGLang server (aiohttp) speaking the subset of the 0.5.23 HTTP API the pool uses.

For fast tests of client logic (and of rollout code) without SGLang, and for the client-overhead
benchmark. It is deterministic: for prompt ``p`` the k-th generated token is
``(sum(p) + 7 * k) % vocab_size`` with log-prob ``-0.01 * (k + 1)``, where k counts from the
start of the original prompt -- so a request resubmitted with ``prompt + tokens so far`` continues
the very same sequence, which is what makes interruption tests exact. Tokens are produced one per
``token_delay_s`` (0 = answer at once), and ``/pause_generation`` in abort mode returns in-flight
requests with their partial tokens, like SGLang.

The fake knows where the original prompt ends because every resubmission carries the same rid
prefix ``<rid>-<attempt>``; the first attempt registers the prompt length.

    python -m areal_mega.inference.fake_server --port 30000      # stand-alone, for benchmarks
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web


class FakeSGLang:
    def __init__(self, *, vocab_size: int = 512, token_delay_s: float = 0.0, api_key: str | None = None,
                 weight_version: str = "0", prompt_lengths: dict[str, int] | None = None) -> None:
        self.vocab_size = vocab_size
        self.token_delay_s = token_delay_s
        self.api_key = api_key
        self.weight_version = weight_version
        self.paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._abort = asyncio.Event()  # pulsed by pause(abort) to cut in-flight requests
        # Shared between fakes that stand for one pool, so a request failed over to another
        # fake still knows where its prompt ended.
        self._prompt_len: dict[str, int] = {} if prompt_lengths is None else prompt_lengths
        self.requests: list[dict] = []  # every /generate body received (tests inspect them)
        self.num_generate = 0
        self.num_tokens = 0  # generated so far, over all requests (tests wait on it: generated())
        self._token_waiters: list[tuple[int, asyncio.Future]] = []  # generated(): (count, future)
        self.fail_next = 0  # tests: answer the next N /generate calls with HTTP 503
        self.health_delay_s = 0.0  # tests: /health answers this late (a one-token generation behind a long batch)
        self.num_health = 0
        self.drop: dict[str, int] = {}  # tests: path -> close the connection of the next N calls unanswered
        # Benchmarks: hold /generate calls in rounds of ``hold_until`` -- none is answered before
        # the whole round has arrived, so that many are really in flight at once -- and record
        # when each round's last call arrived (wall clock).
        self.hold_until = 0
        self._round_count = 0
        self._round_full = asyncio.Event()
        self.t_round_arrived: list[float] = []

    async def generated(self, n: int) -> None:
        """Return once ``n`` tokens were generated in all (woken by the n-th token, no polling)."""
        if self.num_tokens < n:
            fut = asyncio.get_running_loop().create_future()
            self._token_waiters.append((n, fut))
            await fut

    def _wake(self, n: int, fut: asyncio.Future) -> bool:
        if self.num_tokens >= n and not fut.done():
            fut.set_result(None)
        return fut.done()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/update_weights_from_disk", self._update_from_disk)
        app.router.add_get("/fake_stats", self._stats)
        return app

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"num_generate": self.num_generate, "t_round_arrived": self.t_round_arrived})

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.drop.get(request.path, 0) > 0:
            # What a client sees when the server closes an idle keep-alive connection just as
            # a request is sent on it: the connection ends without an answer.
            self.drop[request.path] -= 1
            if request.path == "/generate":
                self.num_generate += 1
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.api_key and not request.path.startswith("/health"):
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        self.num_health += 1
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(status=503 if self.paused else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "weight_version": self.weight_version})

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23-fake"})

    async def _openapi(self, request: web.Request) -> web.Response:
        paths = {r.resource.canonical: {} for r in request.app.router.routes()}
        paths.update({"/begin_weight_update": {}, "/end_weight_update": {}})
        return web.json_response({"paths": paths})

    async def _pause(self, request: web.Request) -> web.Response:
        mode = (await request.json()).get("mode", "abort")
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            self._abort.set()
            self._abort = asyncio.Event()
        return web.json_response({"status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resumed.set()
        return web.json_response({"status": "ok"})

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def _generate(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.num_generate += 1
        if self.hold_until:
            round_full = self._round_full
            self._round_count += 1
            if self._round_count == self.hold_until:
                self.t_round_arrived.append(time.time())
                round_full.set()
                self._round_full, self._round_count = asyncio.Event(), 0
            await round_full.wait()
        else:
            self.requests.append(body)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=503, text="injected failure")
        await self._resumed.wait()  # SGLang holds new requests while paused
        ids = body["input_ids"]
        sp = body["sampling_params"]
        base, _, _ = body.get("rid", "x-0").rpartition("-")
        plen = self._prompt_len.setdefault(base, len(ids))
        k0 = len(ids) - plen
        seed = sum(ids[:plen])
        stop = set(sp.get("stop_token_ids") or [])
        out, spans, finish = [], [], {"type": "length", "length": sp["max_new_tokens"]}
        abort = self._abort
        prefill_version = self.weight_version  # the weights that routed this call's prompt
        for j in range(sp["max_new_tokens"]):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
                if abort.is_set():
                    finish = {"type": "abort", "message": "Aborted"}
                    break
                await self._resumed.wait()  # retract / in_place: hold, then continue
            tok = (seed + 7 * (k0 + j)) % self.vocab_size
            v = self.weight_version
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] += 1
            else:
                spans.append({"version": v, "start": len(out), "end": len(out) + 1})
            out.append(tok)
            self.num_tokens += 1
            if self._token_waiters:  # nothing on the benches' hot path unless a test waits
                self._token_waiters = [(k, f) for k, f in self._token_waiters if not self._wake(k, f)]
            if tok in stop:
                finish = {"type": "stop", "matched": tok}
                break
        lps = [[-0.01 * (k0 + i + 1), t, None] for i, t in enumerate(out)]
        meta = {"id": body.get("rid"), "finish_reason": finish, "weight_version": self.weight_version,
                "output_token_logprobs": lps, "weight_versions": spans or None}
        if body.get("return_routed_experts"):
            meta["routed_experts"] = fake_routes(ids + out[:-1] if out else ids[:-1], prefill_version)
        return web.json_response({"output_ids": out, "meta_info": meta})


FAKE_ROUTE_LAYERS, FAKE_ROUTE_TOPK, FAKE_ROUTE_EXPERTS = 2, 2, 8


def fake_routes(fed: list[int], version: str) -> str:
    """meta_info.routed_experts as SGLang encodes it (base64 int32 [len(fed), layers, top_k]):
    token t at layer l goes to experts (t + l + v) % 8 and (t + l + v + 1) % 8, v = the weight
    version -- so a resumed call's prefill under new weights routes the prefix differently."""
    import base64

    import numpy as np

    v = int(version) if str(version).isdigit() else 0
    rows = [[(t + l + v + j) % FAKE_ROUTE_EXPERTS for l in range(FAKE_ROUTE_LAYERS) for j in range(FAKE_ROUTE_TOPK)]
            for t in fed]
    return base64.b64encode(np.asarray(rows, dtype=np.int32).tobytes()).decode()


async def serve(fake: FakeSGLang, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Start ``fake`` on the running loop; returns the runner (``await runner.cleanup()``) and port."""
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=16384)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--token-delay-s", type=float, default=0.0)
    ap.add_argument("--hold-until", type=int, default=0, help="answer /generate calls in rounds of this many")
    args = ap.parse_args()
    fake = FakeSGLang(token_delay_s=args.token_delay_s)
    fake.hold_until = args.hold_until
    web.run_app(fake.app(), host=args.host, port=args.port, access_log=None, backlog=16384, print=None)


if __name__ == "__main__":
    main()
