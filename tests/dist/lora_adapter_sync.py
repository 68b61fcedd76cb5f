"""torchrun --nproc-per-node 2 tests/dist/lora_adapter_sync.py --hf-dir H --adapters A.pt --servers URL --work-dir W --out W/results.json

Adapter-only weight sync (areal_mega/weight_sync/lora_sync.py) into a real SGLang CPU server
started with --enable-lora: an fp32 TP2 learner with PEFT's random adapters (A.pt, halved for
version 1) syncs version 1, then the real adapters as version 2 (replacing version 1's adapter
under the same name). Rank 0 records the server's log-probs and greedy continuations with the
adapter and without it (the control), the learner's log-probs, versions, and the sync stats.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.megatron.lora import LoraConfig, apply_lora, load_peft_state
from areal_mega.megatron.model import MegatronModelConfig, build_model, load_hf_weights
from areal_mega.megatron.parallel_state import init_model_parallel
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.weight_sync.lora_sync import ADAPTER, LoraAdapterSync
from tests.dist.wsync_tp2pp2 import SEQS, learner_logprobs, server_state
from tests.support.dist import servers_paused

NEW = 6


def server_greedy(url: str, lora: str | None) -> list[list[int]]:
    import urllib.request

    out = []
    for s in SEQS:
        body = {"input_ids": s, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0}}
        if lora is not None:
            body["lora_path"] = lora
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(json.loads(r.read())["output_ids"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--hf-dir", "--adapters", "--servers", "--work-dir", "--out"):
        ap.add_argument(a, required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    groups = init_model_parallel(ParallelLayout.build(ParallelConfig(tensor_parallel=2), 2), backend="gloo", seed=1)
    model = build_model(args.hf_dir, groups, MegatronModelConfig(dtype="float32", layer_spec="local",
                                                                 sequence_parallel=False))
    load_hf_weights(model, args.hf_dir)
    ref = torch.load(args.adapters)
    apply_lora(model, LoraConfig(**ref["lora"]))
    server = SGLangClient(args.servers, timeout_s=120)
    ws = LoraAdapterSync(model, servers=[server], base_model=args.hf_dir)
    res: dict = {"sync": []}
    for version, scale in ((1, 0.5), (2, 1.0)):  # version 2 replaces version 1's adapter
        load_peft_state(model, {k: v * scale for k, v in ref["adapters"].items()})
        with servers_paused([server]):
            st = ws.sync(version)
        res["sync"].append({"version": version, "bytes": st.bytes, "seconds": st.seconds, "phase_s": st.phase_s})
    lp = learner_logprobs(model)
    if dist.get_rank() == 0:
        res["learner"] = lp
        res["with_adapter"] = server_state([args.servers], lora=ADAPTER)[0]
        res["without_adapter"] = server_state([args.servers])[0]
        res["greedy_with"] = server_greedy(args.servers, ADAPTER)
        res["greedy_without"] = server_greedy(args.servers, None)
        with open(args.out, "w") as f:
            json.dump(res, f)
    ws.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
