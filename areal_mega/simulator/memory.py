"""Per-GPU memory estimates for learners (megatron) and engines (SGLang), in bytes.

Closed formulas of the model (the adapter's :class:`~areal_mega.models.ModelArch`, as ``build_model`` reads it), the
layout and :class:`LearnerSettings` (the trainer's own config fields), so the launcher prices
what the trainer builds and refuses a plan before any node is touched. The formulas, term by
term, and their check against the engine's real tensors (tools/check_memory_model.py) are in
docs/launch.md ("The memory estimate").
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from areal_mega.parallel import ParallelLayout

if TYPE_CHECKING:
    from areal_mega.experiment import ExperimentConfig
    from areal_mega.models.base import ModelArch

__all__ = [
    "DTYPE_BYTES", "EngineMemory", "GIB", "LOGPROB_BYTES_PER_TOKEN", "LearnerMemory", "LearnerSettings",
    "ParamCount", "StageState", "activation_bytes_per_token", "count_params", "estimate_engine",
    "estimate_learner", "in_flight", "indexer_transient_bytes", "layer_bytes_per_token", "learner_settings", "linear_state_bytes_per_request",
    "microbatch_activation_bytes",
    "model_arch", "selective_layer_bytes_per_token", "settings_from_engine_config", "stage_activations",
    "stage_layer_ids", "stage_state", "total_params"
]

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGPROB_BYTES_PER_TOKEN = 26
"""The vocab-parallel log-prob's per-token saves besides the fp32 logits: fp32 max and sum-exp
(4 + 4), int64 target index (8), two bool masks (1 + 1), int64 labels (8) -- counted on CPU."""


def _num_dense_in(m: ModelArch, layers) -> int:
    """How many of the global layer ids ``layers`` are a MoE model's dense layers (0 for a dense model)."""
    return sum(1 for i in layers if m.num_experts and i in m.dense_layers)


def _num_linear_in(m: ModelArch, layers) -> int:
    """How many of the global layer ids ``layers`` are gated DeltaNet (linear attention) layers."""
    return sum(1 for i in layers if m.linear is not None and m.linear.is_linear(i))


@dataclass(frozen=True)
class ParamCount:
    """Parameters split into what TP shards and what every TP rank replicates. The ``layer_*``
    fields are one MoE layer's (one layer's for a dense model); ``dense_layer_*`` one dense
    layer's of a MoE model with dense layers (DeepSeek's first layers)."""

    layer_sharded: int
    """One decoder layer's TP-sharded weights (q, k, v, o or MLA's projections, MLP or shared
    expert, qkv biases)."""
    layer_replicated: int
    """One decoder layer's norms (fp32 on the local spec)."""
    embedding: int
    """Input embedding V*h (vocab-parallel)."""
    output: int
    """Output layer V*h, 0 when tied to the embedding."""
    final_norm: int
    layer_expert: int = 0
    """One decoder layer's routed experts (all E), split over ep x etp GPUs; 0 for dense."""
    layer_active_expert: int = 0
    """The experts one token uses (k of E)."""
    dense_layer_sharded: int = 0
    """A MoE model's dense layer: attention + dense MLP, TP-sharded."""
    dense_layer_replicated: int = 0
    """A MoE model's dense layer: its norms (no router)."""
    layer_replicated_weights: int = 0
    """One MoE layer's replicated weights in the compute dtype (with an fp32 master copy): the
    router, the shared-expert gate; TE spec: MLA's (duplicated) down projections."""
    dense_layer_replicated_weights: int = 0
    """The same for a MoE model's dense layer (TE spec: MLA's down projections)."""
    linear_layer_sharded: int = 0
    """A hybrid model's gated DeltaNet layer (Qwen3.5): in_proj, conv1d, A_log, dt_bias, out_proj
    and its dense MLP, TP-sharded (the ``layer_*`` fields are then its gated-attention layers)."""
    linear_layer_replicated: int = 0
    """A gated DeltaNet layer's norms: the two layer norms and the gated out_norm."""
    layer_frozen: int = 0
    """Every layer's frozen weights (no grads, no optimizer state), replicated on every TP rank:
    DeepSeek sparse attention's indexer (wq_b, wk, k_norm, weights_proj; models/dsa.py)."""

    def total(self, num_layers: int, num_dense: int = 0, num_linear: int = 0) -> int:
        """``num_layers`` layers of which ``num_dense`` are a MoE model's dense layers and
        ``num_linear`` a hybrid model's gated DeltaNet layers."""
        moe = num_layers - num_dense - num_linear
        layers = moe * (self.layer_sharded + self.layer_replicated + self.layer_replicated_weights + self.layer_expert)
        layers += num_dense * (self.dense_layer_sharded + self.dense_layer_replicated
                               + self.dense_layer_replicated_weights)
        # a hybrid MoE model's DeltaNet layers have the router and experts of its MoE layers too
        layers += num_linear * (self.linear_layer_sharded + self.linear_layer_replicated + self.layer_replicated_weights
                                + self.layer_expert)
        return layers + num_layers * self.layer_frozen + self.embedding + self.output + self.final_norm

    def active(self, num_layers: int, num_dense: int = 0, num_linear: int = 0) -> int:
        """Parameters one token passes through (MoE: k experts of E; dense: all)."""
        return (self.total(num_layers, num_dense, num_linear)
                - (num_layers - num_dense) * (self.layer_expert - self.layer_active_expert))


