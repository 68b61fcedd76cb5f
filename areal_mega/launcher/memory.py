"""Per-GPU memory estimates for learners (megatron) and engines (SGLang), in bytes.

Everything is a closed formula of the model shape (:class:`ModelShape`, HF names) and the
layout, so a plan can be refused before any node is touched. Notation: L layers, h hidden,
f MLP width, a query heads, g KV heads, d head dim, V vocab, t TP, p PP, v virtual stages,
dp data-parallel, T tokens per micro-batch (s*b), s the longest sequence (taken = T).

Parameters (Llama/Qwen2 decoder, gated MLP, RMSNorm):
    per layer   h*a*d + 2*h*g*d (+ a*d + 2*g*d biases)  [q, k, v]  + a*d*h [o]  + 3*h*f [MLP]
                + 2*h [norms, replicated over TP]
    embedding   V*h (vocab-parallel over TP), output layer V*h unless tied, final norm h.
    Llama-3-70B (L=80, h=8192, f=28672, a=64, g=8, V=128256): 70,553,706,496.

Learner, per GPU of pipeline stage k (layers split evenly; embedding on stage 0, output layer
on stage p-1, which keeps its own copy when embeddings are tied):
    weights + grads + optimizer = P_k * (2 + 4 + 12/dp) bytes
        bf16 weights, fp32 main grads (megatron DDP grad buffer), fp32 master weights and
        Adam m, v sharded over DP by the distributed optimizer -- the "6 + 12/d" of
        megatron-core's distributed-optimizer documentation.
    activations = m_k * (L/p) * T * A_layer, with 1F1B keeping m_k = p - k micro-batches in
        flight on stage k (interleaved: + (p-1)/v, Korthikanti et al. 2022 "Reducing
        Activation Recomputation in Large Transformer Models").
    A_layer, bytes per token, bf16 tensors saved for backward in a pre-norm layer with fused
        (flash) attention and no dropout -- the paper's 34*s*b*h counted for GQA + SwiGLU:
            norm inputs 2h, linear inputs 2h, q/k/v a*d + 2*g*d, attention output a*d,
            fc1 output 2f (gate, up), SwiGLU output f  -> 2*(4h + 2ad + 2gd + 3f)
            + 4a (fp32 softmax statistics)
        all divided by t with sequence parallelism; without it the 4h norm/linear inputs stay
        whole. Unfused attention adds the softmax output 2*a*s/t per token (dropped by
        selective recompute). Full recompute keeps only each layer's input (2h/t per token)
        plus one layer recomputed at a time.
    logits (last stage, one micro-batch) = T * 6 * V/t: bf16 logits + fp32 log-softmax.
    + reserved_gib (CUDA context, NCCL buffers, fragmentation).
    + KL reference (algorithm.kl_coef > 0): a frozen forward-only copy, P_k * 2 (no grads, no
      optimizer, no activations kept).
    + PPO critic (adv_estimator gae): the same trunk with a value head (h -> 1) in place of the
      output layer, trained with its own optimizer: P'_k * (2 + 4 + 12/dp). Its activations are
      not added: actor and critic train one after the other, and the actor's (with logits) are
      the larger.

Engine, per GPU of a TP-t server: weights 2*P/t (norms replicated), KV cache
    max_total_tokens * 2 (K, V) * L * max(1, g/t) * d * kv_bytes;  SGLang must fit
    weights + KV in mem_fraction_static of the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_mega.launcher.config import LearnerLaunchConfig, ModelShape
from areal_mega.parallel import ParallelLayout

GIB = 1024**3


@dataclass(frozen=True)
class ParamCount:
    """Parameters split into what TP shards and what every TP rank replicates."""

    layer_sharded: int
    """One decoder layer's TP-sharded weights (q, k, v, o, MLP)."""
    layer_replicated: int
    """One decoder layer's norms."""
    embedding: int
    """Input embedding V*h (vocab-parallel)."""
    output: int
    """Output layer V*h, 0 when tied to the embedding."""
    final_norm: int

    def total(self, num_layers: int) -> int:
        layers = num_layers * (self.layer_sharded + self.layer_replicated)
        return layers + self.embedding + self.output + self.final_norm


def count_params(m: ModelShape) -> ParamCount:
    h, f, d = m.hidden_size, m.intermediate_size, m.d
    qd, kvd = m.num_attention_heads * d, m.num_key_value_heads * d
    attn = h * qd + 2 * h * kvd + qd * h + ((qd + 2 * kvd) if m.attention_bias else 0)
    mlp = 3 * h * f
    emb = m.vocab_size * h
    return ParamCount(layer_sharded=attn + mlp, layer_replicated=2 * h, embedding=emb,
                      output=0 if m.tie_word_embeddings else emb, final_norm=h)


