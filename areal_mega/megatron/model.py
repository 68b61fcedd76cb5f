"""Build megatron-core GPT models from an HF config, load HF weights, run a packed forward.

    groups = init_model_parallel(layout, backend="gloo")
    model = build_model(hf_config, groups, MegatronModelConfig(dtype="bfloat16"))
    load_hf_weights(model, hf_dir)                      # any TP/PP layout
    logits = forward_logits(model, groups, input_ids, cu_seqlens)   # last stage; None elsewhere

A *packed* batch is several variable-length sequences concatenated into one row of length T.
:func:`packed_causal_mask` builds the block-diagonal causal mask (megatron convention:
True = masked). Positions do not restart per sequence: GPTModel derives RoPE from the row length
and RoPE only encodes relative offsets in q.k, so with the mask each sequence sees exactly what
it would see alone (checked against per-sequence HF logits in tests/test_megatron_model.py).
"""

from __future__ import annotations

import importlib
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F

from areal_mega.megatron import compat, cpu_compat
from areal_mega.batching.packing import ContextShard, context_shard, cp_padded_length
from areal_mega.megatron.attention import with_core_attention
from areal_mega.megatron.context_parallel import context_inputs, gather_tokens, packed_seq_params
from areal_mega.megatron.parallel_state import ModelParallelGroups, tp_all_gather
from areal_mega.kinds import resolve
from areal_mega.models import get_adapter, load_hf_config
from areal_mega.models.base import ExpertExport, ModelAdapter, ModelArch, StagePlan, padded_vocab_size, torch_dtype
from areal_mega.models.hf_checkpoint import HFCheckpointReader