def _attention_params(m: ModelArch, spec: str) -> tuple[int, int, int]:
    """(TP-sharded, replicated norms, replicated weights) of one layer's attention and its two norms."""
    h, a = m.hidden_size, m.num_heads
    norms = 2 * h
    if m.mla is None:
        d = m.head_dim
        qd, kvd = a * d, m.num_kv_heads * d
        attn = h * qd + 2 * h * kvd + qd * h + ((qd + 2 * kvd) if m.qkv_bias else 0)
        attn += h * qd if m.attention_output_gate else 0  # the gate's rows, projected with q
        attn += a if m.attention_sinks else 0  # gpt-oss's sinks: one logit per head, TP-sharded (negligible)
        # gpt-oss's o_proj bias: replicated over TP
        return attn, norms + (2 * d if m.qk_layernorm else 0), h if m.linear_bias else 0
    # MLA (megatron MLASelfAttention): q down/up (or one q projection), kv down/up, the latent
    # norms; the down projections are column-parallel on the local spec, duplicated with TE.
    ml = m.mla
    ql = ml.q_lora_rank or 0
    qk = ml.qk_nope_head_dim + ml.qk_rope_head_dim
    down = h * (ml.kv_lora_rank + ml.qk_rope_head_dim) + (h * ql if ql else 0)
    up = ml.kv_lora_rank * a * (ml.qk_nope_head_dim + ml.v_head_dim) + (ql * a * qk if ql else h * a * qk)
    sharded = up + a * ml.v_head_dim * h
    norms += ml.kv_lora_rank + ql
    return (sharded + down, norms, 0) if spec == "local" else (sharded, norms, down)


