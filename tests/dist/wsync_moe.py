"""EP2 MoE megatron learner (2 gloo ranks) -> a running SGLang server: live weight sync of
EP-sharded experts (driven by tests/test_weight_sync_moe.py for Qwen3-MoE and by
tests/test_families_serve.py for Mixtral, Qwen2-MoE, DeepSeek-V3 and GLM-4.5).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 \
        tests/dist/wsync_moe.py --hf-dir M --servers URL --work-dir D --out R.json [--export-dir E]

Rank 1 holds experts 4-7 of every layer (dp=1, ep=1): it takes part in the export and sends
each of its experts once, point-to-point, to the stage's sender (rank 0), which broadcasts the
buckets to the server. Steps: 0. the server's log-probs as started; 1. a deterministic
perturbation (tests/dist/wsync_tp2pp2.py:perturb), distributed sync as version 1, the learner's
own log-probs; rank 0 writes everything to --out. With --export-dir: the servers' greedy
continuations of PROMPTS at v0 and v1, and the learner's v1 weights saved there as an HF checkpoint
(the HF reference the test decodes greedily).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from areal_mega.inference.sglang_api import SGLangClient  # noqa: E402
from areal_mega.megatron.model import MegatronModelConfig, build_model, load_hf_weights  # noqa: E402
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel  # noqa: E402
from areal_mega.parallel import ParallelConfig, ParallelLayout  # noqa: E402
from areal_mega.weight_sync import WeightSyncConfig, megatron_weight_sync  # noqa: E402
from areal_mega.megatron.hf_export import save_hf_checkpoint  # noqa: E402
from tests.dist.wsync_tp2pp2 import learner_logprobs, perturb, server_state  # noqa: E402
from tests.support.dist import finish, servers_paused  # noqa: E402

# Greedy prompts (vocab 512) and how many tokens each continues.
PROMPTS = [[5, 17, 99, 3], [101, 102, 103], [7, 400, 1, 2, 3], [250, 8, 77, 41, 300]]
NEW_TOKENS = 8


def server_greedy(urls: list[str]) -> list[list[list[int]]]:
    """Per server, per prompt: the greedy continuation (temperature 0)."""
    out = []
    for u in urls:
        rows = []
        for p in PROMPTS:
            body = {"input_ids": p, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}
            req = urllib.request.Request(u + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                rows.append(json.loads(r.read())["output_ids"])
        out.append(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--export-dir", default="")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", default="broadcast", choices=("broadcast", "reshard"))
    ap.add_argument("--api-key-file", default="", help="servers a launch started demand its key (utils.secrets)")
    args = ap.parse_args()
    key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    if key:  # every request of this script (the helpers' urlopen calls too) carries the key
        opener = urllib.request.build_opener()
        opener.addheaders = [("Authorization", f"Bearer {key}")]
        urllib.request.install_opener(opener)
    urls = args.servers.split(",")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = ParallelLayout.build(ParallelConfig(expert_parallel=2), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1)
    model = build_model(args.hf_dir, groups, MegatronModelConfig(dtype=args.dtype))
    load_hf_weights(model, args.hf_dir)
    res: dict = {}
    if rank == 0:
        res["v0"] = server_state(urls)
        if args.export_dir:
            res["greedy_v0"] = server_greedy(urls)
    perturb(model, 1)
    cfg = WeightSyncConfig(mode=args.mode, backend="gloo", bucket_mib=0.25, master_address="127.0.0.1")
    ws = megatron_weight_sync(cfg, adapter=model.adapter, chunks=model.chunks, groups=groups,
                              servers=[SGLangClient(u, timeout_s=120, api_key=key) for u in urls], pause_mode="retract",
                              api_key=key)
    res["plan"] = ws.plan.summary()
    with servers_paused(ws.servers):
        stats = ws.sync(1)
    res["sync1"] = {"bytes": stats.bytes, "seconds": stats.seconds, "buckets": stats.num_buckets, "mode": stats.mode}
    lp1 = learner_logprobs(model)  # forward on both ranks (the experts' all-to-all needs both)
    if rank == 0:
        res["v1"] = server_state(urls)
        res["learner_v1"], res["logit_scale"] = lp1["logprobs"], lp1["logit_scale"]
        res["expert_tensors"] = sum(".experts." in t.name for t in ws.plan.tensors)
        if args.export_dir:
            res["greedy_v1"] = server_greedy(urls)
    ws.close()
    if args.export_dir:
        save_hf_checkpoint(model, args.export_dir, source_dir=args.hf_dir)
    destroy_model_parallel(groups)
    finish(res, args.out)


if __name__ == "__main__":
    main()