@dataclass
class MegatronModelConfig:
    """How to instantiate the megatron model (the HF config fixes the architecture)."""

    family: str = ""
    """The model family's adapter (HF <-> megatron mapping, SGLang layout): "" = the one registered
    for the HF config's ``model_type`` (areal_mega/models/registry.py), or "package.module:Adapter",
    a ``ModelAdapter`` subclass of your own (docs/layout.md "Adding a model family")."""
    layer_spec: Literal["auto", "local", "te"] = "auto"
    """Transformer layer implementation: "te" = transformer-engine spec, "local" = megatron's
    torch modules (get_gpt_layer_local_spec; the only one that works on CPU), "auto" = "te" when
    transformer_engine imports, else "local"."""
    dtype: str | None = None
    """Parameter dtype: "float32", "bfloat16" or "float16"; None = the HF checkpoint's dtype."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of lcm(this, tp) (padding rows are zero, logits past
    vocab_size must be ignored). Keep it a multiple of every tp you will load the checkpoint at."""
    hidden_dropout: float = 0.0
    """Dropout after attention/MLP (HF Llama/Qwen2 use 0)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    moe_aux_loss_coef: float = 0.0
    """MoE load-balancing loss coefficient (megatron's moe_aux_loss_coeff, "aux_loss" type:
    E * sum_e f_e * p_e per micro-batch, added to the gradient only, not to the reported loss).
    0 = off (RL fine-tuning usually keeps the pretrained router as is); HF's router_aux_loss_coef
    in the config is NOT applied implicitly. Tokens are never dropped (no expert capacity), so
    every layout computes the same function."""
    moe_routing_replay: Literal["off", "observe", "rollout", "proximal"] = "off"
    """MoE routing replay (docs/routing_replay.md). "rollout" (R3): the servers record the experts
    of every token and the learner's routers use them in the proximal and the training forward;
    "proximal" (R2): the training forward replays the routes of the proximal forward (needs
    algorithm.decoupled). Either way the gate values are this model's router probabilities at
    the replayed experts (the router still gets gradients). "off": megatron's plain top-k.
    "observe": plain top-k too, but the servers record their routes and the learner its own, so
    routing/disagreement is logged, and one more forward per step replays the servers' routes on
    the same tokens for routing/mismatch_if_replayed_* (the control arm of a replay experiment)."""
    sequence_parallel: bool | Literal["auto"] = "auto"
    """Megatron sequence parallelism: the activations outside attention/MLP (norms, residuals,
    dropout) are split over the TP ranks along the sequence (all-gather before the column-parallel
    linears, reduce-scatter after the row-parallel ones instead of an all-reduce), so they cost
    1/tp of their memory. Same math as without it (tests/test_engine_sp.py). "auto" = on when
    tensor_parallel > 1 (megatron users' expectation); at TP1 it is off whatever is set (nothing
    to split). Packed micro-batches are padded to a multiple of TP (a pad "sequence" the loss
    never sees)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute (megatron's recompute_granularity): "none" keeps every activation;
    "selective" recomputes core attention in backward (drops the per-head [s, s] score and
    probability tensors of the mask path, the cheap-to-recompute, memory-heavy part); "full"
    keeps only the input of each recomputed group of layers and reruns its forward in backward
    (see recompute_method). Gradients are identical (tests/test_engine_sp.py). A forward-only
    engine (the KL reference) never recomputes: it keeps no activations."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """With recompute "full": "uniform" = every chunk's layers in groups of recompute_num_layers,
    each group recomputed as one unit (only group inputs kept); "block" = the first
    recompute_num_layers layers of each pipeline chunk recomputed one by one, the rest keep
    everything (megatron's recompute_method)."""
    recompute_num_layers: int = 1
    """With recompute "full": layers per recompute unit ("uniform") or layers recomputed per
    pipeline chunk ("block")."""
    cp_comm_type: Literal["auto", "all_gather", "p2p", "a2a", "a2a+p2p"] = "auto"
    """How attention crosses the context-parallel ranks (parallel.context_parallel > 1; unused at
    cp 1; docs/context_parallel.md). "all_gather": every rank all-gathers K/V of the whole row
    (the backward reduce-scatters dK/dV) -- the only kind of the local spec's CoreAttention (CPU);
    "p2p": transformer-engine's ring of K/V blocks, overlapped with compute; "a2a": TE's
    all-to-all over heads (Ulysses-style; heads / tp must divide by cp); "a2a+p2p": both,
    hierarchical (TE). The TE kinds need layer_spec te. "auto" = all_gather on the local spec,
    p2p on the TE spec (megatron's default)."""

    def validate(self) -> None:
        if self.family:
            try:
                resolve("model", self.family)
            except ValueError as e:
                raise ValueError(f"family: {e}") from None
        if self.layer_spec not in ("auto", "local", "te"):
            raise ValueError(f"layer_spec: {self.layer_spec!r} is not one of auto, local, te")
        if self.sequence_parallel not in (True, False, "auto"):
            raise ValueError(f"sequence_parallel: {self.sequence_parallel!r} is not one of true, false, auto")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute: {self.recompute!r} is not one of none, selective, full")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method: {self.recompute_method!r} is not one of uniform, block")
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers: must be >= 1, got {self.recompute_num_layers}")
        if self.cp_comm_type not in ("auto", "all_gather", "p2p", "a2a", "a2a+p2p"):
            raise ValueError(f"cp_comm_type: {self.cp_comm_type!r} is not one of auto, all_gather, p2p, a2a, a2a+p2p")
        if self.moe_aux_loss_coef < 0:
            raise ValueError(f"moe_aux_loss_coef: must be >= 0, got {self.moe_aux_loss_coef}")
        if self.moe_routing_replay not in ("off", "observe", "rollout", "proximal"):
            raise ValueError(f"moe_routing_replay: {self.moe_routing_replay!r} is not one of off, observe, rollout, "
                             "proximal")
        if self.moe_routing_replay != "off" and self.recompute != "none":
            raise ValueError(f"moe_routing_replay: {self.moe_routing_replay} with recompute {self.recompute!r} is not "
                             "supported (the recomputed forward would route afresh); set recompute: none")
        if self.dtype is not None:
            torch_dtype(self.dtype)
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by: must be >= 1, got {self.make_vocab_size_divisible_by}")

    def cp_comm_type_for(self, spec: str) -> str:
        """The resolved cp_comm_type for layer spec ``spec`` ("auto" = all_gather local, p2p te)."""
        if self.cp_comm_type == "auto":
            return "p2p" if spec == "te" else "all_gather"
        return self.cp_comm_type

    @property
    def captures_server_routes(self) -> bool:
        """The servers record every token's experts (--enable-return-routed-experts)."""
        return self.moe_routing_replay in ("observe", "rollout")

    def sequence_parallel_for(self, tp: int) -> bool:
        """The resolved sequence_parallel setting at tensor-parallel size ``tp``: off at TP1
        whatever was asked (there is nothing to split; megatron refuses SP without TP)."""
        return tp > 1 and (self.sequence_parallel == "auto" or bool(self.sequence_parallel))


@dataclass
class MegatronModel:
    """The model chunks of this rank plus what is needed to map them to HF names."""

    chunks: list[torch.nn.Module]
    """GPTModel per virtual pipeline chunk on this rank (one without interleaving)."""
    adapter: ModelAdapter
    arch: ModelArch
    groups: ModelParallelGroups = field(repr=False)
    layer_spec: Literal["local", "te"]
    dtype: str
    padded_vocab_size: int
    plans: list[StagePlan] = field(repr=False)
    """adapter.plan(layout) for every stage (pure metadata, identical on all ranks)."""
    lora: Any = None
    """The LoraConfig apply_lora attached (areal_mega/megatron/lora.py); None: no adapters."""

    @property
    def stage_plan(self) -> StagePlan:
        return self.plans[self.groups.coords.pp]

    @property
    def config(self):
        return self.chunks[0].config


def te_available() -> bool:
    try:
        importlib.import_module("transformer_engine")
        return True
    except Exception:  # a broken TE install raises RuntimeError, not ImportError
        return False


def resolve_layer_spec(spec: str) -> Literal["local", "te"]:
    if spec == "auto":
        return "te" if (torch.cuda.is_available() and te_available()) else "local"
    if spec == "te" and not te_available():
        raise ValueError("layer_spec: 'te' needs transformer_engine, which does not import here")
    return spec  # type: ignore[return-value]


def transformer_config(arch: ModelArch, groups: ModelParallelGroups, cfg: MegatronModelConfig, dtype: str,
                       spec_name: str = "local"):
    """megatron TransformerConfig for a Llama-style ``arch`` under ``groups.layout``."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    lay = groups.layout
    dt = torch_dtype(dtype)
    cls = MLATransformerConfig if arch.mla is not None else TransformerConfig
    tcfg = cls(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu if arch.swiglu_limit is None else _quick_gelu(),
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=arch.init_std,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=lay.vpp,
        context_parallel_size=lay.cp,
        cp_comm_type=cfg.cp_comm_type_for(spec_name) if lay.cp > 1 else None,
        sequence_parallel=cfg.sequence_parallel_for(lay.tp),
        params_dtype=dt,
        pipeline_dtype=dt,
        bf16=dt == torch.bfloat16,
        fp16=dt == torch.float16,
        attention_softmax_in_fp32=True,
        # Fused kernels are CUDA-only; the torch paths are exact and fine for our sizes on CPU.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=groups.cpu_compat,
        variable_seq_lengths=True,  # packed rows differ in length between micro-batches
        qk_layernorm=arch.qk_layernorm or arch.mla is not None,  # MLA: the q / kv latent norms
        # 0.16.1 rejects variable lengths with the allgather dispatcher: alltoall for dense too.
        moe_token_dispatcher_type="alltoall",
        **moe_kwargs(arch, lay, cfg, grouped=spec_name == "te"),
        **mla_kwargs(arch),
        **dsa_kwargs(arch),
        **linear_attention_kwargs(arch),
        **sink_window_kwargs(arch),
        **recompute_kwargs(cfg),
    )
    if arch.yarn is not None and arch.mla is None:
        compat.set_gpt_yarn(tcfg, arch.yarn)  # compat entry 15
    return tcfg


def _quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


def sink_window_kwargs(arch: ModelArch) -> dict[str, Any]:
    """TransformerConfig fields of gpt-oss: attention sinks (megatron's learnable softmax offset),
    the sliding window on some layers (run by CoreAttention on the packed mask, megatron/attention.py)
    and the clamped SwiGLU (quick_gelu GLU, +1 on the linear half, clamp; unfused path only: the
    fused kernel clamps before adding the bias, docs/families_probe.md)."""
    kw: dict[str, Any] = {}
    if arch.attention_sinks:
        kw["softmax_type"] = "learnable"
    if arch.sliding_window is not None:
        kw["window_size"] = (arch.sliding_window - 1, 0)
        kw["window_attn_skip_freq"] = [int(i in arch.sliding_window_layers) for i in range(arch.num_layers)]
    if arch.swiglu_limit is not None:
        kw.update(glu_linear_offset=1.0, activation_func_clamp_value=arch.swiglu_limit)
    return kw


def linear_attention_kwargs(arch: ModelArch) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3.5-style hybrid (gated DeltaNet dims, gated attention)."""
    g = arch.linear
    if g is None:
        return {}
    return dict(attention_output_gate=arch.attention_output_gate, linear_conv_kernel_dim=g.conv_kernel,
                linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
                linear_num_key_heads=g.num_key_heads, linear_num_value_heads=g.num_value_heads,
                # megatron's own per-layer pattern (1 = linear): makes checkpoints key layers one by one
                # (TransformerBlock.sharded_state_dict's non_homogeneous_layers), as their tensors differ
                linear_attention_freq=[int(g.is_linear(i)) for i in range(arch.num_layers)])


def mla_kwargs(arch: ModelArch) -> dict[str, Any]:
    """MLATransformerConfig fields for a DeepSeek-V3-family ``arch`` (empty otherwise).

    RoPE: HF's rope_interleave (pairs (x0, x1), (x2, x3)... share a frequency) is what megatron's
    MLA does (rope_utils de-interleaves when multi_latent_attention). YaRN: megatron's
    YarnRotaryEmbedding takes HF's factor / original_max_position_embeddings / beta_fast /
    beta_slow / mscale / mscale_all_dim; both scale cos/sin by mscale(f, mscale) /
    mscale(f, mscale_all_dim) and the softmax by mscale(f, mscale_all_dim)^2 / sqrt(q_head_dim)."""
    m = arch.mla
    if m is None:
        return {}
    kw = dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
              qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
              rotary_base=arch.rope_theta, rotary_percent=1.0)
    y = arch.yarn
    if y is None:  # plain RoPE; rotary_scaling_factor 1 makes megatron's softmax mscale 1
        return {**kw, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    return {**kw, "rope_type": "yarn", "rotary_scaling_factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings, "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim}


def dsa_kwargs(arch: ModelArch) -> dict[str, Any]:
    """TransformerConfig fields of DeepSeek sparse attention (DeepSeek-V3.2, GLM-5); the indexer
    is frozen, so no indexer loss (megatron/sparse_attention.py)."""
    x = arch.dsa
    if x is None:
        return {}
    return dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=x.index_n_heads,
                dsa_indexer_head_dim=x.index_head_dim, dsa_indexer_topk=x.index_topk, dsa_indexer_loss_coeff=0.0)


def moe_kwargs(arch: ModelArch, lay, cfg: MegatronModelConfig, grouped: bool = False) -> dict[str, Any]:
    """megatron TransformerConfig moe_* fields reproducing HF's Qwen3MoeSparseMoeBlock:
    router logits -> softmax over all experts -> top-k -> (norm_topk_prob) renormalise. Megatron
    computes the same two ways: ``moe_router_pre_softmax=True`` = softmax then top-k (HF without
    renormalisation); False = top-k on the logits then softmax over those k, which equals the
    renormalised top-k probabilities (softmax is monotonic and exp(l_i)/sum_topk exp(l_j) =
    p_i / sum_topk p_j). No capacity factor: no token is ever dropped or padded."""
    if not arch.is_moe:
        return {}
    families = {  # sigmoid + bias / groups / scaling / shared experts / dense layers (models/moe_families.py)
        "moe_router_score_function": arch.moe_score_function,
        "moe_router_enable_expert_bias": arch.moe_expert_bias,
        # the bias stays the checkpoint's, as in HF: megatron's per-step update adds rate * sign(...) = 0
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": arch.moe_num_groups,
        "moe_router_group_topk": arch.moe_group_topk,
        "moe_router_topk_scaling_factor": arch.moe_scaling_factor,
        "moe_shared_expert_intermediate_size": arch.moe_shared_ffn_hidden_size,
        "moe_shared_expert_gate": arch.moe_shared_expert_gate,
        "moe_shared_expert_overlap": False,
        "moe_layer_freq": [0 if i in arch.dense_layers else 1 for i in range(arch.num_layers)],
    }
    if arch.moe_router_fp32:
        families["moe_router_dtype"] = "fp32"
    return {
        **families,
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_topk,
        "moe_router_pre_softmax": arch.moe_score_function == "softmax" and not arch.moe_norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss" if cfg.moe_aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coef,
        "moe_expert_capacity_factor": None,
        "moe_grouped_gemm": grouped,  # TEGroupedMLP (TE spec, GPU); SequentialMLP otherwise
        "moe_permute_fusion": False,
        "moe_enable_routing_replay": cfg.moe_routing_replay != "off",
        "expert_model_parallel_size": lay.ep,
        "expert_tensor_parallel_size": lay.etp,
    }


def recompute_kwargs(cfg: MegatronModelConfig) -> dict[str, Any]:
    """megatron TransformerConfig recompute_* fields for ``cfg.recompute``."""
    if cfg.recompute == "none":
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if cfg.recompute == "selective":
        # megatron's default recompute_modules for "selective" is ["core_attn"]: said explicitly.
        return {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None,
                "recompute_modules": ["core_attn"]}
    return {"recompute_granularity": "full", "recompute_method": cfg.recompute_method,
            "recompute_num_layers": cfg.recompute_num_layers}


def check_context_parallel(layout, spec_name: str, attention: str | None = None, *,
                           cp_comm_type: str = "auto", vpp: int | None = None, mla: bool = False) -> None:
    """Refuse, at start-up and naming the key, the context-parallel setups that cannot run.

    cp > 1 runs every packed sequence split in 2 x cp load-balanced chunks
    (megatron/context_parallel.py): on the local spec through the project's CoreAttention
    (cp_comm_type all_gather), on the TE spec through transformer-engine's attention (THD,
    any cp_comm_type). Not supported: another cp_comm_type on the local spec, mask attention on
    the TE spec (TE's CP needs THD), interleaved pipelines (untested with CP) and multi-latent
    attention (MLA's RoPE path under CP is untested)."""
    if layout.cp <= 1:
        return
    kind = cp_comm_type if cp_comm_type != "auto" else ("p2p" if spec_name == "te" else "all_gather")
    if spec_name != "te" and kind != "all_gather":
        raise ValueError(f"actor.model.cp_comm_type: {kind!r} at parallel.context_parallel {layout.cp} needs the "
                         "transformer-engine layer spec (layer_spec: te); the local spec all-gathers K/V (all_gather)")
    if spec_name == "te" and attention is not None and attention != "thd":
        raise ValueError(f"actor.attention: {attention!r} at parallel.context_parallel {layout.cp} with the TE spec "
                         "is not supported (transformer-engine's context parallelism needs thd)")
    if vpp:
        raise ValueError(f"parallel.virtual_pipeline_parallel: {vpp} with parallel.context_parallel {layout.cp} > 1 "
                         "is not supported yet (untested); use one of them")
    if mla:
        raise ValueError(f"parallel.context_parallel: {layout.cp} > 1 with multi-latent attention is not supported "
                         "yet (MLA's RoPE under CP is untested); set parallel.context_parallel: 1")


def check_moe_sequence_parallel(arch: ModelArch, cfg: MegatronModelConfig, lay) -> None:
    """A trained MoE model at TP > 1 needs sequence parallelism: megatron-core 0.16.1's MoE layer
    raises at the first training forward without it (moe_layer.py), so it is refused at start-up
    and in the dry run instead."""
    if arch.is_moe and lay.tp > 1 and not cfg.sequence_parallel_for(lay.tp):
        raise ValueError(f"actor.model.sequence_parallel: false at parallel.tensor_parallel {lay.tp} is not supported "
                         f"for {arch.model_type} in training (megatron-core's MoE layer needs it at TP > 1); "
                         "set it auto or true")


def check_linear_attention(arch: ModelArch, cfg: MegatronModelConfig, lay) -> None:
    """Refuse, naming the key, what a hybrid (gated DeltaNet) model cannot run: its block is built
    on the local spec (megatron/linear_attention.py) and megatron-core 0.16.1's GDN has no context
    parallelism."""
    if arch.linear is None:
        return
    if cfg.layer_spec == "te":
        raise ValueError(f"actor.model.layer_spec: te is not supported for {arch.model_type} "
                         "(gated DeltaNet layers run on the local spec)")
    if lay.cp > 1:
        raise ValueError(f"parallel.context_parallel: {lay.cp} > 1 is not supported for {arch.model_type} "
                         "(megatron-core 0.16.1's GatedDeltaNet has no context parallelism)")


class LatentRMSNorm(compat.SequenceParallelRMSNorm):
    """MLA's q / kv latent RMSNorm at eps 1e-6: transformers' DeepseekV3Attention (and V3.2's,
    GLM-5's, Kimi-K2.5's) builds q_a_layernorm / kv_a_layernorm without config.rms_norm_eps."""

    EPS = 1e-6

    def __init__(self, config: Any, hidden_size: int, eps: float = EPS, **kw: Any):
        super().__init__(config, hidden_size, eps=self.EPS, **kw)


def check_sparse_attention(arch: ModelArch, cfg: MegatronModelConfig, lay) -> None:
    """Refuse, naming the key, what DeepSeek sparse attention (V3.2, GLM-5) cannot run: it is
    built on the local spec (megatron's TE DSA spec fuses the q-latent norm into the up
    projection, so its indexer would read the unnormalised latent) and megatron-core 0.16.1's
    DSAttention has no context parallelism."""
    if arch.dsa is None:
        return
    if cfg.layer_spec == "te":
        raise ValueError(f"actor.model.layer_spec: te is not supported for {arch.model_type} (DeepSeek sparse "
                         "attention runs on the local spec: megatron/sparse_attention.py)")
    if lay.cp > 1:
        raise ValueError(f"parallel.context_parallel: {lay.cp} > 1 is not supported for {arch.model_type} "
                         "(megatron-core 0.16.1's DSAttention has no context parallelism)")


def model_adapter(hf_config: Any, cfg: MegatronModelConfig) -> Any:
    """The adapter of ``cfg.family`` (``areal_mega.kinds``, family "model") over ``hf_config``, else
    the registry's for its ``model_type``."""
    if not cfg.family:
        return get_adapter(hf_config)
    hf = load_hf_config(hf_config) if isinstance(hf_config, (str, Path)) else hf_config
    return resolve("model", cfg.family)(hf if isinstance(hf, dict) else hf.to_dict())


def check_sinks_and_biases(arch: ModelArch, cfg: MegatronModelConfig, lay) -> None:
    """Refuse, naming the key, what gpt-oss's blocks cannot run: biased experts at expert-TP > 1
    (megatron-core 0.16.1 asserts it, transformer_config.py) and the TE spec (the sinks and the
    packed sliding window live in the local spec's CoreAttention)."""
    if arch.is_moe and arch.linear_bias and lay.etp != 1:
        raise ValueError(f"parallel.expert_tensor_parallel: {lay.etp} is not supported for {arch.model_type} (its "
                         "experts have biases, which megatron-core 0.16.1 allows only at expert_tensor_parallel 1)")
    if (arch.attention_sinks or arch.sliding_window is not None) and cfg.layer_spec == "te":
        raise ValueError(f"actor.model.layer_spec: te is not supported for {arch.model_type} (its sinks and "
                         "packed sliding window run in the local spec's CoreAttention; use auto or local)")


def local_spec_only(arch: ModelArch) -> bool:
    """Whether the family's blocks exist only in the local spec, whatever ``layer_spec`` says:
    gated DeltaNet (Qwen3.5), sinks / sliding window (gpt-oss), DeepSeek sparse attention. The
    learner builds it so and the memory model prices it so (simulator/memory.py)."""
    return arch.linear is not None or arch.attention_sinks or arch.sliding_window is not None or arch.dsa is not None


def _check_model(arch: ModelArch, cfg: MegatronModelConfig, lay) -> Literal["local", "te"]:
    """Every start-up refusal of ``arch`` under ``cfg`` and ``lay`` (one line naming the key), the
    compat entries the family needs, and the layer spec it builds on."""
    lay.check_model(arch.num_layers, arch.num_heads, arch.num_kv_heads)
    if arch.is_moe:
        lay.check_experts(arch.num_experts, arch.moe_ffn_hidden_size)
    else:
        dense = f"needs a mixture-of-experts model ({arch.model_type} is dense)"
        if lay.ep > 1:
            raise ValueError(f"parallel.expert_parallel: {lay.ep} > 1 {dense}")
        if cfg.moe_aux_loss_coef > 0 or cfg.moe_routing_replay != "off":
            key = "moe_aux_loss_coef" if cfg.moe_aux_loss_coef > 0 else "moe_routing_replay"
            raise ValueError(f"actor.model.{key}: set, but it {dense}")
    check_linear_attention(arch, cfg, lay)
    check_sparse_attention(arch, cfg, lay)
    check_sinks_and_biases(arch, cfg, lay)
    spec_name = "local" if local_spec_only(arch) else resolve_layer_spec(cfg.layer_spec)
    mla = arch.mla is not None
    if spec_name == "te" and mla and arch.rms_norm_eps != LatentRMSNorm.EPS:
        raise ValueError(f"actor.model.layer_spec: te with MLA and rms_norm_eps {arch.rms_norm_eps} is not "
                         "supported (TE fuses the latent norms at rms_norm_eps; HF's are at 1e-6); use local")
    check_context_parallel(lay, spec_name, cp_comm_type=cfg.cp_comm_type, vpp=lay.vpp, mla=mla)
    if arch.dsa is not None:
        compat.identity_rotate_activation()  # compat entry 17
    if arch.linear is not None:
        compat.enable_torch_gated_delta_net()  # compat entry 13
    if arch.is_moe:
        compat.define_missing_te_gemm()  # compat entry 10
    if arch.is_moe and arch.linear_bias:
        compat.fix_expert_bias_inplace()  # compat entry 16
    if mla:
        compat.fix_mla_have_te()  # compat entry 11
    return spec_name


def _layer_specs(arch: ModelArch, spec_name: str) -> tuple[list[Any], Any]:
    """(one layer spec per global layer, the MoE (or only) layer spec): dense-MLP layers
    (first_k_dense_replace, mlp_only_layers) get their own. MoE experts: TE spec = TEGroupedMLP
    (grouped GEMM, GPU); local spec = SequentialMLP (one megatron MLP per local expert; exact on
    CPU). The adapter names the weights of each."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    mla = arch.mla is not None
    qk_ln = arch.qk_layernorm or mla

    def spec_for(experts: dict):
        if spec_name == "te":
            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_ln, multi_latent_attention=mla, **experts)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_ln, multi_latent_attention=mla,
                                        **experts)
        # torch RMSNorm that works under sequence parallelism (megatron's asserts; compat entry 9),
        # and the project's core attention (any q/k/v head dims, packed THD; megatron/attention.py).
        spec = with_core_attention(compat.local_spec_with_sp_norms(spec))
        if mla:  # HF builds MLA's latent norms at eps 1e-6 whatever rms_norm_eps is (GLM-5's is 1e-5)
            attn = spec.submodules.self_attention.submodules
            attn.q_layernorm = attn.kv_layernorm = LatentRMSNorm
        if arch.dsa is not None:  # DeepSeek sparse attention: megatron's indexer, packed rows
            from areal_mega.megatron.sparse_attention import dsa_core_attention_spec

            spec.submodules.self_attention.submodules.core_attention = dsa_core_attention_spec()
        return spec

    moe = dict(num_experts=arch.num_experts, moe_grouped_gemm=spec_name == "te") if arch.is_moe else {}
    moe_spec, dense_spec = spec_for(moe), (spec_for({}) if arch.dense_layers else None)
    return [dense_spec if i in arch.dense_layers else moe_spec for i in range(arch.num_layers)], moe_spec


def build_model(
    hf_config: Any, groups: ModelParallelGroups, cfg: MegatronModelConfig | None = None, *, adapter: ModelAdapter | None = None
) -> MegatronModel:
    """Instantiate this rank's GPTModel chunks for ``hf_config`` (dict / transformers config /
    model dir) under ``groups.layout``. Weights are randomly initialised; see load_hf_weights.
    ``adapter`` overrides the registry lookup (tests inject deliberately broken mappings)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cpu_compat.apply()  # idempotent; per thread (see cpu_compat), so call it wherever megatron runs
    cfg = cfg or MegatronModelConfig()
    cfg.validate()
    adapter = adapter or model_adapter(hf_config, cfg)
    arch = adapter.arch
    lay = groups.layout
    spec_name = _check_model(arch, cfg, lay)
    dtype = cfg.dtype or arch.dtype
    tcfg = transformer_config(arch, groups, cfg, dtype, spec_name)
    if arch.mla is not None and lay.tp > 1 and not tcfg.sequence_parallel:
        # compat entry 12: finalize_model_grads sums "q_layernorm" grads over TP, which MLA's
        # (replicated, already complete) q latent norm must not get; under SP the sum is right.
        raise ValueError(f"actor.model.sequence_parallel: false with multi-latent attention at tensor_parallel "
                         f"{lay.tp} > 1 is not supported (megatron 0.16.1 would sum the q-latent norm's gradient "
                         "over TP); use sequence_parallel: auto")
    hybrid = arch.linear is not None
    layer_specs, layer_spec = _layer_specs(arch, spec_name)
    vocab = padded_vocab_size(arch.vocab_size, lay.tp, cfg.make_vocab_size_divisible_by)
    vpp = lay.vpp or 1
    pp_rank = groups.coords.pp
    if hybrid:  # megatron's ssm package: imported only for the hybrid families (its import warns on CPU)
        from areal_mega.megatron.linear_attention import qwen3_5_block_spec
    chunks = []
    for c in range(vpp):
        vp_stage = c if lay.vpp else None
        if hybrid:
            block = qwen3_5_block_spec(arch.linear.layer_types, tcfg, vp_stage, pp_rank,
                                       num_experts=arch.num_experts, dense_layers=arch.dense_layers)
        elif spec_name == "local":
            block = compat.block_spec_with_sp_final_norm(layer_specs, tcfg, vp_stage, pp_rank)
        elif arch.dense_layers:  # TE: megatron's own per-layer specs from moe_layer_freq (dense / MoE layers)
            block = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=True, vp_stage=vp_stage, pp_rank=pp_rank)
        else:
            block = layer_spec
        m = GPTModel(
            config=tcfg,
            transformer_layer_spec=block,
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pp_rank == 0 and c == 0,
            post_process=pp_rank == lay.pp - 1 and c == vpp - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="yarn" if arch.yarn is not None and arch.mla is None else "rope",
            rotary_base=arch.rope_theta,
            rope_scaling=arch.rope_scaling_factor is not None,
            rope_scaling_factor=arch.rope_scaling_factor or 8.0,
            rotary_percent=arch.rotary_percent,
            pg_collection=groups.pg_collection,
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():
            m = m.cuda(torch.cuda.current_device())
        chunks.append(m)
    if arch.dsa is not None:  # RL keeps the indexer frozen (docs/engine.md "DeepSeek sparse attention")
        from areal_mega.megatron.sparse_attention import freeze_indexers

        freeze_indexers(chunks)
    if cfg.moe_routing_replay != "off":
        from areal_mega.megatron.routing import install_observed_replay

        install_observed_replay(chunks)
    plans = adapter.plan(lay, spec=spec_name, dtype=dtype, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by)
    return MegatronModel(chunks, adapter, arch, groups, spec_name, dtype, vocab, plans)


def load_hf_weights(model: MegatronModel, hf_dir: str | Path) -> int:
    """Load an HF checkpoint into this rank's chunks (any layout); returns #params written.

    All shapes are validated before any parameter is touched (ValueError naming the tensor and
    both shapes). Each rank reads only its stage's tensors, and of those only its TP slices.
    """
    reader = model.adapter.checkpoint_view(HFCheckpointReader(hf_dir))
    c = model.groups.coords
    return model.adapter.load_hf(
        model.chunks, model.stage_plan, model.groups.layout.tp, c.tp, reader.read_slice, reader.shape,
        ep_rank=c.ep, etp=model.groups.layout.etp, etp_rank=c.etp,
    )


def expert_export(adapter: ModelAdapter, groups: ModelParallelGroups) -> ExpertExport | None:
    """The MoE export context of this rank (None for dense models)."""
    if not adapter.arch.is_moe:
        return None
    return ExpertExport(layout=groups.layout, rank=groups.rank, etp_group=groups.etp, adapter=adapter)


def export_hf_weights(model: MegatronModel, names=None):
    """``(hf_name, tensor)`` for this rank's stage (collective over the TP group, and for MoE
    over the expert groups; call on every rank where ``layout.exports(rank)``; a rank yields None
    for tensors only the stage's sender receives); see ModelAdapter.export_hf. Same code path as
    live weight sync and tools/convert_mcore_to_hf.py."""
    from areal_mega.megatron.lora import MergedView, has_lora

    chunks = [MergedView(c) for c in model.chunks] if has_lora(model.chunks) else model.chunks  # LoRA: W + s B A
    return model.adapter.export_hf(chunks, model.stage_plan, model.groups.tp, names,
                                   experts=expert_export(model.adapter, model.groups))


def packed_causal_mask(cu_seqlens: torch.Tensor, total_len: int | None = None) -> torch.Tensor:
    """Block-diagonal causal mask [1, 1, T, T] for packed sequences; True = masked (megatron).

    ``cu_seqlens`` = [0, l0, l0+l1, ...]. Token i may attend to token j iff both lie in the same
    sequence and j <= i. Positions past ``cu_seqlens[-1]`` (padding up to ``total_len``) attend
    only to themselves, so they stay finite and never leak into real tokens.
    """
    cu = cu_seqlens.to("cpu", torch.long)
    total = int(cu[-1]) if total_len is None else int(total_len)
    if total < int(cu[-1]):
        raise ValueError(f"total_len: {total} < cu_seqlens[-1] = {int(cu[-1])}")
    seq_id = torch.full((total,), -1, dtype=torch.long)
    for i in range(len(cu) - 1):
        seq_id[cu[i] : cu[i + 1]] = i
    pad = seq_id < 0
    seq_id[pad] = -1 - torch.arange(int(pad.sum()))  # each padding token is its own "sequence"
    idx = torch.arange(total)
    allowed = (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])
    return (~allowed).view(1, 1, total, total)


