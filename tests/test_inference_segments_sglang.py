"""A real SGLang CPU server SIGKILLed in the middle of a request (``client.segment_tokens``): the
tokens of the segments it returned are kept -- ids, behaviour log-probs and versions bit for bit --
and generation continues after them on a server process started afresh (the pool restarts the
dead one), not from the first token. One server (the two-server pool's failover of whole
requests: tests/test_inference_sglang.py). ~2-4 min on 2 cores (a server start and a restart);
``heavy``: make test-heavy / make test-resume-inflight."""

from __future__ import annotations

import asyncio

import pytest

from areal_mega.api.io import GenerationRequest, SamplingParams
from areal_mega.config import from_dict
from areal_mega.inference import InferenceConfig, InferencePool
from tests.support.launch import SGLANG_PYTHON, needs_sglang
from tests.support.models import save_tiny_model
from tests.test_inference_sglang import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.heavy, needs_sglang, pytest.mark.timeout(1500)]
SEGMENT, MAX_NEW, PROMPT = 16, 400, [5, 17, 99, 300, 42, 7]


def test_server_sigkilled_mid_request_the_request_keeps_its_tokens(tmp_path):
    save_tiny_model(tmp_path / "m", **MODEL)
    cfg = from_dict(InferenceConfig, {
        "num_servers": 1,
        "server": {"python": SGLANG_PYTHON, "model_path": str(tmp_path / "m"), "device": "cpu", "dtype": "float32",
                   "max_total_tokens": 16384, "startup_timeout_s": 600, "env": {"OMP_NUM_THREADS": "1"},
                   "log_dir": str(tmp_path / "logs")},
        "client": {"request_timeout_s": 900, "health_check_interval_s": 1.0, "retry_backoff_s": 0.1,
                   "segment_tokens": SEGMENT}})
    loop = asyncio.new_event_loop()
    pool = loop.run_until_complete(asyncio.wait_for(InferencePool.launch(cfg), 900))
    sent: list[int] = []  # input length of every /generate call, in order
    post = pool._post_generate

    async def recording(h, call):
        sent.append(len(call.body["input_ids"]))
        return await post(h, call)

    pool._post_generate = recording
    victim = pool.servers[0]
    old_pid = victim.process.pid
    try:
        async def scenario():
            # Sampled (temperature 1): the kept tokens are a draw, not a function of the prompt.
            req = GenerationRequest(list(PROMPT), SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0), rid="victim")
            task = asyncio.create_task(pool.agenerate(req))
            while (got := pool.partial("victim")) is None or len(got[0]) < 2 * SEGMENT:
                assert not task.done()
                await asyncio.sleep(0.01)
            kept = pool.partial("victim")
            calls_before = len(sent)
            victim.process.kill()  # SIGKILL, with the next segment in flight
            return kept, calls_before, await task

        kept, calls_before, res = loop.run_until_complete(asyncio.wait_for(scenario(), 1200))
    finally:
        loop.run_until_complete(pool.close())
        loop.close()
    n = len(kept[0])
    assert n >= 2 * SEGMENT
    assert res.output_ids[:n] == kept[0] and res.output_logprobs[:n] == kept[1] and res.output_versions[:n] == kept[2]
    assert len(res.output_ids) == MAX_NEW and res.finish_reason == "length"
    assert pool.num_failovers >= 1 and victim.num_restarts == 1 and victim.process.pid != old_pid
    # After the kill the restarted server was asked to continue after the kept tokens (at least
    # those read before the kill), never from the prompt alone.
    after = sent[calls_before:]
    assert after and min(after) >= len(PROMPT) + n, (n, sent)
    print({"kept_tokens": n, "segments_total": len(sent), "calls_after_kill": len(after)})