def count_params(m: ModelArch, vocab: int | None = None, spec: str = "te") -> ParamCount:
    """``vocab``: the (padded) vocabulary to count; default the model's own. ``spec``: the layer
    spec ("local" / "te": only where MLA's down projections live differs)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    attn, norms, rep = _attention_params(m, spec)
    emb = (vocab or m.vocab_size) * h
    mlp = 3 * h * f
    lin = {}
    if m.dsa is not None:  # the indexer: wq_b on the q latent, wk and weights_proj on h, k_norm (weight, bias)
        x = m.dsa
        lin["layer_frozen"] = (x.index_n_heads * x.index_head_dim * (m.mla.q_lora_rank or h) + x.index_head_dim * h
                               + 2 * x.index_head_dim + x.index_n_heads * h)
    if m.linear is not None:  # megatron's GatedDeltaNet: in_proj [qkv; z; b; a], depthwise conv1d, A_log, dt_bias
        g = m.linear
        kd, vd, nv = g.key_dim, g.value_dim, g.num_value_heads
        conv = 2 * kd + vd
        gdn = h * (conv + vd + 2 * nv) + conv * g.conv_kernel + 2 * nv + vd * h
        mlp_part = 3 * h * (m.moe_shared_ffn_hidden_size or 0) if m.num_experts else mlp  # + router, experts: total()
        lin = dict(linear_layer_sharded=gdn + mlp_part, linear_layer_replicated=2 * h + g.value_head_dim)
    if m.num_experts:
        expert = 3 * h * m.moe_ffn_hidden_size + ((2 * m.moe_ffn_hidden_size + h) if m.linear_bias else 0)
        shared = 3 * h * (m.moe_shared_ffn_hidden_size or 0)
        gate = h if m.moe_shared_expert_gate else 0
        return ParamCount(layer_sharded=attn + shared, layer_replicated=norms,
                          layer_replicated_weights=rep + m.num_experts * (h + int(m.linear_bias)) + gate,
                          embedding=emb, output=0 if m.tie_word_embeddings else emb, final_norm=h,
                          layer_expert=m.num_experts * expert, layer_active_expert=m.moe_topk * expert,
                          dense_layer_sharded=attn + mlp, dense_layer_replicated=norms,
                          dense_layer_replicated_weights=rep, **lin)
    return ParamCount(layer_sharded=attn + mlp, layer_replicated=norms, layer_replicated_weights=rep, embedding=emb,
                      output=0 if m.tie_word_embeddings else emb, final_norm=h, **lin)


def total_params(m: ModelArch) -> int:
    every = range(m.num_layers)
    return count_params(m).total(m.num_layers, _num_dense_in(m, every), _num_linear_in(m, every))


@dataclass(frozen=True)
class LearnerSettings:
    """One megatron engine as the trainer builds it: every field is the resolved value of a
    trainer config key (built by :func:`learner_settings`; never a launcher-side copy)."""

    dtype: str = "bfloat16"
    """``actor.model.dtype`` (None there = the HF checkpoint's dtype)."""
    layer_spec: Literal["local", "te"] = "te"
    """``actor.model.layer_spec`` resolved ("auto" = te on GPU nodes, local on CPU)."""
    attention: Literal["mask", "thd"] = "thd"
    """``actor.attention`` resolved ("auto" = thd with the TE spec unless interleaved, else mask):
    "mask" prices the dense [s, s] scores, "thd" fused varlen attention."""
    sequence_parallel: bool = True
    """``actor.model.sequence_parallel`` resolved at the layout's TP."""
    recompute: Literal["none", "selective", "full"] = "none"
    """``actor.model.recompute``."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    micro_batch_tokens: int = 8192
    """``actor.max_tokens_per_microbatch``: T (= s, the packed row) of one micro-batch. Under
    context parallelism each of the cp ranks holds T / cp of its tokens (and attends over all T)."""
    cp_comm_type: str = "all_gather"
    """``actor.model.cp_comm_type`` resolved (used at cp > 1): "all_gather" keeps the gathered
    K/V of the whole row per layer; TE's "p2p" / "a2a" kinds only pass blocks in flight."""
    grad_reduce_in_fp32: bool = True
    """``actor.grad_reduce_in_fp32``."""
    distributed_optimizer: bool = True
    """``actor.optimizer.use_distributed_optimizer``."""
    make_vocab_size_divisible_by: int = 128
    """``actor.model.make_vocab_size_divisible_by``."""
    num_microbatches: int | None = None
    """Micro-batches per step and DP rank (caps the 1F1B in-flight count); None = at least pp."""
    reserved_gib: float = 6.0
    """``launch.learner.reserved_gib`` (not a trainer setting: CUDA context, NCCL, fragmentation)."""
    lora_rank: int = 0
    """``actor.lora.rank`` (0 = full fine-tuning): the base is frozen, grads and optimizer state
    are the adapters' only."""
    lora_targets: tuple[str, ...] = ()
    """``actor.lora.target_modules``."""

    @property
    def b(self) -> int:
        return DTYPE_BYTES[self.dtype]


def settings_from_engine_config(engine_cfg, arch_dtype: str, tp: int, *, on_gpu: bool,
                                reserved_gib: float = 6.0, vpp: int | None = None) -> LearnerSettings:
    """The :class:`LearnerSettings` of a MegatronEngineConfig (``actor`` / ``critic`` section):
    the same fields, resolved the way ``build_model`` and the engine resolve them."""
    from areal_mega.megatron.engine import resolve_attention

    mc = engine_cfg.model
    spec = mc.layer_spec if mc.layer_spec != "auto" else ("te" if on_gpu else "local")
    return LearnerSettings(
        dtype=mc.dtype or arch_dtype, layer_spec=spec, attention=resolve_attention(engine_cfg.attention, spec, vpp),
        sequence_parallel=mc.sequence_parallel_for(tp), recompute=mc.recompute,
        recompute_method=mc.recompute_method, recompute_num_layers=mc.recompute_num_layers,
        micro_batch_tokens=engine_cfg.max_tokens_per_microbatch, grad_reduce_in_fp32=engine_cfg.grad_reduce_in_fp32,
        distributed_optimizer=engine_cfg.optimizer.use_distributed_optimizer,
        make_vocab_size_divisible_by=mc.make_vocab_size_divisible_by, reserved_gib=reserved_gib,
        cp_comm_type=mc.cp_comm_type_for(spec),
        **({"lora_rank": engine_cfg.lora.rank, "lora_targets": tuple(engine_cfg.lora.target_modules)}
           if getattr(engine_cfg, "lora", None) is not None and engine_cfg.lora.enabled else {}),
    )


def learner_settings(exp: "ExperimentConfig", m: ModelArch, layout: ParallelLayout, *,
                     on_gpu: bool) -> tuple[LearnerSettings, LearnerSettings | None, bool]:
    """(actor settings, critic settings or None, KL reference?) from the trainer's own typed
    sections -- ``actor``, ``critic``, ``algorithm`` -- resolved as the trainer resolves them
    (layer_spec "auto" = te on GPU nodes, local on CPU; sequence_parallel at the layout's TP)."""
    from areal_mega.megatron.model import (  # torch: when priced
        check_context_parallel, check_linear_attention, check_moe_sequence_parallel, check_sinks_and_biases,
        check_sparse_attention, local_spec_only,
    )

    def as_built(x: LearnerSettings) -> LearnerSettings:
        """``x`` as build_model builds it: the local-spec-only families on the local spec and the mask
        path (gpt-oss's CoreAttention, PackedDSAttention scoring all T keys)."""
        if not local_spec_only(m):
            return x
        return dataclasses.replace(x, layer_spec="local", attention="mask")

    res = exp.launch.learner.reserved_gib
    s = settings_from_engine_config(exp.actor, m.dtype, layout.tp, on_gpu=on_gpu, reserved_gib=res, vpp=layout.vpp)
    for check in (check_linear_attention, check_sparse_attention, check_sinks_and_biases, check_moe_sequence_parallel):
        check(m, exp.actor.model, layout)
    s = as_built(s)
    from areal_mega.megatron.engine import check_attention
    from areal_mega.megatron.lora import check_lora  # the trainer's own refusals, at the dry run too

    check_attention(s.attention, s.layer_spec)
    check_lora(exp.actor.lora, m, layout, s.layer_spec)
    # what cp > 1 cannot run is refused here as at start-up
    check_context_parallel(layout, s.layer_spec, s.attention, cp_comm_type=exp.actor.model.cp_comm_type,
                           vpp=layout.vpp)
    critic = None
    if exp.algorithm.needs_critic:
        critic = as_built(settings_from_engine_config(exp.critic, m.dtype, layout.tp, on_gpu=on_gpu,
                                                      reserved_gib=res, vpp=layout.vpp))
    return s, critic, exp.algorithm.needs_reference


def model_arch(exp: "ExperimentConfig") -> ModelArch:
    """The model as the trainer's adapter parses it: ``<model_path>/config.json``, or
    ``launch.model_config`` (the same JSON inline) where model_path is not readable here."""
    return model_adapter(exp).arch


def model_adapter(exp: "ExperimentConfig"):
    """The trainer's adapter of the model (:func:`model_arch`'s sources and errors)."""
    from areal_mega.models import get_adapter  # torch: only when a plan is priced

    path = exp.model_path or exp.inference.server.model_path
    hf_config = None
    if path and (Path(path) / "config.json").is_file():
        try:
            hf_config = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"model_path: {path}/config.json is unreadable ({e})") from None
    elif exp.launch.model_config is not None:
        hf_config = dict(exp.launch.model_config)
    if hf_config is None:
        where = f"{path}/config.json does not exist here" if path else "no model_path"
        raise ValueError(f"launch.model_config: not set and {where}; set launch.model_config to the model's "
                         "config.json content to plan without the weights")
    try:
        return get_adapter(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model config ({'model_path' if path and Path(path).is_dir() else 'launch.model_config'}): {e}") from None


@dataclass(frozen=True)
class LearnerMemory:
    """Estimate for the worst pipeline stage's GPU."""

    stage: int
    params: int
    """Parameters held by one GPU of that stage."""
    weights: float
    grads: float
    optimizer: float
    activations: float
    """Peak bytes saved for backward (layers, masks, transients) except the logits term."""
    logits: float
    """The last stage's transient: final norm, output-layer input and fp32 logits of one micro-batch."""
    reserved: float
    limit: float
    reference: float = 0.0
    """The frozen KL reference model's weights (0 without one)."""
    critic: float = 0.0
    """The PPO critic's weights, grads and optimizer state (0 without one)."""
    settings: LearnerSettings | None = None
    notes: tuple[str, ...] = ()
    """What the estimate assumed, in the trainer's key names (printed by the dry run)."""

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.reserved
                + self.reference + self.critic)

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def describe(self) -> str:
        g = lambda x: f"{x / GIB:.1f}"  # noqa: E731
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out = (
            f"learner per-GPU memory (worst stage {self.stage}, {self.params / 1e9:.2f}B params/GPU): "
            f"weights {g(self.weights)} + grads {g(self.grads)} + optimizer {g(self.optimizer)} + "
            f"activations {g(self.activations)} + logits {g(self.logits)} + reserved {g(self.reserved)} "
            + (f"+ reference {g(self.reference)} " if self.reference else "")
            + (f"+ critic {g(self.critic)} " if self.critic else "") +
            f"= {g(self.total)} GiB of {g(self.limit)} GiB -> {verdict}"
        )
        s = self.settings
        if s is not None:
            out += (
                f"\n  priced as the trainer builds it: actor.model.dtype={s.dtype} layer_spec={s.layer_spec} "
                f"sequence_parallel={str(s.sequence_parallel).lower()} recompute={s.recompute}"
                + (f" ({s.recompute_method}, {s.recompute_num_layers} layers)" if s.recompute == "full" else "")
                + f"; actor.attention={s.attention}; actor.max_tokens_per_microbatch={s.micro_batch_tokens}; "
                f"actor.optimizer.use_distributed_optimizer={str(s.distributed_optimizer).lower()}; "
                f"actor.model.cp_comm_type={s.cp_comm_type} (at context_parallel > 1)"
            )
        out += "".join(f"\n  note: {n}" for n in self.notes)
        return out