def row_length(model: MegatronModel, mb: dict[str, torch.Tensor]) -> int:
    """Row length micro-batch ``mb`` runs at (before the context-parallel split): a multiple of
    TP under sequence parallelism (megatron scatters the token dim over the TP ranks); under
    context parallelism every sequence padded to 2 x cp chunks and the row to 2 x cp (x tp with
    SP) (batching.packing.cp_padded_length); else unchanged."""
    lay = model.groups.layout
    return cp_padded_length(mb["cu_seqlens"], lay.cp, lay.tp if model.config.sequence_parallel else 1)


def row_lengths(model: MegatronModel, mbs: list[dict[str, torch.Tensor]]) -> list[int]:
    """:func:`row_length` of every micro-batch of a step -- under VPP all the longest one's
    (fixed p2p shape, compat entry 7)."""
    lens = [row_length(model, mb) for mb in mbs]
    return [max(lens)] * len(lens) if len(model.chunks) > 1 else lens


def microbatch_shard(model: MegatronModel, mb: dict[str, torch.Tensor], padded_len: int) -> ContextShard:
    """This rank's context-parallel share of ``mb`` run at ``padded_len`` (see ContextShard)."""
    return context_shard(mb["cu_seqlens"], model.groups.layout.cp, model.groups.coords.cp, padded_len)


