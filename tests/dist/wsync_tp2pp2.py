"""TP2 x PP2 megatron learner (4 gloo ranks) -> running SGLang servers: every weight-sync check
that needs a real learner, in ONE torchrun launch (driven by tests/test_weight_sync_sglang.py).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 4 \
        tests/dist/wsync_tp2pp2.py --hf-dir M --servers URL1,URL2 --work-dir D --out R.json

Steps (rank 0 queries the servers between steps and writes everything to --out):
  0. servers' log-probs / version as started (version "0");
  1. a learner built from a MISMATCHED config (vocab 640) syncs: must fail before sending;
  2. deterministic perturbation (no optimizer: see perturb), distributed sync as version 1;
     the learner's own log-probs (forward through both stages) are recorded;
  3. second perturbation, DISK sync as version 2 (safetensors via the same export path);
  4. the v2 weights saved as a megatron checkpoint and converted to HF by
     tools/convert_mcore_to_hf.py at TP1 x PP2;
  5. an INTERLEAVED learner (TP2 x PP2 x VPP2, one layer per virtual stage) loads that checkpoint,
     is perturbed and syncs as version 3 (two model chunks per stage sender); then it reloads the
     checkpoint and syncs it as version 4, so the servers end with the v2 weights that the
     greedy-continuation test compares against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import urllib.request

from pathlib import Path

import torch
import torch.distributed as dist

from areal_mega.megatron.checkpoint import load_checkpoint, save_checkpoint
from areal_mega.megatron.model import MegatronModelConfig, build_model, forward_logits, load_hf_weights
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.weight_sync import PlanMismatchError, WeightSyncConfig, megatron_weight_sync
from tests.support.dist import finish, servers_paused

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import convert_mcore_to_hf  # noqa: E402  (a script in tools/, not a package)

# Fixed token sequences (vocab 512), packed into one row for the learner.
SEQS = [
    [5, 17, 99, 3, 250, 8, 77, 41, 300, 12, 9, 500],
    [101, 102, 103, 104, 105, 106, 107, 108],
    [7, 7, 7, 400, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
]


def perturb(model, step: int) -> None:
    """Deterministic stand-in for an optimizer step: p += 0.02 * sin(1000 * p + step).

    A function of each value only, so TP-replicated parameters stay identical across TP ranks and
    the tied output-layer copy on the last stage stays equal to the stage-0 embedding (what
    megatron's embedding-group all-reduce guarantees after a real step).
    """
    with torch.no_grad():
        for chunk in model.chunks:
            for p in chunk.parameters():
                p.add_((0.02 * torch.sin(1000.0 * p.float() + step)).to(p.dtype))


def learner_logprobs(model) -> dict | None:
    """{"logprobs": log p(x_t | x_<t) for t >= 1 of every sequence, "logit_scale": max |logits|}
    (the last stage returns it, else None); the scale sizes the test's bf16 tolerance."""
    ids = torch.tensor([t for s in SEQS for t in s])
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(s) for s in SEQS]), 0)))
    logits = forward_logits(model, ids, cu)
    if logits is None:
        return None
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for i, s in enumerate(SEQS):
        a = int(cu[i])
        out.append([float(logp[a + t - 1, s[t]]) for t in range(1, len(s))])
    return {"logprobs": out, "logit_scale": float(logits.abs().max())}