def _norm_bytes(s: LearnerSettings) -> int:
    return 4 if s.layer_spec == "local" else s.b


def _attention_mask_terms(m: ModelArch, s: LearnerSettings, t: int, cp: int = 1) -> tuple[float, float]:
    """(bytes per (this rank's) token kept by a layer's core attention, bytes per token of its
    rematerialisation under selective recompute). ``cp`` > 1: every rank attends over all T
    tokens of the row with T / cp queries (docs/context_parallel.md)."""
    a, g, d, T, b = m.num_heads, m.num_kv_heads, m.head_dim, s.micro_batch_tokens, s.b
    probs = 4 + (b if s.dtype != "float32" else 0)  # fp32 softmax (+ its cast to the compute dtype)
    if s.attention == "thd":
        # fused varlen kernel: rotated q and k, the qkv buffer (v is a view of it), softmax lse
        own = b * (a + g) * d / t + b * (a + 2 * g) * d / t + 4 * a / t
        # all_gather CP: the gathered K and V of the whole row (cp x this rank's tokens) are kept
        gathered = 2 * b * g * d * cp / t if cp > 1 and s.cp_comm_type == "all_gather" else 0.0
        return own + gathered, 0.0
    if cp > 1:
        # CoreAttention under CP: q; K and V all-gathered (then expanded to a heads under GQA):
        # cp x this rank's tokens; fp32 scores + probabilities over all T keys; the layer's
        # boolean mask [T / cp, T] (1 byte per key, rebuilt per layer, kept by masked_fill)
        inner = (b * a * d + 2 * b * a * d * cp) / t + probs * a * T / t + T
        return inner, inner
    # dense: q (a heads), k and v expanded to a heads (copies under GQA; without GQA, k is
    # rotated and v a view of the qkv buffer), fp32 softmax + probabilities, a*s each
    kv = 2 * b * a * d if a > g else b * a * d + b * (a + 2 * g) * d
    inner = (b * a * d + kv) / t + probs * a * T / t
    return inner, inner


def _active_mlp_width(m: ModelArch, dense: bool = False) -> int:
    """f of the activation terms: the MLP width a token passes through (MoE: k * f_e plus the
    shared experts'; a MoE model's dense layer: f)."""
    if not m.num_experts or dense:
        return m.ffn_hidden_size
    return m.moe_topk * m.moe_ffn_hidden_size + (m.moe_shared_ffn_hidden_size or 0)


def _dispatch_bytes_per_token(m: ModelArch, s: LearnerSettings, dense: bool = False) -> float:
    """MoE router fp32 logits + probabilities, and the permuted token copies (to and from the
    experts, k each); 0 for dense models and layers."""
    if not m.num_experts or dense:
        return 0.0
    return 8 * m.num_experts + 2 * m.moe_topk * s.b * m.hidden_size


GDN_CHUNK = 64
"""megatron-core 0.16.1's torch_chunk_gated_delta_rule chunk size (each sequence padded to it)."""


def _gdn_bytes_per_token(m: ModelArch, s: LearnerSettings, t: int) -> float:
    """What one gated DeltaNet layer keeps per token for backward between its in_proj and its
    out_proj, on the path the learner runs: megatron-core 0.16.1's GatedDeltaNet with the torch
    chunked delta rule (compat entry 13; flash-linear-attention is not in the learner env). Heads
    split over TP. In the compute dtype b: the conv input and its SiLU's input, the l2norm's
    inputs q and k (with their rsqrt), the sigmoid'd beta, the gated norm's input, its output and
    out_proj's input; fp32: softplus's input and output (g), the gate and its SiLU. The rule,
    fp32 per value head and padded token (sequence padded to 64): q, k, k_beta, k_beta*exp(g),
    k_cumdecay, q*exp(g), k*exp(g) (7 x dk), value, v_beta, v_new (3 x dv), six [64, 64]-per-chunk
    matrices (decay exp and its tril, k_beta k^T, the solved attn, q k^T and its masked form: 64
    per token each), the forward-substitution loop's row and sub-matrix clones (sum over i < 64 of
    i + i^2 = 87,360 per chunk: 1,365 per token -- the dominant term, ~5.3 KiB per head and token)
    and the per-chunk recurrent state (dk x dv per 64 tokens)."""
    g, b = m.linear, s.b
    nk, nv, dk, dv = g.num_key_heads / t, g.num_value_heads / t, g.key_head_dim, g.value_head_dim
    conv = 2 * nk * dk + nv * dv
    pre = 2 * b * conv + 2 * b * nk * dk + 2 * b * nk + b * nv + 8 * nv
    loop = sum(i + i * i for i in range(1, GDN_CHUNK)) / GDN_CHUNK
    rule = 4 * nv * (7 * dk + 3 * dv + 6 * GDN_CHUNK + loop + dk * dv / GDN_CHUNK + 4)
    post = 3 * b * nv * dv + 8 * nv * dv + 4 * nv
    T = s.micro_batch_tokens
    pad = math.ceil(T / GDN_CHUNK) * GDN_CHUNK / T  # one sequence per row; each more pads <= 63 tokens
    return pre + rule * pad + post


