"""The inference pool against REAL SGLang 0.5.23 CPU servers.

One module fixture builds a tiny random Qwen2 (2 layers, hidden 128, head_dim 64, vocab 512, fp32
safetensors, no tokenizer: servers run with --skip-tokenizer-init) and starts TWO servers in
parallel, both protected by an API key. The tests share them, in file order:

  capabilities -> greedy == HF (ids exact, log-probs to fp32 rounding) -> API key -> pause/continue
  in abort and retract mode with a version bump -> SIGKILL one of two servers under 64 requests
  (all complete once, outputs unchanged; the server restarts, is resynced, serves again).

Runtime ~3-4 min on an otherwise idle 2-core machine (two server starts and one restart
dominate: ~60 s each); 10.5 min measured with the machine at load ~30 from other jobs.
Needs AREAL_MEGA_SGLANG_PYTHON (set by `make test`); skipped without it.
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest
import torch

from areal_mega.api.io import GenerationRequest, SamplingParams
from areal_mega.config import from_dict
from areal_mega.inference import InferenceConfig, InferencePool, sglang_api
from tests.support.launch import SGLANG_PYTHON, needs_sglang
from tests.support.models import save_tiny_model
from tests.support.numerics import fp32_tol, transformer_reductions

pytestmark = [pytest.mark.slow, needs_sglang, pytest.mark.timeout(900)]
API_KEY = "test-key-123"
EOS = 2
# Random weights with std 0.3 (not HF's 0.02) so that next-token distributions are peaked: the
# smallest top-1/top-2 logit gap along greedy paths is ~2e-3, far above fp32 noise, so greedy
# paths are stable across implementations and batch compositions. No EOS in the config:
# generation ends at max_new_tokens or at stop_token_ids we pass.
MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, initializer_range=0.3,
             bos_token_id=1, eos_token_id=None)


class Harness:
    """A module-lifetime event loop + pool (the pool's session and monitor live on that loop)."""

    def __init__(self, model_dir, log_dir):
        self.model_dir = str(model_dir)
        self.cache: dict = {}
        self.loop = asyncio.new_event_loop()
        cfg = from_dict(InferenceConfig, {
            "num_servers": 2,
            "api_key": API_KEY,
            "server": {"python": SGLANG_PYTHON, "model_path": self.model_dir, "device": "cpu",
                       "dtype": "float32", "max_total_tokens": 32768, "startup_timeout_s": 420,
                       "env": {"OMP_NUM_THREADS": "1"}, "log_dir": str(log_dir)},
            "client": {"request_timeout_s": 120, "health_check_interval_s": 1.0,
                       "retry_backoff_s": 0.1},
        })
        self.pool = self.run(InferencePool.launch(cfg), timeout=900)

    def hf_model(self):
        """The same weights in HF transformers (fp32): the reference."""
        if "hf" not in self.cache:
            from transformers import AutoModelForCausalLM

            self.cache["hf"] = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        return self.cache["hf"]

    def logprob_tol(self) -> float:
        """Log-probs of the same fp32 weights computed two ways -- SGLang vs HF, or SGLang's decode
        vs its prefill of the same tokens after an interruption: every reduction of the 2-layer
        forward may run in another order (tests/support/numerics.py; FWD = 14 of up to K = 512
        terms, the vocabulary's normaliser), relative to the logits' scale s = max |logits| (std-0.3
        weights: large); |d lp| <= 2 max |d z|."""
        if "lp_tol" not in self.cache:
            with torch.no_grad():
                s = float(self.hf_model()(torch.tensor(prompts(8, length=32))).logits.abs().max())
            self.cache["lp_tol"] = 2 * fp32_tol(MODEL["vocab_size"], s, ops=transformer_reductions(MODEL["num_hidden_layers"]))
        return self.cache["lp_tol"]

    def run(self, coro, timeout=300):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def generate(self, prompts, max_new_tokens, **kw):
        reqs = [GenerationRequest(list(p), SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw))
                for p in prompts]

        async def all_of():
            return await asyncio.gather(*(self.pool.agenerate(r) for r in reqs))

        return self.run(all_of())

    def close(self):
        try:
            self.run(self.pool.close(), timeout=120)
        finally:
            self.loop.close()


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    work = tmp_path_factory.mktemp("inference")
    save_tiny_model(work / "tiny-qwen2", **MODEL)
    harness = Harness(work / "tiny-qwen2", work / "logs")
    try:
        yield harness
    finally:
        harness.close()


def prompts(n, length=6):
    g = torch.Generator().manual_seed(123)
    return [torch.randint(3, 512, (length,), generator=g).tolist() for _ in range(n)]


