"""A TP3 megatron learner of SmolLM2-135M-Instruct (3 gloo ranks, fp32) -> two real SGLang CPU
servers, one serving bf16 and one fp32 (driven by tests/test_smollm2.py):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 3 \
        tests/dist/smollm2_wsync_tp3.py --work-dir D --out R.json --model M --bf16 URL --fp32 URL

Per server: its log-probs of the real text (tests/dist/smollm2_layouts.py) as started (v0), then
the learner's weights perturbed deterministically (p += 0.002 sin(1000 p + 1), a function of each
value only, so TP-replicated and tied copies stay equal) and synced as version 1 in the server's
own dtype (the trainer's wire dtype = inference.server.dtype), then the server's log-probs again
and the learner's own (fp32, TP3), for the pytest side to compare.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import torch
import torch.distributed as dist

from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.megatron.model import MegatronModelConfig, build_model, forward_logits, load_hf_weights
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.weight_sync import WeightSyncConfig, megatron_weight_sync
from tests.dist.smollm2_layouts import real_text
from tests.support.dist import servers_paused


def server_logprobs(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        meta = json.loads(r.read())["meta_info"]
    return {"version": SGLangClient(url).weight_version(), "logprobs": [x[0] for x in meta["input_token_logprobs"][1:]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--work-dir", "--out", "--model", "--bf16", "--fp32"):
        ap.add_argument(a, required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    ids = real_text(args.model)
    urls = {"bfloat16": args.bf16, "float32": args.fp32}
    res: dict = {"num_tokens": len(ids)}
    if dist.get_rank() == 0:
        res["v0"] = {k: server_logprobs(u, ids) for k, u in urls.items()}
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=3), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1)
    model = build_model(args.model, groups, MegatronModelConfig(dtype="float32"))
    load_hf_weights(model, args.model)
    with torch.no_grad():
        for chunk in model.chunks:
            for p in chunk.parameters():
                p.add_(0.002 * torch.sin(1000.0 * p + 1.0))
    cfg = WeightSyncConfig(backend="gloo", bucket_mib=64, master_address="127.0.0.1")
    res["sync"] = {}
    for dtype, url in urls.items():
        ws = megatron_weight_sync(cfg, adapter=model.adapter, chunks=model.chunks, groups=groups,
                                  servers=[SGLangClient(url, timeout_s=300)], dtype=dtype,
                                  pause_mode="retract")
        with servers_paused(ws.servers):
            st = ws.sync(1)
        res["sync"][dtype] = {"bytes": st.bytes, "seconds": st.seconds}
        ws.close()
    logits = forward_logits(model, torch.tensor(ids), torch.tensor([0, len(ids)]))
    if dist.get_rank() == 0:  # TP3, PP1: every rank holds the gathered logits
        logp = torch.log_softmax(logits.float(), -1)
        res["learner_v1"] = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
        res["logit_scale"] = float(logits.abs().max())
        res["v1"] = {k: server_logprobs(u, ids) for k, u in urls.items()}
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    destroy_model_parallel(groups)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