def total_params(m: ModelShape) -> int:
    return count_params(m).total(m.num_hidden_layers)


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
    logits: float
    reserved: float
    limit: float
    reference: float = 0.0
    """The frozen KL reference model's weights (0 without one)."""
    critic: float = 0.0
    """The PPO critic's weights, grads and optimizer state (0 without one)."""

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
        return (
            f"learner per-GPU memory (worst stage {self.stage}, {self.params / 1e9:.2f}B params/GPU): "
            f"weights {g(self.weights)} + grads {g(self.grads)} + optimizer {g(self.optimizer)} + "
            f"activations {g(self.activations)} + logits {g(self.logits)} + reserved {g(self.reserved)} "
            + (f"+ reference {g(self.reference)} " if self.reference else "")
            + (f"+ critic {g(self.critic)} " if self.critic else "") +
            f"= {g(self.total)} GiB of {g(self.limit)} GiB -> {verdict}"
        )


def activation_bytes_per_token(m: ModelShape, cfg: LearnerLaunchConfig, tp: int) -> float:
    """Bytes one layer keeps per micro-batch token for backward (see module docstring)."""
    h, f, d = m.hidden_size, m.intermediate_size, m.d
    a, g = m.num_attention_heads, m.num_key_value_heads
    inputs = 2 * 4 * h  # two norm inputs + two linear inputs (bf16)
    sharded = 2 * (2 * a * d + 2 * g * d + 3 * f) + 4 * a
    if not cfg.flash_attention and cfg.recompute == "none":
        sharded += 2 * a * cfg.micro_batch_tokens  # softmax output, 2*a*s^2*b bytes per micro-batch
    if cfg.sequence_parallel:
        return (inputs + sharded) / tp
    return inputs + sharded / tp


def estimate_learner(m: ModelShape, cfg: LearnerLaunchConfig, layout: ParallelLayout,
                     gpu_memory_gib: float, *, reference: bool = False, critic: bool = False) -> LearnerMemory:
    """Worst stage's per-GPU bytes; ``reference``/``critic``: the KL reference model and the PPO
    critic share the actor's GPUs (see the module docstring)."""
    layout.check_model(m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads)
    pc = count_params(m)
    t, p, v = layout.tp, layout.pp, layout.vpp or 1
    layers = m.num_hidden_layers // p
    per_token = activation_bytes_per_token(m, cfg, t)
    tokens = cfg.micro_batch_tokens
    worst: LearnerMemory | None = None
    for k in range(p):
        params = layers * (pc.layer_sharded // t + pc.layer_replicated)
        if k == 0:
            params += pc.embedding // t
        critic_params = params
        if k == p - 1:
            params += pc.final_norm
            critic_params = params + m.hidden_size  # value head instead of the output layer
            # Tied embeddings under PP: the last stage holds its own copy of the embedding.
            params += (pc.output or (pc.embedding if p > 1 else 0)) // t
        in_flight = (p - k) + ((p - 1) / v if v > 1 else 0.0)
        if cfg.recompute == "full":
            acts = in_flight * layers * tokens * (2 * m.hidden_size / (t if cfg.sequence_parallel else 1))
            acts += tokens * per_token  # the one layer being recomputed
        else:
            acts = in_flight * layers * tokens * per_token
        logits = tokens * 6 * m.vocab_size / t if k == p - 1 else 0.0
        est = LearnerMemory(
            stage=k, params=params, weights=2.0 * params, grads=4.0 * params,
            optimizer=12.0 * params / layout.dp, activations=acts, logits=logits,
            reserved=cfg.reserved_gib * GIB, limit=gpu_memory_gib * GIB,
            reference=2.0 * params if reference else 0.0,
            critic=(6.0 + 12.0 / layout.dp) * critic_params if critic else 0.0,
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


def estimate_engine(m: ModelShape, *, tp: int, max_total_tokens: int | None, mem_fraction_static: float,
                    kv_dtype_bytes: int, gpu_memory_gib: float) -> EngineMemory:
    if m.num_attention_heads % tp:
        raise ValueError(f"inference.server.tp_size: num_attention_heads({m.num_attention_heads}) % tp({tp}) != 0")
    pc = count_params(m)
    sharded = m.num_hidden_layers * pc.layer_sharded + pc.embedding + pc.output
    replicated = m.num_hidden_layers * pc.layer_replicated + pc.final_norm
    weights = 2.0 * (sharded / tp + replicated)
    # SGLang replicates KV heads when there are fewer of them than TP ranks.
    kv_heads = max(1, m.num_key_value_heads // tp)
    per_token = 2 * m.num_hidden_layers * kv_heads * m.d * kv_dtype_bytes
    limit = gpu_memory_gib * GIB
    budget = mem_fraction_static * limit
    if max_total_tokens is None:
        kv = max(0.0, budget - weights)
        kv -= kv % per_token
    else:
        kv = float(max_total_tokens * per_token)
    return EngineMemory(tp=tp, weights=weights, kv_cache=kv, kv_bytes_per_token=float(per_token),
                        budget=budget, limit=limit, kv_sized_by_sglang=max_total_tokens is None)