def test_capabilities(h):
    caps = h.pool.capabilities
    assert caps.sglang_version == "0.5.23"
    assert caps.weight_update_session  # 0.5.23 has /begin_weight_update and /end_weight_update
    assert caps.has("/update_weights_from_distributed") and caps.has("/init_weights_update_group")
    info = h.run(h.pool.servers[0].send(sglang_api.model_info()))
    assert info["weight_version"] == "0"


def test_greedy_matches_hf(h):
    ps = prompts(4)
    n = 24
    outs = h.generate(ps, n, stop_token_ids=[EOS])
    model = h.hf_model()
    max_diff = 0.0
    for p, out in zip(ps, outs):
        ids, ref_ids, ref_lps = list(p), [], []
        with torch.no_grad():
            for _ in range(n):  # HF greedy, full recompute each step: the plainest reference
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                tok = int(lp.argmax())
                ref_ids.append(tok)
                ref_lps.append(float(lp[tok]))
                ids.append(tok)
                if tok == EOS:
                    break
        assert out.output_ids == ref_ids
        assert out.finish_reason == ("stop" if ref_ids[-1] == EOS else "length")
        assert len(out.output_logprobs) == len(ref_lps) and out.output_versions == [0] * len(ref_ids)
        max_diff = max(max_diff, max(abs(a - b) for a, b in zip(out.output_logprobs, ref_lps)))
    assert max_diff <= h.logprob_tol(), (max_diff, h.logprob_tol())


def test_api_key_required(h):
    url = h.pool.servers[0].url

    async def probe():
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=body) as r:
                no_key = r.status
            async with s.post(url + "/generate", json=body, headers={"Authorization": "Bearer wrong"}) as r:
                wrong_key = r.status
            async with s.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                right_key = r.status
                n = len((await r.json())["output_ids"])
        return no_key, wrong_key, right_key, n

    assert h.run(probe()) == (401, 401, 200, 2)
    # ... and every call of the pool (which sends the key) works: generation above, and this
    assert h.run(h.pool.servers[1].get_weight_version()) == "0"
    # The key reached SGLang through a 0600 --config file: not on any command line, not in its log.
    import subprocess

    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert "sglang.launch_server" in ps and API_KEY not in ps
    server = h.pool.servers[0].process
    assert API_KEY not in server.log_path.read_text(errors="replace")
    secret = server.log_path.with_name(f"sglang-{server.port}.secret.yaml")
    assert secret.stat().st_mode & 0o777 == 0o600


