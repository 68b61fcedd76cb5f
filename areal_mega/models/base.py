"""HF <-> megatron-core weight mapping, one adapter per model family, for ANY TP/PP(/VPP) layout.

One adapter, one code path, four callers: the weight-sync planner (:meth:`ModelAdapter.plan`,
pure metadata), live sync / HF export (:meth:`ModelAdapter.export_hf`, in exactly the plan's
order), loading (:meth:`ModelAdapter.load_hf`) and the reshard sync
(:meth:`ModelAdapter.sglang_layout`). The "canonical" form of a megatron tensor below is its
TP=1 layout (vocab padded). The callers and the megatron-core 0.16.1 layouts handled:
docs/engine.md ("Module notes").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Literal, Mapping

import torch

from areal_mega.parallel import ParallelLayout

if TYPE_CHECKING:
    from areal_mega.weight_sync.sglang_layout import EngineRank

Fusion = Literal["none", "qkv", "gate_up", "vocab", "parts", "gated_qkv", "grouped", "indexer_rows"]
"""How a megatron tensor holds its HF tensors: "parts" = rows concatenated part by part, each part
split over TP on its own (a family's ``row_parts``); "gated_qkv" = q, its output gate, k, v per
query group (Qwen3.5's gated attention); "grouped" = HF rows per key-head group [q; k; v; z] and
[b; a] regrouped part by part (Qwen3-Next's in_proj_qkvz / in_proj_ba; models/qwen3_5.py);
"indexer_rows" = each index head's rows permuted to megatron's DSA indexer order (models/dsa.py)."""
LayerSpec = Literal["local", "te"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron vocab size: ``vocab_size`` rounded up to a multiple of lcm(divisible_by, tp)."""
    m = math.lcm(divisible_by, tp)
    return ((vocab_size + m - 1) // m) * m


@dataclass(frozen=True)
class ModelArch:
    """The HF config fields the megatron model depends on, normalised across families."""

    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    init_std: float
    dtype: str
    """Storage dtype of the HF checkpoint ("float32" / "bfloat16" / "float16")."""
    rope_scaling_factor: float | None = None
    """Llama-3.1 style RoPE scaling factor (megatron's rope_scaling), None = plain RoPE."""
    qk_layernorm: bool = False
    """RMSNorm over each head's query and key before RoPE (Qwen3's q_norm / k_norm; megatron's
    qk_layernorm), one weight of head_dim shared by all heads."""
    num_experts: int | None = None
    """MoE: routed experts per layer (every layer is MoE); None = dense MLP."""
    moe_ffn_hidden_size: int | None = None
    """MoE: each expert's intermediate size (HF moe_intermediate_size)."""
    moe_topk: int = 0
    """MoE: experts per token (HF num_experts_per_tok)."""
    moe_norm_topk_prob: bool = False
    """MoE: renormalise the top-k softmax probabilities to sum to 1 (HF norm_topk_prob)."""
    dense_layers: tuple[int, ...] = ()
    """MoE: global ids of the layers that keep a dense MLP (DeepSeek's first_k_dense_replace,
    Qwen2-MoE's mlp_only_layers); megatron's moe_layer_freq list."""
    moe_score_function: str = "softmax"
    """MoE router scores: "softmax" (Qwen/Mixtral) or "sigmoid" (DeepSeek-V3, GLM-4.5)."""
    moe_router_fp32: bool = False
    """MoE: HF computes the router logits in fp32 whatever the model's dtype (DeepseekV3TopkRouter,
    Glm4MoeTopkRouter); megatron's moe_router_dtype "fp32"."""
    moe_expert_bias: bool = False
    """MoE: a per-expert bias added to the scores for the top-k choice only (DeepSeek-V3's
    e_score_correction_bias, aux-loss-free balancing); megatron's router.expert_bias buffer."""
    moe_num_groups: int | None = None
    """MoE grouped routing: experts split into this many groups (HF n_group); None = no groups."""
    moe_group_topk: int | None = None
    """MoE grouped routing: groups kept per token (HF topk_group)."""
    moe_scaling_factor: float | None = None
    """MoE: the routing weights times this (HF routed_scaling_factor); None = 1."""
    moe_shared_ffn_hidden_size: int | None = None
    """MoE: intermediate size of the shared expert(s) every token goes through; None = none."""
    moe_shared_expert_gate: bool = False
    """MoE: the shared expert's output times sigmoid(x . w) (Qwen2-MoE's shared_expert_gate)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dims that RoPE rotates (GLM-4.5's partial_rotary_factor)."""
    mla: "MLAArch | None" = None
    """Multi-latent attention dims (DeepSeek-V3 family); None = standard GQA attention."""
    yarn: "YarnArch | None" = None
    """YaRN rope scaling (DeepSeek-V3 family); None = plain RoPE."""
    linear: "LinearAttnArch | None" = None
    """Hybrid linear attention (Qwen3.5 / Qwen3-Next gated DeltaNet layers); None = every layer softmax."""
    attention_output_gate: bool = False
    """The softmax-attention output times sigmoid(a gate projected with q) (Qwen3.5's gated attention)."""
    attention_sinks: bool = False
    """A learned per-head logit in every softmax denominator (gpt-oss's ``sinks``; megatron's
    softmax_type "learnable", ``core_attention.softmax_offset``)."""
    sliding_window: int | None = None
    """Each query sees itself and the ``sliding_window - 1`` tokens before it on the layers in
    ``sliding_window_layers`` (HF's ``kv_idx > q_idx - sliding_window``); None = no window."""
    sliding_window_layers: tuple[int, ...] = ()
    """Global ids of the windowed layers (gpt-oss: HF layer_types "sliding_attention")."""
    linear_bias: bool = False
    """Biases on every linear: attention q/k/v/o, router, experts (megatron's add_bias_linear; gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU: (clamp(up, -l, l) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=l)
    (megatron's quick_gelu GLU with glu_linear_offset 1 and activation_func_clamp_value l); None = SiLU SwiGLU."""
    dsa: "DSAArch | None" = None
    """DeepSeek sparse attention on MLA (DeepSeek-V3.2, GLM-5: the indexer's top-k); None = dense."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers


@dataclass(frozen=True)
class MLAArch:
    """Multi-latent attention (DeepSeek-V2/V3): queries through an optional low-rank bottleneck,
    keys/values from one shared latent plus a shared rotary key (megatron's MLATransformerConfig)."""

    q_lora_rank: int | None
    """Query bottleneck rank (HF q_lora_rank); None = a full q_proj (V2-Lite, Moonlight)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    """Per-head query/key dims without RoPE (megatron qk_head_dim)."""
    qk_rope_head_dim: int
    """Per-head query/key dims with RoPE, the key's shared by all heads (qk_pos_emb_head_dim)."""
    v_head_dim: int


@dataclass(frozen=True)
class DSAArch:
    """DeepSeek sparse attention's lightning indexer (HF index_* keys; megatron's DSAIndexer)."""

    index_topk: int
    """Keys each query attends to (HF index_topk)."""
    index_n_heads: int
    index_head_dim: int
    rope_interleaved: bool
    """The indexer's RoPE on pairs (x0, x1), ... (GLM-5) or on halves (x_i, x_i+d/2) (DeepSeek-V3.2)."""


@dataclass(frozen=True)
class LinearAttnArch:
    """Gated DeltaNet dims (HF linear_* keys; megatron-core's GatedDeltaNet) and which layers use it."""

    layer_types: tuple[str, ...]
    """Per global layer: "linear_attention" (gated DeltaNet) or "full_attention" (gated softmax)."""
    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"


@dataclass(frozen=True)
class YarnArch:
    """YaRN RoPE scaling as DeepSeek-V3 configures it (HF rope_type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    truncate: bool = True
    """Round the YaRN correction range to integers (HF rope_parameters.truncate; gpt-oss: false)."""


@dataclass(frozen=True)
class McoreParam:
    """One megatron parameter of a stage, described without touching it."""

    chunk: int
    """Virtual pipeline chunk on its stage (0 without interleaving)."""
    name: str
    """Name inside that chunk's GPTModel (layer index local to the chunk)."""
    shape: tuple[int, ...]
    """Full shape: TP-gathered and vocab-padded."""
    tp_dim: int | None
    """Dimension split across TP ranks; None = replicated."""
    fusion: Fusion
    hf_names: tuple[str, ...]
    """HF tensors this parameter holds, in order (several for fused qkv / gate_up)."""
    exported: bool = True
    """False for the tied output-layer copy on the last stage (its HF tensor comes from stage 0)."""
    ep_rank: int | None = None
    """MoE expert weights: the expert-parallel rank holding this expert (``name`` is then local
    to that rank, ``tp_dim`` splits over the expert-TP group); None = on every rank of the stage."""


@dataclass(frozen=True)
class Block:
    """Where part of an HF tensor lives in one local tensor (a TP shard, an engine parameter).

    The HF box ``hf_box`` (``(start, stop)`` per HF dimension) sits in the local tensor at
    ``local[local_index][local_start[0]:..., local_start[1]:...]`` (``local_index``: leading
    indices of a stacked tensor, e.g. the expert of SGLang's ``w13_weight``). Inside a block the
    map is a translation, so any sub-box of ``hf_box`` maps by the same offsets (reshard.py)."""

    hf_name: str
    hf_box: tuple[tuple[int, int], ...]
    local_start: tuple[int, ...]
    local_index: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.hf_box)


@dataclass(frozen=True)
class HFTensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    stage: int
    source: McoreParam


@dataclass(frozen=True)
class StagePlan:
    """What pipeline stage ``stage`` holds: its megatron params and the HF tensors it exports."""

    stage: int
    params: tuple[McoreParam, ...]
    tensors: tuple[HFTensorSpec, ...]


@dataclass(frozen=True)
class _Rule:
    mcore: str
    hf: tuple[str, ...]
    tp_dim: int | None
    fusion: Fusion


def layer_chunks(num_layers: int, layout: ParallelLayout) -> list[list[list[int]]]:
    """Global layer ids per [stage][chunk], megatron's interleaved assignment.

    With ``vpp`` chunks per stage, chunk ``c`` of stage ``p`` holds layers starting at
    ``c * num_layers / vpp + p * num_layers / (pp * vpp)`` (``get_transformer_layer_offset``).
    """
    vpp = layout.vpp or 1
    per = num_layers // (layout.pp * vpp)
    assert per * layout.pp * vpp == num_layers, (num_layers, layout)
    return [
        [list(range(c * num_layers // vpp + p * per, c * num_layers // vpp + (p + 1) * per)) for c in range(vpp)]
        for p in range(layout.pp)
    ]


def _config_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise ValueError(f"hf_config: expected a mapping or a transformers config, got {type(hf_config).__name__}")


class ModelAdapter:
    """Llama-style decoder mapping (RMSNorm, RoPE, GQA, SwiGLU). Families subclass this."""

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    qkv_bias: ClassVar[bool] = False

    def __init__(self, hf_config: Any):
        self.hf_config = _config_dict(hf_config)
        self.arch = self.parse_config(self.hf_config)

    # ---- config -------------------------------------------------------------------------------
    def parse_config(self, c: dict) -> ModelArch:
        missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in c]
        if missing:
            raise ValueError(f"hf config: missing required key(s) {missing}")
        if c.get("model_type") != self.model_type:
            raise ValueError(f"model_type: {c.get('model_type')!r} is not {self.model_type!r}")
        archs = c.get("architectures") or []
        if archs and self.architecture not in archs:
            raise ValueError(f"architectures: {archs} does not include {self.architecture!r} (only causal LMs are supported)")
        for key in ("hidden_act",):
            if c.get(key, "silu") != "silu":
                raise ValueError(f"{key}: only 'silu' is supported, got {c[key]!r}")
        if c.get("attention_bias", False) != self.qkv_bias:
            raise ValueError(f"attention_bias: {c['attention_bias']!r} is not supported for {self.model_type}")
        if c.get("mlp_bias", False):
            raise ValueError("mlp_bias: true is not supported")
        if c.get("use_sliding_window", False):
            raise ValueError("use_sliding_window: true is not supported")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        factor = None
        if rtype == "llama3":
            # megatron's rope_scaling hard-codes low=1, high=4, original=8192 (Llama 3.1).
            want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            for k, v in want.items():
                if float(rope.get(k, v)) != v:
                    raise ValueError(f"rope_parameters.{k}: megatron supports only {v}, got {rope[k]}")
            factor = float(rope["factor"])
        elif rtype != "default":
            raise ValueError(f"rope_parameters.rope_type: {rtype!r} is not supported (default, llama3)")
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        dtype = c.get("dtype") or c.get("torch_dtype") or "float32"
        return ModelArch(
            model_type=self.model_type,
            architecture=self.architecture,
            num_layers=int(c["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(c["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            vocab_size=int(c["vocab_size"]),
            rope_theta=theta,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=self.qkv_bias,
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            init_std=float(c.get("initializer_range", 0.02)),
            dtype=str(dtype).replace("torch.", ""),
            rope_scaling_factor=factor,
        )

    # ---- naming -------------------------------------------------------------------------------
    # HF names of the MoE block, per family (Qwen-style defaults; Mixtral and DeepSeek override).
    hf_moe: ClassVar[str] = "mlp"
    """HF module holding a layer's router and experts (Mixtral: block_sparse_moe)."""
    hf_expert_proj: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    """HF names of an expert's gate / up / down projections (Mixtral: w1, w3, w2)."""
    hf_shared: ClassVar[str] = "mlp.shared_experts"
    """HF module of the shared expert(s) (Qwen2-MoE: mlp.shared_expert)."""

    def layer_rules(self, spec: LayerSpec = "local", layer: int = 0) -> list[_Rule]:
        """Rules of global layer ``layer``, names relative to ``decoder.layers.{i}.`` /
        ``model.layers.{j}.`` (dense and MoE layers differ in their MLP)."""
        a = self.arch
        moe = a.is_moe_layer(layer)
        ln_in = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" and a.mla is None else "input_layernorm.weight"
        ln_mlp = "mlp.linear_fc1.layer_norm_weight" if spec == "te" else "pre_mlp_layernorm.weight"
        rules = [_Rule(ln_in, ("input_layernorm.weight",), None, "none")]
        if a.mla is not None:
            rules += self.mla_rules(spec)
        else:
            rules.append(_Rule(
                "self_attention.linear_qkv.weight",
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), 0, "qkv"))
            if a.qkv_bias:
                rules.append(_Rule(
                    "self_attention.linear_qkv.bias",
                    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), 0, "qkv"))
            if a.qk_layernorm:
                rules += [
                    _Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), None, "none"),
                    _Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), None, "none"),
                ]
        rules += [
            _Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), 1, "none"),
            _Rule(ln_mlp if not moe else "pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), None, "none"),
        ]
        if moe:  # the router (+ shared experts); the routed experts come from expert_params
            rules.append(_Rule("mlp.router.weight", (f"{self.hf_moe}.gate.weight",), None, "none"))
            if a.moe_expert_bias:  # a buffer, not a trained parameter (see docs/engine.md)
                rules.append(_Rule("mlp.router.expert_bias", (f"{self.hf_moe}.gate.e_score_correction_bias",), None, "none"))
            if a.moe_shared_ffn_hidden_size:
                sh = self.hf_shared
                rules += [
                    _Rule("mlp.shared_experts.linear_fc1.weight", (f"{sh}.gate_proj.weight", f"{sh}.up_proj.weight"), 0, "gate_up"),
                    _Rule("mlp.shared_experts.linear_fc2.weight", (f"{sh}.down_proj.weight",), 1, "none"),
                ]
                if a.moe_shared_expert_gate:
                    rules.append(_Rule("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), None, "none"))
        else:
            rules += [
                _Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0, "gate_up"),
                _Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), 1, "none"),
            ]
        return rules

    def mla_rules(self, spec: LayerSpec) -> list[_Rule]:
        """MLASelfAttention (local spec: column-parallel down projections, gathered inside megatron;
        TE spec: the latent norms fused into the up projections -- unverified here, no TE on CPU)."""
        m = self.arch.mla
        q_ln = "self_attention.linear_q_up_proj.layer_norm_weight" if spec == "te" else "self_attention.q_layernorm.weight"
        kv_ln = "self_attention.linear_kv_up_proj.layer_norm_weight" if spec == "te" else "self_attention.kv_layernorm.weight"
        if m.q_lora_rank is None:
            rules = [_Rule("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), 0, "none")]
        else:
            rules = [
                _Rule("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), 0 if spec == "local" else None, "none"),
                _Rule(q_ln, ("self_attn.q_a_layernorm.weight",), None, "none"),
                _Rule("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), 0, "none"),
            ]
        return rules + [
            _Rule("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), 0 if spec == "local" else None, "none"),
            _Rule(kv_ln, ("self_attn.kv_a_layernorm.weight",), None, "none"),
            _Rule("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), 0, "none"),
        ]

    def expert_params(self, chunk: int, local_layer: int, layer: int, layout: ParallelLayout,
                      grouped: bool = False) -> list[McoreParam]:
        """The experts of one MoE layer, global expert order (expert ``g`` lives on EP rank
        ``g // (E / ep)`` as local expert ``g % (E / ep)``). Names follow megatron's
        SequentialMLP (``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight``, local spec) or,
        with ``grouped``, TEGroupedMLP (``mlp.experts.linear_fc{1,2}.weight{j}``, TE spec)."""
        a = self.arch
        if not a.is_moe_layer(layer):
            return []
        per = a.num_experts // layout.ep
        h, f = a.hidden_size, a.moe_ffn_hidden_size
        gate, up, down = self.hf_expert_proj
        out = []
        for g in range(a.num_experts):
            j = g % per
            pre = f"decoder.layers.{local_layer}.mlp.experts."
            fc1 = f"{pre}linear_fc1.weight{j}" if grouped else f"{pre}local_experts.{j}.linear_fc1.weight"
            fc2 = f"{pre}linear_fc2.weight{j}" if grouped else f"{pre}local_experts.{j}.linear_fc2.weight"
            hf = f"model.layers.{layer}.{self.hf_moe}.experts.{g}."
            out.append(McoreParam(chunk, fc1, (2 * f, h), 0, "gate_up", (hf + f"{gate}.weight", hf + f"{up}.weight"),
                                  ep_rank=g // per))
            out.append(McoreParam(chunk, fc2, (h, f), 1, "none", (hf + f"{down}.weight",), ep_rank=g // per))
        return out

    def _leaf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF shape per layer-relative name (experts as ``<moe>.experts.*.<proj>.weight``)."""
        a = self.arch
        h, d = a.hidden_size, a.head_dim
        e, f = a.num_experts or 0, a.moe_ffn_hidden_size or 0
        gate, up, down = self.hf_expert_proj
        ex = f"{self.hf_moe}.experts.*."
        fs, sh = a.moe_shared_ffn_hidden_size or 0, self.hf_shared
        table = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (a.num_heads * d, h),
            "self_attn.k_proj.weight": (a.num_kv_heads * d, h),
            "self_attn.v_proj.weight": (a.num_kv_heads * d, h),
            "self_attn.q_proj.bias": (a.num_heads * d,),
            "self_attn.k_proj.bias": (a.num_kv_heads * d,),
            "self_attn.v_proj.bias": (a.num_kv_heads * d,),
            "self_attn.o_proj.weight": (h, a.num_heads * d),
            "mlp.gate_proj.weight": (a.ffn_hidden_size, h),
            "mlp.up_proj.weight": (a.ffn_hidden_size, h),
            "mlp.down_proj.weight": (h, a.ffn_hidden_size),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            f"{self.hf_moe}.gate.weight": (e, h),
            f"{self.hf_moe}.gate.e_score_correction_bias": (e,),
            f"{ex}{gate}.weight": (f, h),
            f"{ex}{up}.weight": (f, h),
            f"{ex}{down}.weight": (h, f),
            f"{sh}.gate_proj.weight": (fs, h),
            f"{sh}.up_proj.weight": (fs, h),
            f"{sh}.down_proj.weight": (h, fs),
            "mlp.shared_expert_gate.weight": (1, h),
        }
        m = a.mla
        if m is not None:
            qd = m.qk_nope_head_dim + m.qk_rope_head_dim
            n = a.num_heads
            table.update({
                "self_attn.q_proj.weight": (n * qd, h),
                "self_attn.q_a_proj.weight": (m.q_lora_rank or 0, h),
                "self_attn.q_a_layernorm.weight": (m.q_lora_rank or 0,),
                "self_attn.q_b_proj.weight": (n * qd, m.q_lora_rank or 0),
                "self_attn.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
                "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
                "self_attn.kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                "self_attn.o_proj.weight": (h, n * m.v_head_dim),
            })
        return table

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        cache = self.__dict__.setdefault("_hf_shape_cache", {})  # pure in (arch, name); planners call it ~1e5 times
        if hf_name not in cache:
            cache[hf_name] = self._hf_shape(hf_name)
        return cache[hf_name]

    def _hf_shape(self, hf_name: str) -> tuple[int, ...]:
        a = self.arch
        h = a.hidden_size
        top = {"model.embed_tokens.weight": (a.vocab_size, h), "lm_head.weight": (a.vocab_size, h), "model.norm.weight": (h,)}
        if hf_name in top:
            return top[hf_name]
        leaf = hf_name.split("layers.")[-1].split(".", 1)[-1] if ".layers." in hf_name else hf_name
        ex = f"{self.hf_moe}.experts."
        if leaf.startswith(ex):  # <moe>.experts.{i}.gate_proj.weight -> one shape per kind
            leaf = ex + "*." + leaf[len(ex):].split(".", 1)[1]
        return self._leaf_shapes()[leaf]

    def mcore_shape(self, leaf: str) -> tuple[int, ...]:
        """Full (TP=1, vocab unpadded) shape of a layer-relative megatron parameter."""
        a = self.arch
        h = a.hidden_size
        qkv_rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        full = {
            "self_attention.linear_qkv.weight": (qkv_rows, h),
            "self_attention.linear_qkv.bias": (qkv_rows,),
            "self_attention.linear_proj.weight": (h, a.num_heads * a.head_dim),
            "mlp.linear_fc1.weight": (2 * a.ffn_hidden_size, h),
            "mlp.linear_fc2.weight": (h, a.ffn_hidden_size),
            "self_attention.q_layernorm.weight": (a.head_dim,),
            "self_attention.k_layernorm.weight": (a.head_dim,),
            "mlp.router.weight": (a.num_experts or 0, h),
            "mlp.router.expert_bias": (a.num_experts or 0,),
            "mlp.shared_experts.linear_fc1.weight": (2 * (a.moe_shared_ffn_hidden_size or 0), h),
            "mlp.shared_experts.linear_fc2.weight": (h, a.moe_shared_ffn_hidden_size or 0),
            "mlp.shared_experts.gate_weight": (1, h),
        }
        m = a.mla
        if m is not None:
            qd, q = m.qk_nope_head_dim + m.qk_rope_head_dim, m.q_lora_rank or 0
            full.update({
                "self_attention.linear_q_proj.weight": (a.num_heads * qd, h),
                "self_attention.linear_q_down_proj.weight": (q, h),
                "self_attention.q_layernorm.weight": (q,),
                "self_attention.linear_q_up_proj.layer_norm_weight": (q,),
                "self_attention.linear_q_up_proj.weight": (a.num_heads * qd, q),
                "self_attention.linear_kv_down_proj.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
                "self_attention.kv_layernorm.weight": (m.kv_lora_rank,),
                "self_attention.linear_kv_up_proj.layer_norm_weight": (m.kv_lora_rank,),
                "self_attention.linear_kv_up_proj.weight": (a.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                "self_attention.linear_proj.weight": (h, a.num_heads * m.v_head_dim),
            })
        return full.get(leaf, (h,))

    # ---- SGLang's side (the reshard sync; weight_sync/sglang_layout.py) -------------------------
    sglang_not_synced: ClassVar[str | None] = None
    """Why a runtime reshard sync of this family is refused although its SGLang layout is planned
    (something SGLang's loader derives that the receiver does not); None = synced."""

    def sglang_layout(self, b: "EngineRank") -> None:
        """SGLang 0.5.23's parameters of one engine rank, in load order, through ``b``'s builders:
        Llama's layout (sglang/srt/models/llama.py; qwen2.py, qwen3.py alike). A family SGLang lays
        out otherwise overrides this, or sets it to None (mode reshard refused, broadcast serves it)."""
        if self.arch.is_moe:  # an MoE family that inherited this would silently lose its experts
            raise ValueError(f"model_type {self.model_type!r}: an MoE family needs its own sglang_layout "
                             "(override it, or set it to None: weight_sync.mode broadcast)")
        b.embedding()
        for i in range(self.arch.num_layers):
            b.gqa_attention(f"model.layers.{i}")
            b.dense_mlp(f"model.layers.{i}")
        b.final()

    def bucket_group(self, hf_name: str) -> str | None:
        """Tensors a server must receive in ONE weight update (the weight-sync planner keeps
        consecutive tensors of one group in one bucket); None: no constraint."""
        return None

    def frozen_hf_tensors(self, source_dir: Any) -> dict[str, torch.Tensor]:
        """HF tensors not built in megatron that an HF export writes back unchanged, read from the
        source HF dir (a vision-language checkpoint's vision tower); {} for text models."""
        return {}

    def checkpoint_view(self, reader: Any) -> Any:
        """The HF checkpoint reader as the plan's names see it (gpt-oss: one expert's slice of a
        stacked tensor, models/gpt_oss.py); the reader itself for per-tensor checkpoints."""
        return reader

    def checkpoint_name(self, hf_name: str) -> str:
        """The checkpoint tensor that holds plan tensor ``hf_name`` (itself unless stacked)."""
        return hf_name

    def stack_hf(self, tensors: Iterable[tuple[str, torch.Tensor | None]]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Plan-named ``(name, tensor)`` -> the checkpoint's tensors (identity unless stacked)."""
        return iter(tensors)

    def checkpoint_specs(self, tensors: Iterable[HFTensorSpec]) -> list[HFTensorSpec]:
        """A stage's plan tensors as :meth:`stack_hf` yields them (what a server receives)."""
        return list(tensors)

    def hf_names(self) -> list[str]:
        """Every tensor of the HF checkpoint, in plan order for a single stage."""
        return [t.name for t in self.plan(ParallelLayout(world_size=1))[0].tensors]

    def check_hf_shapes(self, shape_of: Callable[[str], tuple[int, ...]]) -> None:
        """Raise ValueError naming the first HF tensor whose shape (``shape_of(name)``, e.g. read
        from safetensors headers) differs from what this config implies. No tensor is read."""
        for n in self.hf_names():
            got, want = tuple(shape_of(n)), self.hf_shape(n)
            if got != want:
                raise ValueError(f"{n}: checkpoint shape {got} != model shape {want}")

    # ---- the pure planner -----------------------------------------------------------------------
    def plan(
        self,
        layout: ParallelLayout,
        *,
        spec: LayerSpec = "local",
        dtype: str | None = None,
        make_vocab_size_divisible_by: int = 128,
    ) -> list[StagePlan]:
        """Per PP stage: megatron params (chunk order) and the HF tensors they export, in order.

        Pure function of the HF config and ``layout`` (no process groups, no tensors). Every HF
        tensor appears in exactly one stage's ``tensors``; with tied embeddings the last stage's
        ``output_layer.weight`` is listed in ``params`` with ``exported=False``.
        """
        a = self.arch
        layout.check_model(a.num_layers, a.num_heads, a.num_kv_heads)
        if a.is_moe:
            layout.check_experts(a.num_experts, a.moe_ffn_hidden_size)
        split = [("moe_shared_expert_intermediate_size", a.moe_shared_ffn_hidden_size or 0)]
        if a.mla is not None and spec == "local":  # the local spec splits MLA's down projections over TP
            split += [("q_lora_rank", a.mla.q_lora_rank or 0),
                      ("kv_lora_rank + qk_rope_head_dim", a.mla.kv_lora_rank + a.mla.qk_rope_head_dim)]
        for what, size in split:
            if size % layout.tp:
                raise ValueError(f"parallel layout: {what}({size}) % tp({layout.tp}) != 0")
        dtype = dtype or a.dtype
        vocab = padded_vocab_size(a.vocab_size, layout.tp, make_vocab_size_divisible_by)
        h = a.hidden_size
        stages = []
        chunks = layer_chunks(a.num_layers, layout)
        for p, stage_chunks in enumerate(chunks):
            params: list[McoreParam] = []
            last_chunk = len(stage_chunks) - 1
            for c, layer_ids in enumerate(stage_chunks):
                if p == 0 and c == 0:
                    params.append(
                        McoreParam(c, "embedding.word_embeddings.weight", (vocab, h), 0, "vocab", ("model.embed_tokens.weight",))
                    )
                for local, gid in enumerate(layer_ids):
                    for r in self.layer_rules(spec, gid):
                        params.append(
                            McoreParam(
                                c,
                                f"decoder.layers.{local}.{r.mcore}",
                                self.mcore_shape(r.mcore),
                                r.tp_dim,
                                r.fusion,
                                tuple(f"model.layers.{gid}.{n}" for n in r.hf),
                            )
                        )
                    params += self.expert_params(c, local, gid, layout, grouped=spec == "te")
                if p == layout.pp - 1 and c == last_chunk:
                    params.append(McoreParam(c, "decoder.final_layernorm.weight", (h,), None, "none", ("model.norm.weight",)))
                    if not a.tie_word_embeddings:
                        params.append(McoreParam(c, "output_layer.weight", (vocab, h), 0, "vocab", ("lm_head.weight",)))
                    elif layout.pp > 1:
                        params.append(
                            McoreParam(
                                c, "output_layer.weight", (vocab, h), 0, "vocab", ("model.embed_tokens.weight",), exported=False
                            )
                        )
            tensors = tuple(
                HFTensorSpec(n, self.hf_shape(n), dtype, p, prm) for prm in params if prm.exported for n in prm.hf_names
            )
            stages.append(StagePlan(p, tuple(params), tensors))
        return stages

    # ---- tensor transforms (canonical = TP=1 megatron layout) ---------------------------------
    def to_hf(self, prm: McoreParam, canon: torch.Tensor) -> list[torch.Tensor]:
        """Canonical megatron tensor -> its HF tensors (``prm.hf_names`` order)."""
        a = self.arch
        if prm.fusion == "none":
            return [canon]
        if prm.fusion == "vocab":
            return [canon[: a.vocab_size]]
        if prm.fusion == "gate_up":
            return list(canon.chunk(2, dim=0))
        hpg, d = a.heads_per_group, a.head_dim
        g = canon.view(a.num_kv_heads, (hpg + 2) * d, *canon.shape[1:])
        q = g[:, : hpg * d].reshape(a.num_heads * d, *canon.shape[1:])
        k = g[:, hpg * d : (hpg + 1) * d].reshape(a.num_kv_heads * d, *canon.shape[1:])
        v = g[:, (hpg + 1) * d :].reshape(a.num_kv_heads * d, *canon.shape[1:])
        return [q, k, v]

    def from_hf(self, prm: McoreParam, hf: list[torch.Tensor], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """HF tensors (``prm.hf_names`` order) -> megatron tensor of ``shape`` (default: the full
        canonical ``prm.shape``). Works unchanged on the TP slices :meth:`hf_slices` selects (the
        group / gate-up / vocab structure is read from the inputs' sizes), which is how
        :meth:`load_hf` builds each rank's shard without materialising the full tensor."""
        a = self.arch
        shape = tuple(shape or prm.shape)
        if prm.fusion == "none":
            return hf[0]
        if prm.fusion == "vocab":
            out = hf[0].new_zeros(shape)
            out[: hf[0].shape[0]] = hf[0]  # rows past the real vocabulary stay zero
            return out
        if prm.fusion == "gate_up":
            return torch.cat(hf, dim=0)
        d, hpg = a.head_dim, a.heads_per_group
        rest = hf[0].shape[1:]
        groups = hf[1].shape[0] // d
        q = hf[0].reshape(groups, hpg * d, *rest)
        k = hf[1].reshape(groups, d, *rest)
        v = hf[2].reshape(groups, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(shape)

    def hf_slices(self, prm: McoreParam, tp: int, tp_rank: int) -> list[tuple[str, int | None, int, int]]:
        """For each HF tensor of ``prm``: ``(name, dim, start, stop)`` = the part TP rank
        ``tp_rank`` needs (``dim`` None = the whole tensor). For expert weights pass the
        expert-TP size and rank."""
        if prm.tp_dim is None or tp == 1:
            return [(n, None, 0, 0) for n in prm.hf_names]
        out = []
        for n in prm.hf_names:
            size = self.hf_shape(n)[prm.tp_dim]
            if prm.fusion == "vocab":  # padded rows are split; the real ones end at vocab_size
                per = prm.shape[0] // tp
                out.append((n, 0, min(tp_rank * per, size), min((tp_rank + 1) * per, size)))
            else:  # plain, gate/up halves, and q/k/v all split into tp equal, ordered pieces
                per = size // tp
                out.append((n, prm.tp_dim, tp_rank * per, (tp_rank + 1) * per))
        return out

    def shard_blocks(self, prm: McoreParam, tp: int, tp_rank: int) -> list[Block]:
        """The HF boxes TP rank ``tp_rank`` of ``tp`` holds in its LOCAL shard of ``prm`` and where
        (pure: the resharding planner's view of megatron's layouts, the same rules as
        :meth:`merge_tp` / :meth:`to_hf`). For expert weights pass the expert-TP size and rank."""
        hf = {n: self.hf_shape(n) for n in prm.hf_names}
        d = prm.tp_dim
        size = 1 if d is None else tp
        rank = 0 if d is None else tp_rank

        def box(n: str, dim: int | None, a: int = 0, b: int = 0) -> tuple[tuple[int, int], ...]:
            return tuple((a, b) if i == dim else (0, s) for i, s in enumerate(hf[n]))

        def at(n: str, dim: int | None, off: int) -> tuple[int, ...]:
            return tuple(off if i == dim else 0 for i in range(len(hf[n])))

        if prm.fusion == "vocab":  # megatron's padded rows split evenly; the real ones end at vocab_size
            (n,) = prm.hf_names
            per = prm.shape[0] // size
            a, b = min(rank * per, hf[n][0]), min((rank + 1) * per, hf[n][0])
            return [Block(n, box(n, 0, a, b), at(n, 0, 0))] if b > a else []
        if prm.fusion == "none":
            (n,) = prm.hf_names
            if d is None:
                return [Block(n, box(n, None), at(n, None, 0))]
            per = hf[n][d] // size
            return [Block(n, box(n, d, rank * per, (rank + 1) * per), at(n, d, 0))]
        if prm.fusion == "gate_up":  # local shard = [gate_r; up_r]
            gate, up = prm.hf_names
            per = hf[gate][0] // size
            return [Block(gate, box(gate, 0, rank * per, (rank + 1) * per), at(gate, 0, 0)),
                    Block(up, box(up, 0, rank * per, (rank + 1) * per), at(up, 0, per))]
        # qkv: the local shard holds whole query groups, each [q x heads_per_group, k, v] rows
        q, k, v = prm.hf_names
        a = self.arch
        hd, hpg = a.head_dim, a.heads_per_group
        groups = a.num_kv_heads // size
        out = []
        for j in range(groups):
            g = rank * groups + j
            base = j * (hpg + 2) * hd
            out += [Block(q, box(q, 0, g * hpg * hd, (g + 1) * hpg * hd), at(q, 0, base)),
                    Block(k, box(k, 0, g * hd, (g + 1) * hd), at(k, 0, base + hpg * hd)),
                    Block(v, box(v, 0, g * hd, (g + 1) * hd), at(v, 0, base + (hpg + 1) * hd))]
        return out

    @staticmethod
    def merge_tp(prm: McoreParam, shards: list[torch.Tensor]) -> torch.Tensor:
        """TP shards (rank order) -> canonical tensor."""
        if prm.tp_dim is None or len(shards) == 1:
            return shards[0]
        if prm.fusion == "gate_up":  # each shard is [gate_r; up_r]
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=prm.tp_dim)

    @staticmethod
    def split_tp(prm: McoreParam, canon: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        """Canonical tensor -> the shard TP rank ``tp_rank`` of ``tp`` holds."""
        if prm.tp_dim is None or tp == 1:
            return canon
        if prm.fusion == "gate_up":
            gate, up = canon.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
        return canon.chunk(tp, dim=prm.tp_dim)[tp_rank]

    # ---- runtime: megatron -> HF (weight sync, mcore->HF conversion) ---------------------------
    def export_hf(
        self,
        chunks: list[torch.nn.Module],
        stage_plan: StagePlan,
        tp_group: Any,
        names: Iterable[str] | None = None,
        *,
        experts: "ExpertExport | None" = None,
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Yield ``(hf_name, full tensor)`` for this stage, in ``stage_plan.tensors`` order.

        Collective over ``tp_group``: every TP rank of the stage must call it with the same
        ``names`` (None = all). Each needed megatron parameter is all-gathered once; the yielded
        tensors are new (safe to keep) and in the parameter dtype.

        MoE (``experts`` given, on every rank where ``layout.exports(rank)``): each expert is
        gathered over the expert-TP group of the EP rank that owns it (expert-dp 0) and sent
        point-to-point to the stage's sender (dp=0, tp=0, ep=0), once. Every exporting rank
        yields every name in the same order; a rank yields ``None`` for a tensor it does not
        hold (only the sender holds them all).
        """
        import torch.distributed as dist

        wanted = None if names is None else set(names)
        if wanted is not None:
            unknown = wanted - {t.name for t in stage_plan.tensors}
            if unknown:
                raise ValueError(f"names: {sorted(unknown)[:5]} are not exported by stage {stage_plan.stage}")
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        local = [named_tensors(m) for m in chunks]
        dense = experts is None or experts.dense
        for prm in stage_plan.params:
            if not prm.exported or (wanted is not None and not wanted.intersection(prm.hf_names)):
                continue
            if prm.ep_rank is not None:
                if experts is not None:
                    canon = experts.gather(prm, local[prm.chunk])
                else:  # ep = 1 and etp = tp: an expert is split over the TP group like a dense MLP
                    canon = self._gather(prm, local[prm.chunk][prm.name].detach(), tp_group, tp)
            elif dense:
                canon = self._gather(prm, local[prm.chunk][prm.name].detach(), tp_group, tp)
            else:
                canon = None
            if canon is not None and prm.name.endswith("router.expert_bias"):
                # megatron keeps the bias in fp32 whatever the params' dtype: export it in theirs
                canon = canon.to(local[prm.chunk][prm.name.replace("expert_bias", "weight")].dtype)
            outs = self.to_hf(prm, canon) if canon is not None else [None] * len(prm.hf_names)
            for n, t in zip(prm.hf_names, outs):
                if wanted is None or n in wanted:
                    yield n, (t.clone() if t is not None else None)

    def _gather(self, prm: McoreParam, shard: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        import torch.distributed as dist

        if size > 1 and prm.tp_dim is not None:
            parts = [torch.empty_like(shard) for _ in range(size)]
            dist.all_gather(parts, shard.contiguous(), group=group)
        else:
            parts = [shard]
        canon = self.merge_tp(prm, parts)
        assert tuple(canon.shape) == prm.shape, (prm.name, tuple(canon.shape), prm.shape)
        return canon

    # ---- runtime: HF -> megatron (model loading, HF->mcore conversion) -------------------------
    def load_hf(
        self,
        chunks: list[torch.nn.Module],
        stage_plan: StagePlan,
        tp: int,
        tp_rank: int,
        read_slice: Callable[[str, int | None, int, int], torch.Tensor],
        shape_of: Callable[[str], tuple[int, ...]],
        *,
        ep_rank: int = 0,
        etp: int | None = None,
        etp_rank: int | None = None,
    ) -> int:
        """Copy HF tensors into the local shards of this stage's parameters; returns the count.

        ``read_slice(name, dim, start, stop)`` returns ``tensor.narrow(dim, start, stop - start)``
        (the whole tensor when ``dim`` is None), so each rank reads only its TP part.
        ``shape_of(name)`` is checked for every needed tensor BEFORE anything is read or written,
        so a mismatched checkpoint fails with a ValueError naming the tensor and both shapes.
        MoE: only the experts of ``ep_rank`` are read, each split over ``etp`` (default: tp).
        """
        etp = tp if etp is None else etp
        etp_rank = tp_rank if etp_rank is None else etp_rank
        local = [named_tensors(m) for m in chunks]
        mine = [p for p in stage_plan.params if p.ep_rank is None or p.ep_rank == ep_rank]
        for prm in mine:
            if prm.name not in local[prm.chunk]:
                raise ValueError(f"model chunk {prm.chunk} has no parameter {prm.name} (layer spec mismatch?)")
            for n in prm.hf_names:
                got, want = tuple(shape_of(n)), self.hf_shape(n)
                if got != want:
                    raise ValueError(f"{n}: checkpoint shape {got} != model shape {want}")
            shard_shape = tuple(local[prm.chunk][prm.name].shape)
            expect = list(prm.shape)
            if prm.tp_dim is not None:
                expect[prm.tp_dim] //= etp if prm.ep_rank is not None else tp
            if shard_shape != tuple(expect):
                raise ValueError(f"{prm.name}: model shard shape {shard_shape} != expected {tuple(expect)}")
        with torch.no_grad():
            for prm in mine:
                dst = local[prm.chunk][prm.name]
                size, rank = (etp, etp_rank) if prm.ep_rank is not None else (tp, tp_rank)
                parts = [read_slice(*sl) for sl in self.hf_slices(prm, size, rank)]
                dst.copy_(self.from_hf(prm, parts, tuple(dst.shape)).to(dst.dtype))
        return len(mine)


@dataclass
class ExpertExport:
    """What :meth:`ModelAdapter.export_hf` needs to export EP-sharded experts on one rank.

    Built from the rank's ModelParallelGroups (``expert_export(groups)`` in megatron/model.py).
    """

    layout: ParallelLayout
    rank: int
    etp_group: Any
    adapter: "ModelAdapter"

    @property
    def coords(self):
        return self.layout.coords(self.rank)

    @property
    def dense(self) -> bool:
        """This rank takes part in the dense (TP) gathers: the dp=0, cp=0 replica."""
        c = self.coords
        return c.dp == 0 and c.cp == 0

    def gather(self, prm: McoreParam, local: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The canonical tensor of expert param ``prm`` on the stage's sender, None elsewhere.
        Collective over the owner's expert-TP group, then one send owner -> sender."""
        import torch.distributed as dist

        lay, c = self.layout, self.coords
        owner = lay.expert_rank(pp=c.pp, ep=prm.ep_rank)
        sender = lay.rank(pp=c.pp)
        canon = None
        if c.ep == prm.ep_rank and c.edp == 0:
            canon = self.adapter._gather(prm, local[prm.name].detach(), self.etp_group, lay.etp)
        if owner == sender:
            return canon if self.rank == sender else None
        if self.rank == owner:
            dist.send(canon.contiguous(), dst=sender)
            return None
        if self.rank == sender:
            buf = torch.empty(prm.shape, dtype=local[prm.name].dtype, device=local[prm.name].device)
            dist.recv(buf, src=owner)
            return buf
        return None


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters of ``module`` (unwrapped) plus the buffers that hold HF weights: the routers'
    ``expert_bias`` (DeepSeek-V3's e_score_correction_bias, not gradient-trained)."""
    m = unwrap(module)
    out = dict(m.named_parameters())
    out.update({n: b for n, b in m.named_buffers() if n.endswith("router.expert_bias")})
    return out


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (each keeps the wrapped model in ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module