def server_state(urls: list[str], lora: str | None = None) -> list[dict]:
    """Per server: weight_version and input-token log-probs of SEQS (t >= 1) (``lora``: with the
    adapter loaded under that name)."""
    res = []
    for u in urls:
        lps = []
        for s in SEQS:
            body = {
                "input_ids": s,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            if lora is not None:
                body["lora_path"] = lora
            req = urllib.request.Request(u + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                meta = json.loads(r.read())["meta_info"]
            lps.append([x[0] for x in meta["input_token_logprobs"][1:]])
        res.append({"version": SGLangClient(u).weight_version(), "logprobs": lps})
    return res


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[wsync_tp2pp2] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    urls = args.servers.split(",")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1)
    mcfg = MegatronModelConfig(dtype="bfloat16")
    model = build_model(args.hf_dir, groups, mcfg)
    load_hf_weights(model, args.hf_dir)
    servers = [SGLangClient(u, timeout_s=120) for u in urls]
    cfg = WeightSyncConfig(backend="gloo", bucket_mib=0.25, master_address="127.0.0.1")
    res: dict = {"plan": None}
    if rank == 0:
        res["v0"] = server_state(urls)

    log("model loaded")
    # 1. mismatched learner (vocab 640 instead of 512): refused before anything is sent.
    bad = build_model(dict(load_hf_config(args.hf_dir), vocab_size=640), groups, mcfg)
    ws_bad = megatron_weight_sync(cfg, adapter=bad.adapter, chunks=bad.chunks, groups=groups, servers=servers,
                                  pause_mode="retract")
    try:
        with servers_paused(servers):
            ws_bad.sync(1)
        res["mismatch_error"] = None
    except PlanMismatchError as e:
        res["mismatch_error"] = str(e)
    if rank == 0:
        res["after_mismatch"] = server_state(urls)

    log("mismatch checked")
    # 2. distributed sync of perturbed weights as version 1.
    perturb(model, 1)
    ws = megatron_weight_sync(cfg, adapter=model.adapter, chunks=model.chunks, groups=groups, servers=servers,
                              pause_mode="retract")
    res["plan"] = ws.plan.summary()
    with servers_paused(servers):
        stats = ws.sync(1)
    res["sync1"] = {"bytes": stats.bytes, "seconds": stats.seconds, "buckets": stats.num_buckets, "phases": stats.phase_s}
    log("sync 1 done")
    lp1 = learner_logprobs(model)
    if rank == 0:
        res["v1"] = server_state(urls)

    log("server state v1 read")
    # 1b. a mismatch once connected: the check then runs beside the opening of the update session
    # (sync.py), which the failed sync must close -- the servers, continued by servers_paused,
    # must serve untouched (the state read below would hang otherwise).
    right = ws.learner
    ws.learner = dataclasses.replace(right, expected_fn=lambda hf: right.expected_fn(dict(hf, vocab_size=640)))
    try:
        with servers_paused(servers):
            ws.sync(7)
        res["connected_mismatch_error"] = None
    except PlanMismatchError as e:
        res["connected_mismatch_error"] = str(e)
    ws.learner = right
    if rank == 0:
        res["after_connected_mismatch"] = server_state(urls)
    log("connected mismatch checked")
    # 3. disk fallback: another perturbation, version 2.
    perturb(model, 2)
    dcfg = WeightSyncConfig(mode="disk", disk_dir=os.path.join(args.work_dir, "disk"))
    ws_disk = megatron_weight_sync(dcfg, adapter=model.adapter, chunks=model.chunks, groups=groups, servers=servers,
                                   pause_mode="abort")
    with servers_paused(servers, "abort"):
        stats2 = ws_disk.sync(2)
    res["sync2"] = {"bytes": stats2.bytes, "seconds": stats2.seconds}
    log("disk sync done")
    lp2 = learner_logprobs(model)
    if rank == 0:
        res["v2"] = server_state(urls)
        res["disk_dir"] = os.path.join(args.work_dir, "disk", "v2")

    # 4. the learner's v2 weights as a megatron checkpoint, converted back to HF with the
    #    conversion tool (in another layout, TP1 x PP2): the test compares its greedy output.
    ckpt = os.path.join(args.work_dir, "ckpt_v2")
    save_checkpoint(model, ckpt, step=2, version=2, source_hf_dir=args.hf_dir)

    # The last stage's logits are replicated over its TP ranks: collect rank 2's on rank 0.
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (lp1, lp2))
    if rank == 0:
        d1, d2 = got[layout.rank(pp=1)]
        res["learner_v1"], res["learner_v2"] = d1["logprobs"], d2["logprobs"]
        res["logit_scale"] = {"v1": d1["logit_scale"], "v2": d2["logit_scale"]}
    ws.close()
    destroy_model_parallel(groups)
    converted = os.path.join(args.work_dir, "converted_v2")
    convert_mcore_to_hf.main(["--ckpt", ckpt, "--out", converted, "--tp", "1", "--pp", "2"])
    log("converted")

    # 5. interleaved-pipeline learner: v3 (perturbed), then v4 = the v2 weights again.
    vlayout = ParallelLayout.build(
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline_parallel=2), dist.get_world_size()
    )
    vgroups = init_model_parallel(vlayout, backend="gloo", seed=1)
    vmodel = build_model(args.hf_dir, vgroups, mcfg)
    load_checkpoint(vmodel, ckpt)
    perturb(vmodel, 3)
    wsv = megatron_weight_sync(cfg, adapter=vmodel.adapter, chunks=vmodel.chunks, groups=vgroups, servers=servers,
                               pause_mode="retract")
    res["plan_vpp"] = wsv.plan.summary()
    with servers_paused(servers):
        wsv.sync(3)
    lp3 = learner_logprobs(vmodel)
    if rank == 0:
        res["v3"] = server_state(urls)
    load_checkpoint(vmodel, ckpt)
    with servers_paused(servers):
        wsv.sync(4)
    if rank == 0:
        res["v4"] = server_state(urls)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, lp3)
    if rank == 0:
        d3 = got[vlayout.rank(pp=1)]
        res["learner_v3"], res["logit_scale"]["v3"] = d3["logprobs"], d3["logit_scale"]
    wsv.close()
    destroy_model_parallel(vgroups)
    log("interleaved learner synced")
    if rank == 0:
        res["converted_dir"] = converted
    finish(res, args.out)


if __name__ == "__main__":
    main()
