"""L=$(tools/env/make_venv.sh learner) && PYTHONPATH=. $L/bin/python tools/bench_rollout_checkpoint.py --episodes 64 --max-new-tokens 4096

The cost of one rollout checkpoint (``RolloutService.checkpoint_state``, rollout.save_in_flight;
docs/resume.md): ``episodes`` single-turn episodes of ``group_size`` samples in flight on stub
SGLang servers (areal_mega/inference/fake_server.py, in this process: the client, the controller and
the stubs share one core), checkpointed ``repeats`` times once about half of their tokens are
generated. Each checkpoint aborts every request, takes the state and resumes them. Prints ONE
JSON line:

  saved_episodes, saved_calls, saved_tokens   what the last checkpoint held
  bytes, bytes_per_token                      rollout_state.json as the trainer writes it
  seconds_state_median / _max                 pause + abort + state + resume (the trainer waits)
  seconds_json_median                         serialising it (rank 0, before the write)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_mega.api.io import GenerationRequest, SamplingParams  # noqa: E402
from areal_mega.api.workflow import RolloutWorkflow, Trajectory  # noqa: E402
from areal_mega.config import from_dict  # noqa: E402
from areal_mega.inference import InferenceConfig  # noqa: E402
from areal_mega.rollout.config import RolloutConfig  # noqa: E402
from areal_mega.rollout.service import RolloutService  # noqa: E402
from areal_mega.inference.fake_server import FakeSGLang, serve  # noqa: E402


class _Samples(RolloutWorkflow):
    def __init__(self, group_size: int, max_new: int) -> None:
        self.group_size, self.max_new = group_size, max_new

    async def arun_episode(self, engine, data):
        sp = SamplingParams(max_new_tokens=self.max_new)
        rs = await asyncio.gather(*[engine.agenerate(GenerationRequest(list(data["prompt_ids"]), sp))
                                    for _ in range(self.group_size)])
        p = len(data["prompt_ids"])
        return [Trajectory(r.input_ids + r.output_ids, [0] * p + [1] * len(r.output_ids),
                           [0.0] * p + r.output_logprobs, [-1] * p + r.output_versions, 0.0, str(data["id"]))
                for r in rs]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--token-delay-s", type=float, default=0.002, help="the stubs' time per token")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(600)

    shared: dict[str, int] = {}
    fakes = [FakeSGLang(token_delay_s=args.token_delay_s, prompt_lengths=shared) for _ in range(args.servers)]
    runners, ports = zip(*[run(serve(f)) for f in fakes])
    cfg = from_dict(InferenceConfig, {"addresses": [f"127.0.0.1:{p}" for p in ports]})
    svc = RolloutService(cfg, server_wait_s=0)
    dataset = [{"id": i, "prompt_ids": [1, 2, 3 + i]} for i in range(args.episodes)]
    states, jsons, out = [], [], {}
    try:
        svc.start(_Samples(args.group_size, args.max_new_tokens), dataset,
                  RolloutConfig(batch_size=args.episodes, max_staleness=0, max_concurrent=args.episodes,
                                show_progress=False))
        half = args.episodes * args.group_size * args.max_new_tokens // 2

        async def generated() -> None:
            while sum(f.num_tokens for f in fakes) < half:
                await asyncio.sleep(0.01)

        run(generated())
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            state = svc.checkpoint_state()
            t1 = time.perf_counter()
            text = json.dumps(state["rollout"], separators=(",", ":"))
            states.append(t1 - t0)
            jsons.append(time.perf_counter() - t1)
        eps = state["rollout"]["episodes"]
        calls = [c for e in eps for c in e["calls"]]
        tokens = sum(len(c["ids"]) for c in calls)
        out = {"episodes": args.episodes, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
               "saved_episodes": len(eps), "saved_calls": len(calls), "saved_tokens": tokens,
               "bytes": len(text.encode()), "bytes_per_token": round(len(text.encode()) / max(tokens, 1), 2),
               "seconds_state_median": round(statistics.median(states), 4), "seconds_state_max": round(max(states), 4),
               "seconds_json_median": round(statistics.median(jsons), 4), "repeats": args.repeats}
    finally:
        svc.close()
        for r in runners:
            run(r.cleanup())
        loop.call_soon_threadsafe(loop.stop)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
