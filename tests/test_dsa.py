"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): DeepSeek sparse attention on MLA in
megatron-core 0.16.1 (DSAIndexer inside areal_mega's PackedDSAttention; compat entry 15) vs
transformers 5.19, fp32, CPU.

Every sequence is longer than index_topk, so the indexer really drops keys: the controls show
that (the same weights with the indexer's top-k >= the sequence, i.e. dense attention, are far
off HF's sparse model) and that the indexer's head-row permutation matters (loaded unpermuted:
far off).

* make test: V3.2 at TP1 in this process (log-probs, controls, export bit-exact, parameter
  counts = transformers', the indexer frozen and out of the optimizer's reach).
* make test-families-serve (marker families_serve): TP2 (SP), PP2, EP2 for V3.2 and GLM-5 in one
  2-rank launch (tests/dist/dsa_layouts.py), the conversion tools' round trip, the sync stream
  loaded by SGLang's own DeepseekV32 model class (no server: SGLang cannot serve DSA on CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

LENS = [7, 13, 4, 10]  # > TOPK except one: sparsity selects in three of four sequences
TOPK = 5
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
              max_position_embeddings=256, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
              head_dim=8, v_head_dim=12, index_topk=TOPK, index_head_dim=16, index_n_heads=4, noise=0.1)
MODELS = {
    # V3.2 shape: YaRN with mscale_all_dim (the softmax scale and the indexer's RoPE change), 4 groups
    # of 2 experts keep 2, routed scaling, a dense first layer
    "deepseek_v32": dict(family="deepseek_v32", num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, noise_seed=6,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                              mscale=1.0, mscale_all_dim=1.0)),
    # GLM-5 shape: no expert groups, rms_norm_eps 1e-5 (the indexer's LayerNorm keeps 1e-6), plain RoPE
    "glm_moe_dsa": dict(family="glm_moe_dsa", num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                        routed_scaling_factor=2.5, rms_norm_eps=1e-5, noise_seed=7),
}


def tiny(name: str):
    from tests.support.models import tiny_model

    m = tiny_model(**MODELS[name], **COMMON)
    m.config._attn_implementation = "eager"
    return m


def packed_reference(m, seed: int = 3) -> dict:
    """HF logits of LENS random sequences, each run alone."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(LENS),), generator=g)
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    with torch.no_grad():
        logits = torch.cat([m(input_ids=ids[cu[i]: cu[i + 1]][None]).logits[0] for i in range(len(LENS))])
    return {"input_ids": ids, "cu_seqlens": cu, "logits": logits.float()}


def logprob_tol(ref_logits: torch.Tensor) -> float:
    """fp32 log-probs of the same weights two ways (megatron packed, any layout, vs HF per
    sequence): 2 layers' reductions of up to K = 128 terms (MLP 96, shared expert 32, attention
    4 x 24, the indexer's 4 heads x 16) relative to the largest |logit| (tests/support/numerics.py),
    x 2 for the log-softmax (|d log p| <= 2 max |d logit|). The indexer's top-k is discrete: a
    flipped near-tie moves a token by O(1) and fails the bound, which is the point."""
    from tests.support.numerics import fp32_tol, transformer_reductions

    return 2 * fp32_tol(128, float(ref_logits.abs().max()), ops=transformer_reductions(2) - 1)


def unpermuted(adapter_cls):
    """Control: ``adapter_cls`` loading the indexer's rows in HF's order (no head permutation)."""

    class Unpermuted(adapter_cls):
        @property
        def _perm(self):
            return torch.arange(self.arch.dsa.index_head_dim)

    return Unpermuted


@pytest.fixture(scope="module", autouse=True)
def _world_released():
    """This module's megatron world of one is torn down after it (later modules expect none)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    had_group = dist.is_initialized()
    yield
    if not had_group:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_v32_tp1_logprobs_match_hf_sparse_and_controls(tmp_path):
    """deepseek_v32 through the registry at TP1 (build_model / load_hf_weights / export_hf_weights):
    four sequences packed in one row vs each alone in HF; controls: dense attention (index_topk
    past every sequence) and the indexer rows unpermuted, both far off."""
    from megatron.core import parallel_state as ps

    from areal_mega.megatron import cpu_compat
    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, export_hf_weights, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel, init_process_group_for_script
    from areal_mega.models import get_adapter, load_hf_config
    from areal_mega.models.dsa import DeepseekV32Adapter
    from areal_mega.parallel import ParallelLayout
    from tests.support.models import packed_logprobs

    hf = tiny("deepseek_v32")
    hf.save_pretrained(tmp_path)
    ref = packed_reference(hf)
    ids, cu = ref["input_ids"], ref["cu_seqlens"]
    cpu_compat.apply()
    init_process_group_for_script()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if ps._GLOBAL_MEMORY_BUFFER is not None:  # set alone by an earlier test (test_core_attention)
        ps.destroy_global_memory_buffer()
    groups = init_model_parallel(ParallelLayout(world_size=1), backend="gloo")
    try:
        with pytest.raises(ValueError, match="^actor.model.layer_spec: te is not supported for deepseek_v32"):
            build_model(tmp_path, groups, MegatronModelConfig(layer_spec="te"))
        model = build_model(tmp_path, groups, MegatronModelConfig())
        load_hf_weights(model, tmp_path)
        (mc,) = model.chunks
        pad = 2 * (model.padded_vocab_size - VOCAB) * 64  # zero vocab-padding rows of embedding + output layer
        assert sum(p.numel() for p in mc.parameters()) - pad == sum(p.numel() for p in hf.parameters())
        frozen = {n for n, p in mc.named_parameters() if not p.requires_grad}
        assert frozen and all(".core_attention.indexer." in n for n in frozen)
        assert len(frozen) == 5 * 2  # wq_b, wk, k_norm weight + bias, weights_proj; 2 layers
        disk = HFCheckpointReader(tmp_path)
        out = dict(export_hf_weights(model))
        assert sorted(out) == sorted(disk.names()) and all(torch.equal(out[n], disk.read(n)) for n in out)
        hf_lp = packed_logprobs(ref["logits"], ids, cu)
        tol = logprob_tol(ref["logits"])

        def err(m):
            return (packed_logprobs(forward_logits(m, ids, cu), ids, cu) - hf_lp).abs().max().item()

        e = err(model)
        cfg = load_hf_config(tmp_path)
        dense = build_model(tmp_path, groups, adapter=get_adapter({**cfg, "index_topk": max(LENS)}))
        load_hf_weights(dense, tmp_path)
        bad_dense = err(dense)
        swapped = build_model(tmp_path, groups, adapter=unpermuted(DeepseekV32Adapter)(cfg))
        load_hf_weights(swapped, tmp_path)
        bad_perm = err(swapped)
        print(f"deepseek_v32 TP1 packed log-probs: max|mc-hf|={e:.2e} bound={tol:.2e}; controls: dense "
              f"{bad_dense:.2e}, indexer rows unpermuted {bad_perm:.2e}")
        assert e <= tol
        assert bad_dense > 100 * tol and bad_perm > 100 * tol
    finally:
        destroy_model_parallel(groups)
