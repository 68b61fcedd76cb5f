"""EP2 Qwen3-MoE megatron learner (2 gloo ranks) -> a running SGLang server: live weight sync of
EP-sharded experts (driven by tests/test_weight_sync_moe.py).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 \
        tests/dist/wsync_moe.py --hf-dir M --servers URL --work-dir D --out R.json

Rank 1 holds experts 4-7 of every layer (dp=1, ep=1): it takes part in the export and sends
each of its experts once, point-to-point, to the stage's sender (rank 0), which broadcasts the
buckets to the server. Steps: 0. the server's log-probs as started; 1. a deterministic
perturbation (tests/dist/wsync_tp2pp2.py:perturb), distributed sync as version 1, the learner's
own log-probs; rank 0 writes everything to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from areal_mega.inference.sglang_api import SGLangClient  # noqa: E402
from areal_mega.megatron.model import MegatronModelConfig, build_model, load_hf_weights  # noqa: E402
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel  # noqa: E402
from areal_mega.parallel import ParallelConfig, ParallelLayout  # noqa: E402
from areal_mega.weight_sync import WeightSyncConfig, megatron_weight_sync  # noqa: E402
from tests.dist.wsync_tp2pp2 import learner_logprobs, perturb, server_state  # noqa: E402
from tests.support.dist import finish  # noqa: E402


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
    layout = ParallelLayout.build(ParallelConfig(expert_parallel=2), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1)
    model = build_model(args.hf_dir, groups, MegatronModelConfig(dtype="bfloat16"))
    load_hf_weights(model, args.hf_dir)
    res: dict = {}
    if rank == 0:
        res["v0"] = server_state(urls)
    perturb(model, 1)
    cfg = WeightSyncConfig(backend="gloo", bucket_mib=0.25, master_address="127.0.0.1")
    ws = megatron_weight_sync(cfg, adapter=model.adapter, chunks=model.chunks, groups=groups,
                              servers=[SGLangClient(u, timeout_s=120) for u in urls], pause_mode="retract")
    res["plan"] = ws.plan.summary()
    stats = ws.sync(1)
    res["sync1"] = {"bytes": stats.bytes, "seconds": stats.seconds, "buckets": stats.num_buckets}
    lp1 = learner_logprobs(model)  # forward on both ranks (the experts' all-to-all needs both)
    if rank == 0:
        res["v1"] = server_state(urls)
        res["learner_v1"], res["logit_scale"] = lp1["logprobs"], lp1["logit_scale"]
        res["expert_tensors"] = sum(".mlp.experts." in t.name for t in ws.plan.tensors)
    ws.close()
    destroy_model_parallel(groups)
    finish(res, args.out)


if __name__ == "__main__":
    main()