async def decoding(pool, since: float, n: int, timeout_s: float = 120.0) -> None:
    """Wait until all ``n`` requests sent since ``since`` decode: each server's load snapshot (SGLang
    publishes one after each prefill and every 15 decode steps, stamped with time.time()) is
    newer than ``since`` and counts them in its running batch, so each has its first token. A
    fixed sleep (once 0.3 x the reference latency) paused a loaded CI machine before any prefill."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = True
        for s in pool.servers:
            if s.in_flight == 0:
                continue
            loads = (await s.send(sglang_api.Call("GET", "/v1/loads?include=core"))).get("loads") or [{}]
            ready &= loads[0].get("timestamp", 0.0) > since and loads[0].get("num_running_reqs", 0) >= s.in_flight
        if ready and sum(s.in_flight for s in pool.servers) == n:
            return
        assert time.monotonic() < deadline, "the requests never started decoding"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_pause_bump_version_continue(h, mode):
    """Pause mid-generation, load the same weights under version v+1, continue: every sequence is
    complete and identical to the uninterrupted greedy one, tokens before the pause carry v and
    tokens after it v+1. In abort mode the client resubmits (prompt + tokens so far); in retract
    mode SGLang holds the request and reports the switch in its weight_versions spans."""
    pool = h.pool
    pool.cfg.client.pause_mode = mode
    v = pool.get_version()
    ps = prompts(4, length=5)
    n = 400
    if "pause_ref" not in h.cache:  # same weights and greedy: one reference serves both modes
        h.cache["pause_ref"] = h.generate(ps, n)
    ref = h.cache["pause_ref"]

    async def interrupted():
        reqs = [GenerationRequest(list(p), SamplingParams(max_new_tokens=n, temperature=0.0)) for p in ps]
        t0 = time.time()
        tasks = [asyncio.create_task(pool.agenerate(r)) for r in reqs]
        await decoding(pool, since=t0, n=len(reqs))
        assert not any(t.done() for t in tasks)
        await pool.pause()
        await asyncio.sleep(0.3)
        await pool.update_weights_from_disk(h.model_dir, version=v + 1)
        await pool.resume()
        return await asyncio.gather(*tasks)

    outs = h.run(interrupted())
    for r, out in zip(ref, outs):
        assert out.output_ids == r.output_ids and len(out.output_ids) == n
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, r.output_logprobs)) <= h.logprob_tol()
        k = out.output_versions.index(v + 1)
        assert 0 < k < n and out.output_versions == [v] * k + [v + 1] * (n - k)
        assert out.num_interruptions == (1 if mode == "abort" else 0)
    assert pool.get_version() == v + 1


def test_failover_sigkill_one_of_two(h):
    """64 requests in flight on two servers, SIGKILL server 0: all 64 complete exactly once with
    the same tokens as without the crash; server 0 is restarted, resynced to the pool's version
    (default hook: the last update_weights_from_disk) and serves again."""
    pool = h.pool
    victim = pool.servers[0]
    old_pid = victim.process.pid
    version = pool.get_version()
    ps = prompts(64, length=4)
    n = 120
    ref = h.generate(ps, n)
    completed_before = pool.num_completed

    async def crash():
        reqs = [GenerationRequest(list(p), SamplingParams(max_new_tokens=n, temperature=0.0), rid=f"r{i}")
                for i, p in enumerate(ps)]
        tasks = [asyncio.create_task(pool.agenerate(r)) for r in reqs]
        # Kill mid-generation: once both servers hold requests, after ~30% of the reference
        # latency -- or earlier, as soon as either server starts finishing its share (under load
        # the two servers run at different speeds; a fixed sleep once found server 1 done).
        other = pool.servers[1]
        deadline = time.monotonic() + 60
        while not (victim.in_flight > 0 and other.in_flight > 0):
            assert time.monotonic() < deadline, "the requests never reached both servers"
            await asyncio.sleep(0.01)
        peak = (victim.in_flight, other.in_flight)
        until = time.monotonic() + 0.3 * max(r.latency_s for r in ref)
        while time.monotonic() < until and (victim.in_flight, other.in_flight) == peak:
            await asyncio.sleep(0.01)
        # The victim's in-flight requests are what must move to the other server.
        assert victim.in_flight > 0
        victim.process.kill()  # SIGKILL the main server process
        return await asyncio.gather(*tasks)

    outs = h.run(crash())
    assert [o.rid for o in outs] == [f"r{i}" for i in range(64)]
    assert pool.num_completed - completed_before == 64
    assert pool.num_failovers >= 1
    assert [o.output_ids for o in outs] == [r.output_ids for r in ref]
    assert all(len(o.output_versions) == len(o.output_ids) == len(o.output_logprobs) for o in outs)

    deadline = time.monotonic() + 420
    while not victim.healthy and time.monotonic() < deadline:
        h.run(asyncio.sleep(1.0))
    assert victim.healthy, victim.process.log_tail()
    assert victim.num_restarts == 1 and victim.process.pid != old_pid
    assert h.run(victim.get_weight_version()) == str(version)  # resynced before taking traffic
    served = victim.num_served
    outs = h.generate(ps[:8], 16)
    assert victim.num_served > served
    assert [o.output_ids for o in outs] == [r.output_ids[:16] for r in ref[:8]]
    assert all(o.output_versions == [version] * 16 for o in outs)


class _ByteTokenizer:
    """Text <-> ids for the workflow's prompt and feedback text (the test model has no tokenizer
    of its own; the model, the server and the generated tokens are the real thing)."""

    eos_token_id = EOS

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 500 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 90) for i in ids)


def test_multi_turn_workflow_on_real_servers(h):
    """A multi-turn episode against the real pool: every attempt is wrong (reward 0), so each
    sample runs max_turns attempts with the feedback text between them. The trajectory must be
    one aligned token sequence: feedback tokens with loss_mask 0, every generated token with the
    server's version and a behaviour log-prob equal to HF transformers' on the whole sequence."""
    from areal_mega.workflows import WorkflowConfig, build_workflow
    from areal_mega.workflows.multi_turn import MultiTurnWorkflow

    async def always_wrong(prompt, completion, data):
        return 0.0

    tok = _ByteTokenizer()
    cfg = WorkflowConfig(kind="multi_turn", group_size=2, max_turns=3, options=MultiTurnWorkflow.Options(feedback=" no, again:"),
                         sampling=SamplingParams(max_new_tokens=6, temperature=1.0))
    wf = build_workflow(cfg, tok, always_wrong)
    version = h.pool.get_version()
    trajs = h.run(wf.arun_episode(h.pool, {"id": "mt", "prompt": "what is 2+2?"}))
    assert len(trajs) == 2 and all(t.reward == 0.0 for t in trajs)
    model = h.hf_model()
    prompt, feedback = tok.encode("what is 2+2?"), tok.encode(cfg.options.feedback)
    for t in trajs:
        ids, mask = t.input_ids, t.loss_mask
        assert ids[: len(prompt)] == prompt and mask[: len(prompt)] == [0] * len(prompt)
        # [prompt]0 [attempt]1 [feedback]0 [attempt]1 [feedback]0 [attempt]1: three generated spans
        spans = [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]
        assert spans == [0, 1, 0, 1, 0, 1], mask
        env_runs = [ids[i:j] for i, j in _runs(mask, 0)][1:]
        assert env_runs == [feedback, feedback]
        gen = [i for i, m in enumerate(mask) if m]
        assert all(t.versions[i] == version for i in gen)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        ref = [float(lp[i - 1, ids[i]]) for i in gen]
        assert max(abs(a - b) for a, b in zip(ref, [t.logprobs[i] for i in gen])) <= h.logprob_tol()


def _runs(mask, value):
    """(start, end) of each maximal run of ``value`` in ``mask``."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.heavy  # its own server start (~3 min on 2 cores): make test-heavy; the fake-server twin runs in make test