def layer_bytes_per_token(m: ModelArch, s: LearnerSettings, t: int, cp: int = 1, dense: bool = False,
                          linear: bool = False) -> float:
    """Bytes one layer keeps per micro-batch token (of this rank: T / cp of them) for backward
    without recompute (``dense``: a MoE model's dense layer; ``linear``: a gated DeltaNet layer)."""
    h, f, d, a, b = m.hidden_size, _active_mlp_width(m, dense), m.head_dim, m.num_heads, s.b
    sig = t if s.sequence_parallel else 1
    if linear:
        mlp = 5 * b * f / t + _dispatch_bytes_per_token(m, s, dense)
        return 2 * (8 * h + 4) / sig + 2 * b * h / sig + _gdn_bytes_per_token(m, s, t) + mlp
    rope = 4 * b * d
    attn, _ = _attention_mask_terms(m, s, t, cp)
    if m.attention_output_gate:  # the gate (a heads): its sigmoid's output and the gated product's input
        attn += 2 * b * a * d / t
    if s.layer_spec == "te":
        norms_linears = 2 * (2 * b * h + 4) / sig
        mlp = 3 * b * f / t
    else:
        norms_linears = 2 * (8 * h + 4) / sig + 2 * b * h / sig
        mlp = 5 * b * f / t
    return norms_linears + rope + attn + b * a * d / t + mlp + _dispatch_bytes_per_token(m, s, dense)


def selective_layer_bytes_per_token(m: ModelArch, s: LearnerSettings, t: int, cp: int = 1,
                                    dense: bool = False, linear: bool = False) -> float:
    """A layer under selective (core attention) recompute: the attention internals are dropped;
    its checkpoint keeps rotated q (a heads), k (g heads) and the qkv buffer (v is a view). A
    gated DeltaNet layer has no core attention: it keeps everything."""
    if linear:
        return layer_bytes_per_token(m, s, t, cp, dense, linear=True)
    b, a, g, d = s.b, m.num_heads, m.num_kv_heads, m.head_dim
    attn, _ = _attention_mask_terms(m, s, t, cp)
    kept = b * (a + g) * d / t + b * (a + 2 * g) * d / t
    return layer_bytes_per_token(m, s, t, cp, dense) - attn + kept


def activation_bytes_per_token(m: ModelArch, s: LearnerSettings, tp: int, cp: int = 1) -> float:
    """Bytes one layer keeps per micro-batch token (of this rank) for backward under
    ``s.recompute`` (the per-layer term of the module docstring; "full" = the kept input of a
    1-layer unit)."""
    if s.recompute == "selective":
        return selective_layer_bytes_per_token(m, s, tp, cp)
    if s.recompute == "full":
        return s.b * m.hidden_size / (tp if s.sequence_parallel else 1)
    return layer_bytes_per_token(m, s, tp, cp)


def _mlp_half_bytes_per_token(m: ModelArch, s: LearnerSettings, t: int, dense: bool = False) -> float:
    """What a layer's MLP half keeps (pre-MLP norm, fc1 input, MLP internals): freed by the time
    backward reaches that layer's attention."""
    h, f, b = m.hidden_size, _active_mlp_width(m, dense), s.b
    sig = t if s.sequence_parallel else 1
    if s.layer_spec == "te":
        return (2 * b * h + 4) / sig + 3 * b * f / t + _dispatch_bytes_per_token(m, s, dense)
    return (8 * h + 4) / sig + b * h / sig + 5 * b * f / t + _dispatch_bytes_per_token(m, s, dense)


def _chunk_bytes(m: ModelArch, s: LearnerSettings, t: int, layers: int, cp: int = 1,
                 dense: int = 0, linear: tuple[bool, ...] = ()) -> tuple[float, float]:
    """(bytes one pipeline chunk of ``layers`` layers (``dense`` of them a MoE model's dense
    layers, first) keeps for one micro-batch after its forward, its peak during the backward's
    rematerialisation), both per micro-batch (the module docstring's terms). Backward runs the
    layers last to first and frees each layer's saves after its backward, so a rematerialised
    unit coexists only with what the EARLIER layers keep. Under context parallelism a rank holds
    T / cp tokens of the row (attention terms: see :func:`_attention_mask_terms`)."""
    T = s.micro_batch_tokens / cp
    sig = t if s.sequence_parallel else 1
    flags = [i < dense for i in range(layers)]
    lin = list(linear) or [False] * layers  # per layer: a gated DeltaNet layer (hybrid models)
    fulls = [layer_bytes_per_token(m, s, t, cp, f, la) * T for f, la in zip(flags, lin)]
    mask = T * T if s.attention == "mask" and cp == 1 else 0.0  # one [T, T] mask shared by the layers
    if s.recompute == "none":
        kept = mask + sum(fulls)
        return kept, kept
    if s.recompute == "selective":
        kept = mask + sum(selective_layer_bytes_per_token(m, s, t, cp, f, la) * T for f, la in zip(flags, lin))
        inner = _attention_mask_terms(m, s, t, cp)[1] * T
        return kept, kept - min(_mlp_half_bytes_per_token(m, s, t, f) for f in flags) * T + inner
    unit_input = s.b * m.hidden_size / sig * T
    freqs = 4 * m.head_dim * T  # fp32 RoPE freqs, an argument of every checkpoint (one storage)
    n = min(s.recompute_num_layers, layers)
    if s.recompute_method == "uniform":
        starts = list(range(0, layers, n))  # units in forward order
        kept = mask + freqs + len(starts) * unit_input
        # unit j (1-based) is rematerialised with the inputs of units 1..j still alive
        peak = max(mask + freqs + (j + 1) * unit_input + sum(fulls[a: a + n]) for j, a in enumerate(starts))
        return kept, peak
    kept = mask + (freqs if n else 0.0) + n * unit_input + sum(fulls[n:])
    peak = mask + freqs + n * unit_input + max(fulls[:n]) if n else kept
    return kept, peak


