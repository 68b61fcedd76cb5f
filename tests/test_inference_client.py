"""Client logic against in-process fake SGLang servers (areal_mega/inference/fake_server.py): launch
command, config errors, interruptible generation, failover, API key, load balancing.
No SGLang needed; runtime ~3 s. The same features are tested on real SGLang in
tests/test_inference_sglang.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from areal_mega.api.io import GenerationRequest, SamplingParams
from areal_mega.config import ConfigError, from_dict
from areal_mega.inference import (InferenceConfig, InferenceError, InferencePool, InferenceServerError,
                                  SGLangServerConfig)
from areal_mega.inference.fake_server import FakeSGLang, serve
from areal_mega.inference import sglang_api
from areal_mega.inference.server import build_launch_command

pytestmark = pytest.mark.timeout(60)


def expected(prompt: list[int], n: int, vocab: int = 512) -> list[int]:
    """What FakeSGLang generates: token k = (sum(prompt) + 7k) % vocab."""
    return [(sum(prompt) + 7 * k) % vocab for k in range(n)]


def test_launch_command_from_config():
    cfg = SGLangServerConfig(python="/v/bin/python", model_path="/m", device="cpu", dtype="float32",
                             max_total_tokens=4096, extra_args=["--attention-backend", "torch_native"])
    cmd = build_launch_command(cfg, 30001, secret_config="/run/secrets/sglang.yaml", weight_version=3, random_seed=7)
    assert cmd[:3] == ["/v/bin/python", "-m", "sglang.launch_server"]
    assert "--skip-tokenizer-init" in cmd and cmd[-2:] == ["--attention-backend", "torch_native"]
    assert "--sleep-on-idle" in cmd
    assert "--sleep-on-idle" not in build_launch_command(dataclasses.replace(cfg, sleep_on_idle=False), 30001)
    rest = [a for a in cmd[3:-2] if a not in ("--skip-tokenizer-init", "--sleep-on-idle")]
    flags = dict(zip(rest[::2], rest[1::2]))
    assert flags["--model-path"] == "/m" and flags["--port"] == "30001" and flags["--host"] == "127.0.0.1"
    assert flags["--device"] == "cpu" and flags["--dtype"] == "float32" and flags["--tp-size"] == "1"
    assert flags["--max-total-tokens"] == "4096" and flags["--weight-version"] == "3"
    assert flags["--random-seed"] == "7"
    # The API key travels in a 0600 config file SGLang reads, never on the command line.
    assert flags["--config"] == "/run/secrets/sglang.yaml" and "--api-key" not in cmd


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="server.model_path"):
        from_dict(InferenceConfig, {})
    with pytest.raises(ConfigError, match="client.pause_mode"):
        from_dict(InferenceConfig, {"server": {"model_path": "m"}, "client": {"pause_mode": "stop"}})
    with pytest.raises(ConfigError, match="client.max_retries"):
        from_dict(InferenceConfig, {"server": {"model_path": "m"}, "client": {"max_retries": -1}})
    with pytest.raises(ConfigError, match="addresses"):
        from_dict(InferenceConfig, {"addresses": ["nohost"]})
    cfg = from_dict(InferenceConfig, {"addresses": ["127.0.0.1:1"], "client": {"pause_mode": "retract"}})
    assert cfg.client.pause_mode == "retract"


async def _with_fakes(n, body, *, api_key=None, token_delay_s=0.0, client=None, capture_routes=False):
    lengths: dict[str, int] = {}
    fakes = [FakeSGLang(token_delay_s=token_delay_s, api_key=api_key, prompt_lengths=lengths) for _ in range(n)]
    runners, addrs = [], []
    for f in fakes:
        r, port = await serve(f)
        runners.append(r)
        addrs.append(f"127.0.0.1:{port}")
    cfg = from_dict(InferenceConfig, {"addresses": addrs, "api_key": api_key,
                                      "client": {"health_check_interval_s": 0.2, "retry_backoff_s": 0.01,
                                                 **(client or {})}})
    pool = InferencePool(cfg, capture_routes=capture_routes)
    try:
        await pool.start()
        return await body(pool, fakes)
    finally:
        await pool.close()
        for r in runners:
            await r.cleanup()


def test_generate_balances_and_reports_versions():
    async def body(pool, fakes):
        reqs = [GenerationRequest([i, 1, 2], SamplingParams(max_new_tokens=5)) for i in range(40)]
        res = await asyncio.gather(*(pool.agenerate(r) for r in reqs))
        for r, out in zip(reqs, res):
            assert out.output_ids == expected(r.input_ids, 5)
            assert out.output_logprobs == pytest.approx([-0.01, -0.02, -0.03, -0.04, -0.05])
            assert out.output_versions == [0] * 5 and out.finish_reason == "length"
            assert out.rid == r.rid and out.num_interruptions == 0
        assert len({o.rid for o in res}) == 40
        # least-in-flight over two servers: both get a fair share
        assert sorted(f.num_generate for f in fakes) == [20, 20]
        assert pool.capabilities.weight_update_session
        # stop tokens end generation and are kept in the output
        stop_tok = expected([3, 4], 3)[2]
        out = await pool.agenerate(GenerationRequest([3, 4], SamplingParams(max_new_tokens=9, stop_token_ids=[stop_tok])))
        assert out.output_ids == expected([3, 4], 3) and out.finish_reason == "stop"

    asyncio.run(_with_fakes(2, body))


def test_abort_pause_resubmits_with_prefix_and_keeps_versions():
    async def body(pool, fakes):
        req = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=40))
        task = asyncio.create_task(pool.agenerate(req))
        await fakes[0].generated(15)  # pause mid-generation
        await pool.pause()
        await asyncio.sleep(0.1)
        assert not task.done()  # aborted on the server, held by the client while paused
        await pool.update_weights_from_disk("/same/weights", version=1)
        await pool.resume()
        out = await task
        assert out.output_ids == expected([5, 6, 7], 40)
        assert out.output_logprobs == pytest.approx([-0.01 * (k + 1) for k in range(40)])
        k = out.output_versions.index(1)
        assert 0 < k < 40 and out.output_versions == [0] * k + [1] * (40 - k)
        assert out.num_interruptions == 1 and out.finish_reason == "length"
        first, second = fakes[0].requests
        assert second["input_ids"] == [5, 6, 7] + out.output_ids[:k]
        assert second["sampling_params"]["max_new_tokens"] == 40 - k

    asyncio.run(_with_fakes(1, body, token_delay_s=0.01, client={"pause_mode": "abort"}))


def test_failover_retries_elsewhere_exactly_once():
    async def body(pool, fakes):
        fakes[0].fail_next = 3  # three 503s from server 0: marked down, requests move to server 1
        reqs = [GenerationRequest([i, 9], SamplingParams(max_new_tokens=4)) for i in range(16)]
        res = await asyncio.gather(*(pool.agenerate(r) for r in reqs))
        assert [o.output_ids for o in res] == [expected(r.input_ids, 4) for r in reqs]
        assert pool.num_completed == 16 and pool.num_failovers == 3
        # server 0 answers its health check again, so the monitor puts it back in rotation
        for _ in range(50):
            if pool.servers[0].healthy:
                break
            await asyncio.sleep(0.1)
        assert pool.servers[0].healthy
        before = fakes[0].num_generate
        await asyncio.gather(*(pool.agenerate(GenerationRequest([1], SamplingParams(max_new_tokens=2)))
                               for _ in range(8)))
        assert fakes[0].num_generate > before

    asyncio.run(_with_fakes(2, body))


def test_dropped_connection_to_a_live_server_is_retried_without_marking_it_down():
    """A connection closed before the answer (the server closing an idle keep-alive connection
    as a request goes out) on a server that still answers: the request is retried and the
    server stays in rotation -- with one server, marking it down would stall generation and
    the next weight sync. Control calls are retried the same way."""
    async def body(pool, fakes):
        assert pool.cfg.client.keepalive_timeout_s < 5  # below SGLang's (uvicorn) keep-alive
        fakes[0].drop["/generate"] = 2
        req = GenerationRequest([4, 2], SamplingParams(max_new_tokens=6))
        out = await pool.agenerate(req)
        assert out.output_ids == expected([4, 2], 6)
        h = pool.servers[0]
        assert pool.num_failovers == 2 and h.healthy and h.num_failures == 0 and h._recovery is None
        assert fakes[0].num_generate == 3
        # max_retries still bounds a connection that keeps dropping
        fakes[0].drop["/generate"] = 10
        with pytest.raises(InferenceError, match="max_retries"):
            await pool.agenerate(GenerationRequest([1], SamplingParams(max_new_tokens=2)))
        assert h.healthy
        # the same for control calls (pause / continue / weight updates are idempotent)
        fakes[0].drop["/pause_generation"] = 1
        await pool.pause()
        assert fakes[0].paused and h.healthy and h.num_failures == 0
        fakes[0].drop["/continue_generation"] = 1
        await pool.resume()
        assert not fakes[0].paused and h.healthy and h.num_failures == 0

    asyncio.run(_with_fakes(1, body, client={"max_retries": 3}))


def test_api_key_sent_and_required():
    async def body(pool, fakes):
        out = await pool.agenerate(GenerationRequest([1, 2], SamplingParams(max_new_tokens=3)))
        assert out.output_ids == expected([1, 2], 3)
        pool.servers[0]._headers = {}
        with pytest.raises(InferenceServerError) as e:
            await pool.servers[0].send(sglang_api.model_info())
        assert e.value.status == 401

    asyncio.run(_with_fakes(1, body, api_key="s3cret"))


@pytest.mark.slow
def test_server_process_group_stop_and_start_error(tmp_path):
    """stop() takes down the whole process tree, also when it ignores SIGTERM (SIGKILL after the
    grace period); wait_ready() fails fast with the log tail when the server exits."""
    import time

    from areal_mega.inference.server import SGLangServer, ServerStartError
    from areal_mega.utils.procs import group_pids

    stubborn = tmp_path / "stubborn.sh"
    trapped = tmp_path / "trapped"
    stubborn.write_text(f"#!/bin/sh\ntrap '' TERM\n(touch {trapped}; sleep 300) &\nsleep 300\n")
    stubborn.chmod(0o755)
    srv = SGLangServer(SGLangServerConfig(python=str(stubborn), model_path="m", stop_grace_s=0.5), 1,
                       log_dir=tmp_path)
    srv.start()
    pgid = srv.pid
    deadline = time.monotonic() + 10
    while not trapped.exists() and time.monotonic() < deadline:  # the child ignores SIGTERM now
        time.sleep(0.05)
    assert srv.is_running() and len(group_pids(pgid)) >= 3  # the wrapper, the script, its child
    t0 = time.monotonic()
    srv.stop()
    assert not group_pids(pgid) and srv.pid is None
    assert 0.4 < time.monotonic() - t0 < 5  # SIGTERM ignored: SIGKILL after the grace (0.5 s)
    srv.close()
    with pytest.raises(ServerStartError, match="closed"):  # a racing restart cannot revive it
        srv.start()

    failing = tmp_path / "failing.sh"
    failing.write_text("#!/bin/sh\necho 'boom: no such model'\nexit 3\n")
    failing.chmod(0o755)
    srv = SGLangServer(SGLangServerConfig(python=str(failing), model_path="m"), 2, log_dir=tmp_path)
    srv.start()
    with pytest.raises(ServerStartError, match="(?s)exited with code 3.*boom: no such model"):
        srv.wait_ready(timeout_s=20)
    srv.stop()

    # SGLang whose port is taken logs uvicorn's bind error and lingers in its warm-up for minutes
    # (then exits 137): the start fails at once, naming the port, and nothing is left running.
    # Control: the same lingering server without the error line waits out its timeout instead.
    # (The timeouts only tell the two apart: the first message comes from the fast path alone. Both
    # starts append to the same sglang-3.log: the control also shows an earlier start's error is not
    # read as this one's.)
    for line, want, timeout in [("[2026-12-03 06:55:07] ERROR:    [Errno 98] error while attempting to bind on "
                                 "address ('127.0.0.1', 3): address already in use", "port 3 is already in use", 60),
                                ("[2026-12-03 06:55:07] loading weights", "not healthy after 3s", 3)]:
        lingering = tmp_path / "lingering.sh"
        lingering.write_text(f"#!/bin/sh\necho \"{line}\"\nexec sleep 300\n")
        lingering.chmod(0o755)
        srv = SGLangServer(SGLangServerConfig(python=str(lingering), model_path="m"), 3, log_dir=tmp_path)
        srv.start()
        with pytest.raises(ServerStartError, match=want):
            srv.wait_ready(timeout_s=timeout)
        srv.stop()
        assert not srv.is_running()


@pytest.mark.slow
def test_pool_owned_server_dies_with_its_parent(tmp_path):
    """A server started by a process that is then SIGKILLed (no cleanup runs) dies with it
    (areal_mega.utils.procs' die-with-parent wrapper; the generic mechanism and its control are in
    tests/test_procs.py, the real SGLang server in tests/test_inference_sglang.py)."""
    import os
    import subprocess
    import sys
    import time

    from areal_mega.utils.procs import group_pids

    fake = tmp_path / "server.sh"
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    parent_code = (
        "import sys, time\n"
        "from areal_mega.inference.server import SGLangServer\n"
        "from areal_mega.inference.config import SGLangServerConfig\n"
        f"s = SGLangServer(SGLangServerConfig(python={str(fake)!r}, model_path='m'), 1, log_dir={str(tmp_path)!r})\n"
        "s.start()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    pgid = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while len(group_pids(pgid)) < 2 and time.monotonic() < deadline:  # the wrapper and the server
        time.sleep(0.05)
    assert len(group_pids(pgid)) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_pids(pgid), "the server outlived its SIGKILLed parent"


@pytest.mark.timeout(300)
def test_busy_server_whose_health_check_is_slow_stays_in_rotation():
    """SGLang's /health is a one-token generation: behind a long batch on a loaded CPU server it
    answers later than any timeout, and the pool once took such a live, busy server (the only
    survivor of a failover) out of rotation. Here /health always answers long after its timeout while
    requests run for ~40 health passes: the server is never marked down (it is asked /model_info
    while it has requests in flight). Idle, the same slowness takes it out only after
    client.health_check_failures misses in a row (negative control: the check still bites)."""
    async def body(pool, fakes):
        h = pool.servers[0]
        fakes[0].health_delay_s = 15.0  # health_check_timeout_s is 5: /health never answers in time
        reqs = [pool.agenerate(GenerationRequest([i, 3], SamplingParams(max_new_tokens=200))) for i in range(4)]
        res = await asyncio.gather(*reqs)  # >= 2 s of generation, a health pass every 0.05 s
        assert [len(r.output_ids) for r in res] == [200] * 4
        # every mark-down counts in num_failures (ServerHandle's only way out of rotation), so 0
        # means the server never left it -- no sampling of h.healthy that a short flap could slip past
        assert h.healthy and h.num_failures == 0 and pool.num_failovers == 0
        # idle: /health is the probe again, and it keeps timing out
        seen = fakes[0].num_health
        deadline = asyncio.get_running_loop().time() + 180  # 3 passes of 5 s timeouts; generous under load
        while h.healthy and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        # 3 = health_check_failures misses in a row; the first may have been asked just before `seen`
        # was read (a pass started while the last request finished), so >= 2 arrived after it
        assert not h.healthy and fakes[0].num_health - seen >= 2

    asyncio.run(_with_fakes(1, body, token_delay_s=0.01,
                            client={"health_check_interval_s": 0.05, "health_check_timeout_s": 5.0,
                                    "health_check_failures": 3}))


def test_routes_survive_an_interruption_first_call_wins():
    """MoE routing replay, client side: with capture_routes every /generate asks for routes; a
    request aborted by a pause and resumed under version 1 keeps the rows of its first call (the
    forward that first fed those tokens) and takes only the new rows from the resumed call --
    the fake routes every token by (token + layer + version), so a wrong merge shows."""
    from areal_mega.inference.fake_server import FAKE_ROUTE_EXPERTS as E

    async def body(pool, fakes):
        prompt = [5, 6, 7]
        task = asyncio.create_task(pool.agenerate(GenerationRequest(prompt, SamplingParams(max_new_tokens=40))))
        await fakes[0].generated(10)  # some tokens generated under version 0
        await pool.pause()
        await pool.update_weights_from_disk("/new/weights", version=1)
        await pool.resume()
        out = await task
        assert all(r.get("return_routed_experts") for r in fakes[0].requests)
        k = out.output_versions.index(1)
        fed = prompt + out.output_ids[:-1]
        assert out.routes.shape == (len(fed), 4) and out.routes.dtype.name == "int16"
        # rows fed first by call 1 (prompt + its tokens but the last) are version-0 routes
        for p, t in enumerate(fed):
            v = 0 if p < len(prompt) + k - 1 else 1
            assert out.routes[p].tolist() == [(t + l + v + j) % E for l in range(2) for j in range(2)], (p, k)

    asyncio.run(_with_fakes(1, body, token_delay_s=0.01, client={"pause_mode": "abort"}, capture_routes=True))


def test_routes_decode_errors_name_the_problem():
    from areal_mega.inference import sglang_api as api

    with pytest.raises(ValueError, match="^routed_experts: the server returned no routes"):
        api.decode_routes({}, 3)
    import base64

    import numpy as np
    raw = base64.b64encode(np.arange(10, dtype=np.int32).tobytes()).decode()
    with pytest.raises(ValueError, match="do not split into 3 token rows"):
        api.decode_routes({"routed_experts": raw}, 3)
    assert api.decode_routes({"routed_experts": raw}, 5).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]