def test_real_server_tree_dies_with_sigkilled_parent(h, tmp_path):
    """A real SGLang server started by a process that is then SIGKILLed: the kernel's parent-death
    signal reaches the wrapper leading the server's process group, which SIGKILLs the whole group
    (main process, scheduler, detokenizer) -- even paused with a request held (as in a weight
    sync), where a SIGTERM would wait forever for the request to drain."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from areal_mega.utils.procs import free_port, group_pids

    port = free_port()
    parent_code = (
        "import sys, time\n"
        "from areal_mega.config import from_dict\n"
        "from areal_mega.inference.config import SGLangServerConfig\n"
        "from areal_mega.inference.server import SGLangServer\n"
        f"cfg = from_dict(SGLangServerConfig, {{'python': {SGLANG_PYTHON!r}, 'model_path': {h.model_dir!r},"
        " 'device': 'cpu', 'dtype': 'float32', 'max_total_tokens': 4096, 'startup_timeout_s': 420,"
        " 'env': {'OMP_NUM_THREADS': '1'}})\n"
        f"s = SGLangServer(cfg, {port}, log_dir={str(tmp_path)!r})\n"
        "s.start(); s.wait_ready()\n"
        "import json, threading, urllib.request\n"
        "def post(path, body):\n"
        f"    req = urllib.request.Request('http://127.0.0.1:{port}' + path, data=json.dumps(body).encode(),\n"
        "                                 headers={'Content-Type': 'application/json'})\n"
        "    return urllib.request.urlopen(req, timeout=600).read()\n"
        "threading.Thread(target=post, daemon=True, args=('/generate', {'input_ids': [1, 2, 3],\n"
        "    'sampling_params': {'max_new_tokens': 3000, 'ignore_eos': True}})).start()\n"
        "time.sleep(1)\n"
        "post('/pause_generation', {'mode': 'in_place'})  # the request stays held on the server\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    pgid = int(parent.stdout.readline())
    try:
        assert len(group_pids(pgid)) >= 2  # the main process and its scheduler (and detokenizer)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = group_pids(pgid)
        ps = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(map(str, left))],
                            capture_output=True, text=True).stdout if left else ""
        assert left == [], f"SGLang processes outlived their SIGKILLed parent:\n{ps}"
    finally:
        if group_pids(pgid):
            os.killpg(pgid, signal.SIGKILL)


def test_real_server_on_a_taken_port_fails_its_start_at_once(h, tmp_path):
    """A real SGLang server whose HTTP port another process listens on: SGLang logs uvicorn's bind
    error and would linger in its warm-up (~2 min, then exit 137); the start fails as soon as the
    error is in the log, naming the port, and no process of the server is left (the message text
    is SGLang's own: this is what the fast path reads; the fake's control is in
    test_inference_client)."""
    import socket

    from areal_mega.config import from_dict as _from_dict
    from areal_mega.inference.config import SGLangServerConfig
    from areal_mega.inference.server import ServerStartError, SGLangServer
    from areal_mega.utils.procs import group_pids, service_ports

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    port = service_ports(1)[0]
    holder.bind(("127.0.0.1", port))
    holder.listen()
    cfg = _from_dict(SGLangServerConfig, {"python": SGLANG_PYTHON, "model_path": h.model_dir, "device": "cpu",
                                          "dtype": "float32", "max_total_tokens": 4096, "startup_timeout_s": 420,
                                          "env": {"OMP_NUM_THREADS": "1"}})
    srv = SGLangServer(cfg, port, log_dir=tmp_path)
    try:
        srv.start()
        pgid = srv.pid
        with pytest.raises(ServerStartError, match=f"port {port} is already in use"):
            srv.wait_ready()  # the 420 s allowance: only the fast path can end it with this message
        assert not srv.is_running() and group_pids(pgid) == []
    finally:
        srv.stop()
        holder.close()