def microbatch_activation_bytes(m: ModelArch, s: LearnerSettings, layout: ParallelLayout, stage: int,
                                *, chunk_layers: int, chunks: int) -> tuple[float, float, float]:
    """(bytes one micro-batch keeps on ``stage`` after its forward, its peak during the layers'
    backward, the last stage's transient logits term) -- see the module docstring."""
    t = layout.tp
    T = s.micro_batch_tokens / layout.cp  # this rank's tokens of the row
    sig = t if s.sequence_parallel else 1
    ids = stage_layer_ids(m.num_layers, layout, stage)
    per = []
    for j in range(chunks):
        cids = ids[j * chunk_layers: (j + 1) * chunk_layers]
        lin = tuple(m.linear is not None and m.linear.is_linear(i) for i in cids)
        per.append(_chunk_bytes(m, s, t, chunk_layers, layout.cp, _num_dense_in(m, cids), lin))
    kept = sum(k for k, _ in per)
    peak = max(kept - k + p for k, p in per)  # one chunk rematerialises while the others keep
    peak += indexer_transient_bytes(m, T)
    if stage == 0:
        tokens = T * (8 + (1 if t > 1 else 0))  # token ids (+ the vocab-parallel input mask)
        kept += tokens
        peak += tokens
    logits = 0.0
    if stage == layout.pp - 1:
        vocab = _padded_vocab(m, s, t)
        h, b = m.hidden_size, s.b
        if s.layer_spec == "te":
            final = (2 * b * h + 4) / sig  # TE norm (input, rstd) + output-layer input
        else:
            final = (8 * h + 4) / sig + b * h / sig
        logits = T * (final + 4 * vocab / t + LOGPROB_BYTES_PER_TOKEN)
    return kept, peak, logits


def indexer_transient_bytes(m: ModelArch, T: float) -> float:
    """DeepSeek sparse attention: what one layer's indexer allocates for a micro-batch of T tokens
    and frees before the attention (it runs under no_grad: nothing kept for backward). megatron's
    unfused scorer (DSAIndexer._compute_index_scores) makes the per-head scores [T, H_i, T] fp32
    and its relu (then the weighted copy) next to it: 2 x 4 H_i T^2; then the [T, T] fp32 index
    scores, the block-causal mask and the sparse mask, and the [T, topk] int64 indices. Every TP
    rank computes it whole (the indexer is replicated; SP gathers its inputs). Once per layer:
    with recompute the forward reruns it on top of the backward's rematerialisation, so it is
    priced on the peak."""
    x = m.dsa
    if x is None:
        return 0.0
    return 8.0 * x.index_n_heads * T * T + 12.0 * T * T + 8.0 * T * min(x.index_topk, T)


def _padded_vocab(m: ModelArch, s: LearnerSettings, t: int) -> int:
    q = math.lcm(s.make_vocab_size_divisible_by, t)
    return ((m.vocab_size + q - 1) // q) * q


@dataclass(frozen=True)
class StageState:
    """Parameter state of one GPU of one pipeline stage (exact: same count as the engine)."""

    params: int
    weights: int
    grads: int
    optimizer: float
    """Per GPU; with the distributed optimizer the DP-mean share (12 or 8 bytes/param / (dp x cp))."""


def stage_state(m: ModelArch, s: LearnerSettings, layout: ParallelLayout, stage: int, *,
                value_head: bool = False, trainable: bool = True, _frozen: bool = True) -> StageState:
    """Weights / grads / optimizer bytes of one GPU of ``stage``."""
    t, p = layout.tp, layout.pp
    pc = count_params(m, _padded_vocab(m, s, t), s.layer_spec)
    if not _frozen:
        pc = dataclasses.replace(pc, layer_frozen=0)
    ids = stage_layer_ids(m.num_layers, layout, stage)
    dense, linear = _num_dense_in(m, ids), _num_linear_in(m, ids)
    layers = len(ids) - dense - linear  # MoE layers (all softmax-attention layers of a dense model)
    sharded = (layers * pc.layer_sharded + dense * pc.dense_layer_sharded + linear * pc.linear_layer_sharded) // t
    norms = layers * pc.layer_replicated + dense * pc.dense_layer_replicated + linear * pc.linear_layer_replicated
    replicated = ((layers + linear) * pc.layer_replicated_weights  # router, ... (a hybrid MoE's DeltaNet layers too)
                  + dense * pc.dense_layer_replicated_weights)
    head = 0
    if stage == 0:
        sharded += pc.embedding // t
    if stage == p - 1:
        norms += pc.final_norm
        if value_head:
            head = m.hidden_size + 1  # ValueHead weight + bias, replicated, trunk dtype
        else:
            # Tied embeddings under PP: the last stage holds its own copy of the embedding.
            sharded += (pc.output or (pc.embedding if p > 1 else 0)) // t
    experts = (layers + linear) * pc.layer_expert // (layout.ep * layout.etp)  # MoE: this GPU's share of the experts
    nb = _norm_bytes(s)
    # Qwen3.5's zero-centred norms (megatron/linear_attention.py) are in the params' dtype; the
    # gated DeltaNet's out_norm is megatron's local norm like every other family's
    zc = norms - linear * m.linear.value_head_dim if m.linear is not None else 0
    weights = (sharded + head + replicated + experts + zc) * s.b + (norms - zc) * nb
    n = sharded + head + norms + replicated + experts
    frozen = len(ids) * pc.layer_frozen  # DSA's indexer: weights only, added to the returned state
    if frozen:
        full = stage_state(m, s, layout, stage, value_head=value_head, trainable=trainable, _frozen=False)
        return dataclasses.replace(full, params=full.params + frozen, weights=full.weights + frozen * s.b)
    if not trainable:
        return StageState(params=n, weights=weights, grads=0, optimizer=0.0)
    if s.lora_rank and not value_head:  # frozen base + adapters (megatron/lora.py placement)
        a = len(ids) * lora_layer_params(m, s.lora_rank, s.lora_targets, t)
        if m.is_moe:  # MoE: dense-MLP targets only on the dense layers; per-expert adapters on this GPU's E / ep experts
            mlp = tuple(x for x in s.lora_targets if x in ("gate_proj", "up_proj", "down_proj"))
            a -= (len(ids) - dense) * lora_layer_params(m, s.lora_rank, mlp, t)
        ea = (layers + linear) * lora_expert_params(m, s.lora_rank, s.lora_targets) // layout.ep
        weights += (a + ea) * s.b
        per = 8 + (4 if s.b == 2 else 0)
        opt = per * a / (layout.dp * layout.cp) + per * ea / layout.edp if s.distributed_optimizer else float(per * (a + ea))
        return StageState(params=n + a + ea, weights=weights,
                          grads=4 * (a + ea) if s.grad_reduce_in_fp32 else (a + ea) * s.b, optimizer=opt)
    grads = 4 * n if s.grad_reduce_in_fp32 else weights
    sixteen = (sharded + head + replicated + zc) if s.b == 2 else 0  # params with an fp32 master copy
    opt = 8 * (n - experts) + 4 * sixteen
    if nb == 2:
        opt += 4 * (norms - zc)
    expert_opt = (8 + (4 if s.b == 2 else 0)) * experts
    if s.distributed_optimizer:  # dense state sharded over dp x cp (megatron's dp_cp group), expert over expert-dp
        optimizer = opt / (layout.dp * layout.cp) + expert_opt / layout.edp
    else:
        optimizer = float(opt + expert_opt)
    return StageState(params=n, weights=weights, grads=grads, optimizer=optimizer)


def lora_layer_params(m: ModelArch, r: int, targets, tp: int) -> int:
    """Adapter parameters of one layer on one TP rank: column-parallel projections (q, k, v,
    gate, up) keep A [r, in] whole and 1/tp of B [out, r]; row-parallel ones (o, down) 1/tp of A
    and B whole."""
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.head_dim
    q, kv = m.num_heads * d, m.num_kv_heads * d
    col = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "gate_proj": (h, f), "up_proj": (h, f)}
    row = {"o_proj": (q, h), "down_proj": (f, h)}
    n = 0
    for t in targets:
        if t in col:
            n += r * col[t][0] + r * col[t][1] // tp
        elif t in row:
            n += r * row[t][0] // tp + r * row[t][1]
    return n


