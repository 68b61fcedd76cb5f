"""Qwen3.5 text model at TP2 vs HF (fp32, gloo, CPU): torchrun --nproc-per-node 2 tests/dist/qwen3_5_tp.py

Each rank loads its slice (models/qwen3_5.tp_shard) of the TP1 mapping; rank 0 prints the max
log-prob difference vs HF per sequence (3 sequences packed) and a control (one rank's in_proj
z part swapped with its b/a rows -> far off)."""

if __name__ == "__main__":
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from areal_mega.megatron import cpu_compat
    from areal_mega.megatron.compat import enable_torch_gated_delta_net
    from areal_mega.megatron.parallel_state import init_process_group_for_script

    cpu_compat.apply()
    init_process_group_for_script()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from areal_mega.megatron.linear_attention import qwen3_5_block_spec
    from areal_mega.megatron.model import packed_causal_mask
    from areal_mega.models.qwen3_5 import hf_to_mcore, tp_shard
    from tests.test_qwen3_5 import CFG

    ps.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(1)
    enable_torch_gated_delta_net()
    rank = dist.get_rank()
    torch.manual_seed(0)
    hc = Qwen3_5TextConfig(**CFG)
    hc._attn_implementation = "eager"
    hf = Qwen3_5ForCausalLM(hc).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    c = hc.to_dict()
    tcfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
        normalization="RMSNorm", layernorm_epsilon=1e-6, activation_func=F.silu, gated_linear_unit=True,
        add_bias_linear=False, params_dtype=torch.float32, use_cpu_initialization=True, attention_output_gate=True,
        qk_layernorm=True, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, tensor_model_parallel_size=2)
    mc = GPTModel(tcfg, qwen3_5_block_spec(c["layer_types"]), vocab_size=384, max_sequence_length=256,
                  position_embedding_type="rope", rotary_percent=0.25, rotary_base=c["rope_parameters"]["rope_theta"],
                  share_embeddings_and_output_weights=False).eval()
    missing, unexpected = mc.load_state_dict(tp_shard(hf_to_mcore(hf.state_dict(), c, 384), c, 2, rank), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    torch.manual_seed(3)
    ids = [torch.randint(0, 300, (n,)) for n in (7, 40, 13)]
    mask = packed_causal_mask(torch.tensor([0, 7, 47, 60]))

    def lp():
        logits = gather_from_tensor_model_parallel_region(mc(torch.cat(ids)[None], None, mask))
        return torch.log_softmax(logits[0, :, :300], -1)

    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(x[None]).logits[0], -1) for x in ids])
        err = (lp() - ref).abs().max().item()
        w = mc.decoder.layers[0].self_attention.in_proj.weight
        if rank == 1:
            w.data.copy_(w.data.flip(0))  # control: one rank's fused in_proj rows mis-ordered
        bad = (lp() - ref).abs().max().item()
    if rank == 0:
        print(f"QWEN35_TP2 err={err:.3e} control={bad:.3e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
