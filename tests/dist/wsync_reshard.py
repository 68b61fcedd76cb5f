"""A megatron learner (TP2 x PP2 or TP2 dense, or EP2 Qwen3-MoE) reshards its weights into a running TP2
SGLang CPU server with the receiver (driven by tests/test_weight_sync_reshard_sglang.py).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 4 \
        tests/dist/wsync_reshard.py --layout tp2pp2 --hf-dir V1 --servers URL --work-dir D --out R.json

The learner loads the v1 checkpoint (the test wrote v1 = a deterministic perturbation of the
server's v0); rank 0 records the server as started (v0: the unsynced control), then one
weight_sync.mode reshard sync as version 1, the server's log-probs and greedy continuations, the
learner's own log-probs and the plan's bytes per engine rank; then a second sync (v2, same
weights: the group is reused, nothing re-planned) and the server once more. Before them, a plan
naming a parameter the engine lacks is refused by the engines' check (nothing sent); after them,
the same server described without the receiver is synced by broadcast instead (v3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from areal_mega.inference.sglang_api import SGLangClient  # noqa: E402
from areal_mega.megatron.model import MegatronModelConfig, build_model, load_hf_weights  # noqa: E402
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel  # noqa: E402
from areal_mega.parallel import ParallelConfig, ParallelLayout  # noqa: E402
from areal_mega.weight_sync import PlanMismatchError, WeightSyncConfig, megatron_weight_sync  # noqa: E402
from tests.dist.wsync_tp2pp2 import SEQS, learner_logprobs, server_state  # noqa: E402
from tests.support.dist import finish, servers_paused  # noqa: E402

LAYOUTS = {"tp2pp2": ParallelConfig(tensor_parallel=2, pipeline_parallel=2), "ep2": ParallelConfig(expert_parallel=2),
           "tp2": ParallelConfig(tensor_parallel=2)}


class NoReceiver(SGLangClient):
    """The same server, as one without the receiver would describe itself."""

    def capabilities(self, refresh: bool = False):
        return dataclasses.replace(super().capabilities(refresh), custom_weight_loaders=())


def greedy(url: str, n: int = 8) -> list[list[int]]:
    out = []
    for s in SEQS:
        body = {"input_ids": s, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(json.loads(r.read())["output_ids"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    urls = args.servers.split(",")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = ParallelLayout.build(LAYOUTS[args.layout], dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1)
    model = build_model(args.hf_dir, groups, MegatronModelConfig(dtype="bfloat16"))
    load_hf_weights(model, args.hf_dir)
    res: dict = {}
    if rank == 0:
        res["v0"] = server_state(urls)
        res["greedy_v0"] = [greedy(u) for u in urls]
    cfg = WeightSyncConfig(mode="reshard", backend="gloo", bucket_mib=0.25, master_address="127.0.0.1")
    # 1. a plan whose SGLang layout names a parameter the engine lacks: every engine rank's check
    # refuses it before any weight is sent; the server keeps serving v0.
    real = model.adapter.sglang_layout

    def renamed(b) -> None:
        real(b)
        b.out[-1] = dataclasses.replace(b.out[-1], name=b.out[-1].name + "_renamed")

    model.adapter.sglang_layout = renamed  # this adapter only; the family's class keeps the real one
    bad = megatron_weight_sync(cfg, adapter=model.adapter, chunks=model.chunks, groups=groups,
                               servers=[SGLangClient(u, timeout_s=300) for u in urls], pause_mode="retract")
    try:
        with servers_paused(bad.servers):
            bad.sync(1)
        res["engine_mismatch"] = None
    except PlanMismatchError as e:
        res["engine_mismatch"] = str(e)
    finally:
        del model.adapter.sglang_layout
        bad.close()
    if rank == 0:
        res["after_mismatch"] = server_state(urls)
    ws = megatron_weight_sync(cfg, adapter=model.adapter, chunks=model.chunks, groups=groups,
                              servers=[SGLangClient(u, timeout_s=300) for u in urls], pause_mode="retract")
    with servers_paused(ws.servers):
        stats = ws.sync(1)
    plan = ws._reshard.plan if ws._reshard is not None else None
    res["sync1"] = {"mode": stats.mode, "bytes": stats.bytes, "seconds": stats.seconds, "phases": stats.phase_s,
                    "bytes_per_engine_rank": stats.bytes_per_engine_rank,
                    "shard_bytes": {f"{urls[i]}/{r}": b for (i, r), b in plan.shard_bytes.items()} if plan else {},
                    "sent_by_rank": plan.bytes_per_learner_rank() if plan else {}}
    lp1 = learner_logprobs(model)  # every rank runs the forward (PP / the experts' all-to-all)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lp1)
    lp1 = next(x for x in gathered if x is not None)
    if rank == 0:
        res["v1"] = server_state(urls)
        res["greedy_v1"] = [greedy(u) for u in urls]
        res["learner_v1"], res["logit_scale"] = lp1["logprobs"], lp1["logit_scale"]
    # v2 = 0.9 v1, written in place (as an optimizer step does): the second sync reuses the
    # sender's and the receiver's cached views, which must read the new values.
    with torch.no_grad():
        for chunk in model.chunks:
            for prm in chunk.parameters():
                prm.copy_((prm.float() * 0.9).to(prm.dtype))
    lp2 = learner_logprobs(model)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lp2)
    lp2 = next(x for x in gathered if x is not None)
    with servers_paused(ws.servers):
        stats2 = ws.sync(2)
    res["sync2"] = {"mode": stats2.mode, "seconds": stats2.seconds, "phases": stats2.phase_s}
    if rank == 0:
        res["v2"] = server_state(urls)
        res["learner_v2"] = lp2["logprobs"]
    ws.close()
    # 3. a server that does not report the receiver: the sync falls back to broadcast (one line).
    nr = megatron_weight_sync(cfg, adapter=model.adapter, chunks=model.chunks, groups=groups,
                              servers=[NoReceiver(u, timeout_s=300) for u in urls], pause_mode="retract")
    with servers_paused(nr.servers):
        stats3 = nr.sync(3)
    res["fallback"] = {"mode": stats3.mode}
    if rank == 0:
        res["v3"] = server_state(urls)
    nr.close()
    destroy_model_parallel(groups)
    finish(res, args.out)


if __name__ == "__main__":
    main()