def context_forward(chunk, inputs: dict[str, Any], device: torch.device, cp_group: Any) -> torch.Tensor:
    """One chunk's forward on a context-parallel rank's inputs (:func:`context_inputs`): THD
    packed_seq_params over the whole row; attention builds its mask (or TE its kernels) from them."""
    T = int(inputs["input_ids"].numel())
    positions = torch.arange(T, device=device).view(1, T)  # unused: RoPE follows cu_seqlens_q_padded
    psp = packed_seq_params(inputs["context_shard"], device, cp_group)
    return chunk(inputs["input_ids"].view(1, T).to(device), positions, None, packed_seq_params=psp)


def run_schedule(model: MegatronModel, chunks: list, mbs: list[dict[str, torch.Tensor]], loss_func: Callable,
                 model_forward: Callable, *, device: torch.device, forward_only: bool) -> list[Any]:
    """megatron's forward(-backward) schedule over the micro-batches ``mbs`` (packed rows:
    ``input_ids`` [T], ``cu_seqlens``, per-token fields) through ``chunks`` (the model's, or its
    DDP wrappers); ``model_forward(chunk, inputs)`` runs one chunk on the model inputs, and
    ``loss_func(mb, output)`` sees only the real tokens -- except under context parallelism,
    where ``inputs`` are this CP rank's share (``context_shard`` set, megatron/context_parallel.py)
    and ``output`` holds this rank's tokens (the loss gathers them, see the engine). Rows are
    padded as megatron needs them (:func:`row_lengths`; under VPP every row to the longest,
    compat entries 7-8). The engine and :func:`forward_logits` both run through here."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq_length = max(row_lengths(model, mbs))
    many = len(chunks) > 1
    cp = model.groups.layout.cp
    if many:
        # Interleaved 1F1B: fixed-shape p2p (no variable_seq_lengths, see
        # compat.configure_interleaved_p2p), so every micro-batch runs padded to the longest one.
        # megatron-core 0.16.1's rule for micro-batch groups (compat entry 8).
        group = compat.microbatch_group_size(len(mbs), model.groups.layout.pp)
        model.config.microbatch_group_size_per_vp_stage = group

    def step(data_iterator, chunk):
        # Each chunk has its own iterator over the same list: megatron's interleaved schedule
        # runs every chunk's forwards in micro-batch order (get_schedule_table), warm-up and
        # cool-down included, so the k-th next() of every chunk is micro-batch k.
        mb = {k: v.to(device) for k, v in next(data_iterator).items()}
        T = int(mb["input_ids"].numel())
        # VPP: the fixed p2p shape (compat entry 7); else a multiple of TP under SP (or T).
        target = seq_length if many else row_length(model, mb)
        if cp > 1:  # this rank's chunks of every sequence; the loss gathers the tokens back
            shard = microbatch_shard(model, mb, target)
            return model_forward(chunk, context_inputs(mb, shard)), partial(loss_func, mb)
        if T == target:
            return model_forward(chunk, mb), partial(loss_func, mb)
        # Padded: the loss sees only the real tokens (compat.pad_microbatch / trimmed_loss).
        padded = compat.pad_microbatch(mb, target)
        return model_forward(chunk, padded), partial(compat.trimmed_loss, loss_func, mb, T)

    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(mbs) for _ in chunks] if many else iter(mbs),
        model=chunks if many else chunks[0],
        num_microbatches=len(mbs),
        seq_length=seq_length,  # the p2p shape under VPP (megatron divides by cp, and tp under SP)
        micro_batch_size=1,
        forward_only=forward_only,
    )


def forward_logits(
    model: MegatronModel, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, *, gather_vocab: bool = True
) -> torch.Tensor | None:
    """Forward-only pass of one packed row through all pipeline stages.

    ``input_ids`` [T] (several sequences concatenated, boundaries in ``cu_seqlens``). Returns
    logits [T, vocab_size] (fp32; TP-gathered and padding removed when ``gather_vocab``, else the
    local vocab shard [T, padded_vocab / tp]) on the LAST pipeline stage, None on the others.
    Collective over the model-parallel ranks of this data-parallel replica.
    """
    cpu_compat.apply()
    g = model.groups
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    n_real = int(input_ids.numel())
    out: list[torch.Tensor] = []

    def mask_forward(chunk, mb):
        if "context_shard" in mb:
            return context_forward(chunk, mb, dev, g.cp)
        T = int(mb["input_ids"].numel())
        positions = torch.arange(T, device=dev).view(1, T)
        return chunk(mb["input_ids"].view(1, T), positions, packed_causal_mask(mb["cu_seqlens"], T).to(dev))

    def keep(mb, output):
        if g.layout.cp > 1:  # this rank's tokens [1, t, V/tp] -> the row's [1, T, V/tp]
            shard = microbatch_shard(model, mb, output.shape[1] * g.layout.cp)
            output = gather_tokens(output[0], shard, g.cp).unsqueeze(0)
        out.append(output.detach())
        # The schedule divides the returned loss in place: give it a fresh tensor.
        return torch.zeros((), device=output.device), {}

    # The interleaved (VPP) schedule needs >= pp micro-batches: feed the same row pp times and
    # keep the first output (forward_logits is for checks and tools, not the training hot path).
    row = {"input_ids": input_ids.reshape(-1), "cu_seqlens": cu_seqlens}
    mbs = [row] * (g.layout.pp if len(model.chunks) > 1 else 1)
    with torch.no_grad():
        run_schedule(model, list(model.chunks), mbs, keep, mask_forward, device=dev, forward_only=True)
    if not g.is_last_stage:
        return None
    logits = out[0][0, :n_real].float()  # [T, vocab/tp]
    if not gather_vocab:
        return logits
    full = tp_all_gather(logits, g.tp, dim=-1)
    return full[:, : model.arch.vocab_size]