def lora_expert_params(m: ModelArch, r: int, targets) -> int:
    """Per-expert adapter parameters of one MoE layer, all E experts (megatron/lora.py
    ExpertLoraAdapter: expert-TP 1, so each EP rank holds E / ep experts' adapters whole):
    gate_up A [r, h] + B [2f, r], down A [r, f] + B [h, r]."""
    h, f = m.hidden_size, m.moe_ffn_hidden_size or 0
    per = (r * h + 2 * f * r if "experts.gate_up_proj" in targets else 0) + (r * f + h * r if "experts.down_proj" in targets else 0)
    return (m.num_experts or 0) * per


def stage_layer_ids(num_layers: int, layout: ParallelLayout, stage: int) -> list[int]:
    """Global ids of the layers pipeline stage ``stage`` holds (megatron's even split; with VPP
    v, virtual chunk j of stage k holds the (j * pp + k)-th run of num_layers / (pp * v) layers)."""
    v = layout.vpp or 1
    c = num_layers // (layout.pp * v)
    return [(j * layout.pp + stage) * c + i for j in range(v) for i in range(c)]


def in_flight(layout: ParallelLayout, stage: int, num_microbatches: int | None) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    p, v = layout.pp, layout.vpp or 1
    n = (p - stage) + ((p - 1) / v if v > 1 else 0.0)
    return n if num_microbatches is None else min(n, float(num_microbatches))


def stage_activations(m: ModelArch, s: LearnerSettings, layout: ParallelLayout, stage: int) -> tuple[float, float]:
    """(activations without the logits term, logits term) of one GPU of ``stage``: the other
    in-flight micro-batches keep their forward's saves while one runs its peak -- the end of
    its forward with the logits (last stage), or a rematerialisation in its backward."""
    v = layout.vpp or 1
    chunk_layers = m.num_layers // (layout.pp * v)
    kept, peak, logits = microbatch_activation_bytes(m, s, layout, stage, chunk_layers=chunk_layers, chunks=v)
    others = (in_flight(layout, stage, s.num_microbatches) - 1) * kept
    if kept + logits >= peak:
        return others + kept, logits
    return others + peak, 0.0


def estimate_learner(m: ModelArch, s: LearnerSettings, layout: ParallelLayout,
                     gpu_memory_gib: float, *, reference: bool = False,
                     critic: LearnerSettings | None = None, notes: tuple[str, ...] = ()) -> LearnerMemory:
    """Worst stage's per-GPU bytes; ``reference``: the KL reference model (forward-only, same
    settings); ``critic``: the PPO critic's settings (see the module docstring)."""
    layout.check_model(m.num_layers, m.num_heads, m.num_kv_heads)
    if m.num_experts:
        layout.check_experts(m.num_experts, m.moe_ffn_hidden_size)
    worst: LearnerMemory | None = None
    for k in range(layout.pp):
        st = stage_state(m, s, layout, k)
        acts, logits = stage_activations(m, s, layout, k)
        ref = stage_state(m, s, layout, k, trainable=False).weights if reference else 0
        crit = 0.0
        if critic is not None:
            c = stage_state(m, critic, layout, k, value_head=True)
            crit = c.weights + c.grads + c.optimizer
        est = LearnerMemory(
            stage=k, params=st.params, weights=float(st.weights), grads=float(st.grads), optimizer=st.optimizer,
            activations=acts, logits=logits, reserved=s.reserved_gib * GIB, limit=gpu_memory_gib * GIB,
            reference=float(ref), critic=crit, settings=s, notes=notes,
        )
        if worst is None or est.total > worst.total:
            worst = est
    assert worst is not None
    return worst


