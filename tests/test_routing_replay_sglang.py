"""MoE routing replay, server side: a real SGLang CPU server started with route capture
(``capture_routes``; SGLang CPU shim entry 2 makes it start) returns, through the product's pool,
the experts its router chose for every fed token -- checked per (token, layer) against HF's
router top-k on the same sequence (fp32 on both sides, so only near-ties may differ).

Negative control: the same routes compared one position off (the alignment the learner relies on)
disagree on most rows. Needs AREAL_MEGA_SGLANG_PYTHON (set by `make test`).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_mega.api.io import GenerationRequest, SamplingParams
from areal_mega.inference.client import InferencePool
from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from tests.support.launch import SGLANG_PYTHON, needs_sglang
from tests.support.models import save_tiny_model
from tests.test_weight_sync_moe import MOE_SYNC

pytestmark = [pytest.mark.slow, needs_sglang]
LAYERS, TOPK = MOE_SYNC["num_hidden_layers"], MOE_SYNC["num_experts_per_tok"]


def _hf_topk(hf_dir, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router top-k [len(ids), layers, k] for one sequence, and each (token, layer)'s gap
    between the k-th and (k+1)-th router probability (near-ties: the only place two fp32
    kernels may legitimately choose differently)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = m(torch.tensor([ids]), output_router_logits=True)
    probs = [torch.softmax(lg.float(), -1) for lg in out.router_logits]  # per layer [len, E]
    idx = torch.stack([p.topk(TOPK, -1).indices for p in probs], 1)
    vals = torch.stack([p.topk(TOPK + 1, -1).values for p in probs], 1)
    return idx, vals[..., TOPK - 1] - vals[..., TOPK]


def test_server_routes_are_the_routers_top_k(tmp_path):
    hf = save_tiny_model(tmp_path / "moe", "qwen3_moe", dtype="float32", **MOE_SYNC)
    cfg = InferenceConfig(num_servers=1, server=SGLangServerConfig(
        python=SGLANG_PYTHON, model_path=str(hf), device="cpu", dtype="float32", max_total_tokens=4096,
        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900, log_dir=str(tmp_path / "logs")))
    prompts = [[3, 17, 99, 5, 8], [250, 1, 1, 42], list(range(20, 40))]

    async def go():
        pool = await InferencePool.launch(cfg, capture_routes=True)
        try:
            return await asyncio.gather(*[pool.agenerate(GenerationRequest(p, SamplingParams(max_new_tokens=6, temperature=0)))
                                          for p in prompts])
        finally:
            await pool.close()

    results = asyncio.run(go())
    same = total = shifted_same = 0
    for res in results:
        fed = res.input_ids + res.output_ids[:-1]
        assert res.routes is not None and res.routes.shape == (len(fed), LAYERS * TOPK), res.routes.shape
        srv = torch.from_numpy(res.routes.astype("int64")).view(len(fed), LAYERS, TOPK).sort(-1).values
        hf_idx, gap = _hf_topk(str(hf), fed)
        hf_idx = hf_idx.sort(-1).values
        agree = (srv == hf_idx).all(-1)  # [tokens, layers]
        # a disagreement is allowed only at a near-tie (fp32 kernels of different reduction order)
        assert bool((agree | (gap < 1e-4)).all()), (agree, gap)
        same += int(agree.sum())
        total += agree.numel()
        shifted_same += int((srv[1:] == hf_idx[:-1]).all(-1).sum())
    print(f"server routes = HF top-{TOPK} on {same}/{total} (token, layer) pairs; one position off: {shifted_same}")
    assert same >= 0.95 * total
    assert shifted_same < 0.5 * total  # negative control: misaligned routes are caught