@dataclass(frozen=True)
class EngineMemory:
    tp: int
    weights: float
    kv_cache: float
    kv_bytes_per_token: float
    """KV bytes one token costs on one GPU."""
    budget: float
    """mem_fraction_static * GPU memory: what SGLang may use for weights + KV."""
    limit: float
    kv_sized_by_sglang: bool = False
    """max_total_tokens unset: SGLang gives the KV cache whatever the budget leaves."""

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache

    @property
    def kv_tokens(self) -> int:
        return int(self.kv_cache // self.kv_bytes_per_token)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget and self.kv_cache > 0

    def describe(self) -> str:
        g = lambda x: f"{x / GIB:.1f}"  # noqa: E731
        verdict = "fits" if self.fits else "DOES NOT FIT"
        sized = ", sized by SGLang" if self.kv_sized_by_sglang else ""
        return (
            f"engine per-GPU memory (TP{self.tp}): weights {g(self.weights)} + KV cache {g(self.kv_cache)} "
            f"({self.kv_tokens} tokens x {self.kv_bytes_per_token / 1024:.1f} KiB{sized}) = {g(self.total)} GiB "
            f"of {g(self.budget)} GiB (mem_fraction_static of {g(self.limit)} GiB) -> {verdict}"
        )


def linear_state_bytes_per_request(m: ModelArch, tp: int, state_bytes: int = 4, conv_bytes: int = 2) -> float:
    """A hybrid model's recurrent state per sequence on one GPU (serving, and the learner's
    per-sequence final state): every gated DeltaNet layer's nv x dk x dv state plus its
    (kernel - 1) x conv_dim conv window, heads split over ``tp``; independent of the length."""
    g = m.linear
    if g is None:
        return 0.0
    n = _num_linear_in(m, range(m.num_layers))
    conv = 2 * g.key_dim + g.value_dim
    return n * (g.num_value_heads * g.key_head_dim * g.value_head_dim * state_bytes
                + (g.conv_kernel - 1) * conv * conv_bytes) / tp


def server_nodes(tp: int, gpus_per_node: int) -> int:
    """Nodes one server of ``tp`` GPUs spans (SGLang --nnodes): 1 when it fits a node, else whole
    nodes (one-line ValueError when ``tp`` is not a multiple of a node's GPUs)."""
    if not gpus_per_node or tp <= gpus_per_node:
        return 1
    if tp % gpus_per_node:
        raise ValueError(f"inference.server.tp_size: {tp} spans nodes of {gpus_per_node} GPUs only in whole nodes "
                         f"(a multiple of {gpus_per_node})")
    return tp // gpus_per_node


def estimate_engine(m: ModelArch, *, tp: int, max_total_tokens: int | None, mem_fraction_static: float,
                    kv_dtype_bytes: int, gpu_memory_gib: float, quantization: str = "none") -> EngineMemory:
    """Per-GPU memory of one SGLang server of ``tp`` ranks (over one node or several).
    ``quantization`` fp8: the sharded linear weights take 1 byte + a fp32 scale per 128 x 128
    block (weight_sync/fp8.py); embeddings, output, norms and the replicated weights stay bf16
    (MLA's replicated down projections are fp8 too in SGLang: slightly over-counted here)."""
    if m.num_heads % tp:
        raise ValueError(f"inference.server.tp_size: num_attention_heads({m.num_heads}) % tp({tp}) != 0")
    pc = count_params(m)
    dense, linear = _num_dense_in(m, range(m.num_layers)), _num_linear_in(m, range(m.num_layers))
    moe = m.num_layers - dense - linear
    # MoE experts are sharded over the server's TP ranks too (SGLang's default expert TP)
    sharded = (moe * (pc.layer_sharded + pc.layer_expert) + dense * pc.dense_layer_sharded
               + linear * (pc.linear_layer_sharded + pc.layer_expert) + pc.embedding + pc.output)
    replicated = (moe * (pc.layer_replicated + pc.layer_replicated_weights)
                  + dense * (pc.dense_layer_replicated + pc.dense_layer_replicated_weights)
                  + linear * (pc.linear_layer_replicated + pc.layer_replicated_weights) + pc.final_norm
                  + m.num_layers * pc.layer_frozen)  # SGLang's DSA indexer: replicated linears
    weights = 2.0 * (sharded / tp + replicated)
    if quantization == "fp8":
        quantized = sharded - pc.embedding - pc.output
        weights -= (2.0 - (1.0 + 4.0 / (128 * 128))) * quantized / tp
    if m.mla is not None:  # SGLang's MLA pool: the latent and the rope key per token and layer, on every TP rank
        per_token = m.num_layers * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * kv_dtype_bytes
        if m.dsa is not None:  # + the indexer's key cache: fp8 index_head_dim + an fp32 scale per 128 (SGLang's)
            per_token += m.num_layers * (m.dsa.index_head_dim + 4 * math.ceil(m.dsa.index_head_dim / 128))
    else:  # SGLang replicates KV heads when there are fewer of them than TP ranks.
        kv_heads = max(1, m.num_kv_heads // tp)
        # gated DeltaNet layers keep no KV: a fixed-size recurrent state per request instead
        # (linear_state_bytes_per_request; SGLang's separate pool, not priced here)
        per_token = 2 * (m.num_layers - linear) * kv_heads * m.head_dim * kv_dtype_bytes
    limit = gpu_memory_gib * GIB
    budget = mem_fraction_static * limit
    if max_total_tokens is None:
        kv = max(0.0, budget - weights)
        kv -= kv % per_token
    else:
        kv = float(max_total_tokens * per_token)
    return EngineMemory(tp=tp, weights=weights, kv_cache=kv, kv_bytes_per_token=float(per_token),
                        budget=budget, limit=limit, kv_sized_by_sglang=max_total_tokens is None)
