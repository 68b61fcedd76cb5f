"""GPU cost models from published figures: what the planner turns into the simulator's inputs.

Every number is a field of :class:`ClusterCostModel` or :class:`WorkloadModel` (a typed
dataclass, one docstring per field); docs/simulator.md gives each default's source and
reasoning. Overrides: ``areal-mega plan ... cost.train_mfu=0.3 workload.gen_mean_tokens=8000``.

Formulas (P parameters, L layers, h width, t engine TP, c mean decode context in tokens):

* decode, one server of t GPUs, one iteration with n sequences::

      t_iter(n) = 2P / (t * BW * e_bw)                      weights read once per iteration
                + n * ( c * kv_bytes_per_token_per_gpu / (BW * e_bw)    each sequence's KV read
                        + 2P / (t * F * e_dec) )                         each sequence's FLOPs

  so ``peak_tokens_per_s = 1 / t1`` and ``half_batch = t0 / t1`` (DecodeModel's saturating
  form). BW = HBM bandwidth, F = dense BF16 peak, e_* = achieved fractions.
* learner, per batch token (world W GPUs, pipeline p, m micro-batches per DP rank)::

      flops = 6P + 3 * A        train step (forward + backward), A = 4 * L * h * c_ctx attention
                                (LoRA, actor.lora.rank > 0: 4P + 3 * A, no base-weight gradients)
            + 2P + A            proximal forward (algorithm.decoupled)
            + 2P + A            reference forward (algorithm.needs_reference)
            + A                 selective recompute of core attention
      seconds = flops / (W * F * MFU) * (1 + (p - 1) / (v * m))      1F1B pipeline bubble

* weight sync (``weight_sync.mode``): ``latency + bytes / (NIC * e_sync)`` with ``bytes`` the
  most bf16 bytes through one GPU's link. broadcast (and disk, priced the same: no filesystem
  model): ``2P``, each pipeline stage's sender broadcasts its stage's full tensors, the stages
  taking turns (areal_mega/weight_sync/sync.py). reshard: ``max(2P / t, S * 2P / W)``, each engine GPU
  receives its TP shard, the W learner GPUs split the S servers' copies evenly
  (areal_mega/weight_sync/reshard.py; within 4% of its plan at 70B, Qwen3-235B, DeepSeek-V3:
  tests/test_weight_sync_reshard.py). LoRA (``weight_sync.lora``): merged weights are priced as
  the mode's full model; adapter-only (mode ``lora_adapter``, P = the adapter parameters) as
  ``2P * t * S * 4/3``: rank 0 posts every server one base64 body holding one copy of the
  adapters per engine TP rank (SGLang's /load_lora_adapter_from_tensors; weight_sync/lora_sync.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_mega.simulator.model import DecodeModel, LearnerModel, LengthModel, SimulationError, SyncModel
from areal_mega.simulator.calibrate import fit_lengths, load_rows
from areal_mega.simulator.sweep import DecodeFit

__all__ = [
    "ClusterCostModel", "WorkloadModel", "decode_model", "learner_flops_per_token", "learner_model", "sync_bytes",
    "sync_model"
]


@dataclass
class ClusterCostModel:
    """Hardware and software efficiency figures of the cluster (defaults: H100 SXM 80 GB, NDR IB)."""

    gpu: str = "H100-SXM-80GB"
    """Name only (reports)."""
    peak_bf16_tflops: float = 989.0
    """Dense BF16 tensor-core peak of one GPU, TFLOP/s (NVIDIA H100 SXM datasheet)."""
    hbm_bandwidth_gbps: float = 3350.0
    """HBM bandwidth of one GPU, GB/s (NVIDIA H100 SXM datasheet: 3.35 TB/s)."""
    decode_bandwidth_efficiency: float = 0.6
    """Fraction of HBM bandwidth a decode iteration achieves (weights + KV reads)."""
    decode_compute_efficiency: float = 0.5
    """Fraction of peak FLOP/s achieved by the batched decode GEMMs."""
    train_mfu: float = 0.38
    """Model FLOPs utilisation of the megatron learner (Llama 3 paper: 38-43% BF16 MFU on H100)."""
    nic_gbit_per_gpu: float = 400.0
    """Inter-node bandwidth per GPU, Gbit/s (one 400G NDR InfiniBand NIC per GPU, DGX H100)."""
    weight_sync_efficiency: float = 0.5
    """Fraction of the NIC line rate a weight sync's transfers achieve (NCCL: bucketed broadcasts,
    or reshard's point-to-point messages)."""
    weight_sync_latency_s: float = 3.0
    """Fixed cost of one weight sync: pause/retract, cache flush, per-bucket handshakes, resume."""
    learner_fixed_s: float = 2.0
    """Per-step learner constant: optimizer step, batch broadcast and packing, logging."""
    request_latency_s: float = 0.2
    """Per-request time before decoding: HTTP, tokenisation, prefill of a short prompt."""
    decode_from: str = ""
    """A decode sweep of one of the job's own servers (``python -m areal_mega.simulator.sweep --url
    URL --out F.json``: its model, TP and GPU): the decode model measured, in place of the four
    figures it replaces (HBM bandwidth, both decode efficiencies, request latency; ``cost_sources``
    marks them measured and the sensitivity analysis leaves them alone). Empty = those figures."""

    def validate(self) -> None:
        for name in ("peak_bf16_tflops", "hbm_bandwidth_gbps", "nic_gbit_per_gpu"):
            if not getattr(self, name) > 0:
                raise SimulationError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("decode_bandwidth_efficiency", "decode_compute_efficiency", "train_mfu", "weight_sync_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise SimulationError(f"{name}: must be in (0, 1], got {getattr(self, name)}")
        for name in ("weight_sync_latency_s", "learner_fixed_s", "request_latency_s"):
            if getattr(self, name) < 0:
                raise SimulationError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass
class WorkloadModel:
    """What the run generates (an assumption about the task, not a hardware figure)."""

    gen_mean_tokens: float = 0.0
    """Mean generated tokens per trajectory before the cap; 0 = 40% of max_new_tokens (long
    reasoning traces: a large share of them hit the cap)."""
    gen_sigma: float = 0.8
    """Lognormal shape of the lengths (heavy tail)."""
    prompt_tokens: int = 256
    """Prompt tokens per trajectory (a math problem with its chat template)."""
    reject_prob: float = 0.0
    """Share of episodes filtered out (filter_zero_variance) and regenerated."""
    sim_steps: int = 8
    """Timed simulated steps per configuration."""
    lengths_from: str = ""
    """A trainer's metrics.jsonl: draw lengths (and the prompt length) from what that run logged
    instead of the lognormal above (per-step means: the per-trajectory tail is not logged)."""

    def validate(self) -> None:
        if self.gen_mean_tokens < 0 or self.gen_sigma < 0 or self.prompt_tokens < 0:
            raise SimulationError("gen_mean_tokens, gen_sigma, prompt_tokens: must be >= 0")
        if not 0 <= self.reject_prob < 0.99:
            raise SimulationError(f"reject_prob: must be in [0, 0.99), got {self.reject_prob}")
        if self.sim_steps < 2:
            raise SimulationError(f"sim_steps: must be >= 2, got {self.sim_steps}")

    def lengths(self, max_new_tokens: int) -> LengthModel:
        if self.lengths_from:

            return fit_lengths(load_rows(self.lengths_from), max_new_tokens)
        mean = self.gen_mean_tokens or 0.4 * max_new_tokens
        return LengthModel(kind="lognormal", mean_tokens=max(1.0, mean), sigma=self.gen_sigma,
                           max_tokens=max_new_tokens, prompt_tokens=self.prompt_tokens)


# Where each figure comes from (docs/simulator.md has the reasoning): "datasheet" and "published"
# are facts about the hardware or others' measurements; "assumed" ones are guesses nobody here has
# measured -- the sensitivity table (planner.sensitivity) perturbs exactly those.
COST_SOURCES: dict[str, tuple[str, str]] = {
    "peak_bf16_tflops": ("datasheet", "NVIDIA H100 SXM: 989 TFLOP/s dense BF16"),
    "hbm_bandwidth_gbps": ("datasheet", "NVIDIA H100 SXM: 3.35 TB/s"),
    "nic_gbit_per_gpu": ("datasheet", "DGX H100: one 400G NDR NIC per GPU"),
    "train_mfu": ("published", "Llama 3 paper: 38-43% BF16 MFU on H100 (not measured on this trainer)"),
    "decode_bandwidth_efficiency": ("assumed", "decode kernels at 50-80% of HBM peak: the low end"),
    "decode_compute_efficiency": ("assumed", "batched decode GEMMs far from peak"),
    "weight_sync_efficiency": ("assumed", "NCCL broadcast / reshard transfers; measure with tools/bench_weight_sync.py"),
    "weight_sync_latency_s": ("assumed", "pause/retract, flush, per-bucket handshakes, resume"),
    "learner_fixed_s": ("assumed", "optimizer step, batch broadcast, packing, logging"),
    "request_latency_s": ("assumed", "HTTP, tokenisation, prefill of a short prompt"),
}
WORKLOAD_SOURCES: dict[str, tuple[str, str]] = {
    "gen_mean_tokens": ("assumed", "40% of max_new_tokens unless set from a pilot run (workload.lengths_from)"),
    "reject_prob": ("assumed", "0 unless set from a pilot run's rollout/rejected_episodes"),
}


DECODE_FIGURES = ("hbm_bandwidth_gbps", "decode_bandwidth_efficiency", "decode_compute_efficiency", "request_latency_s")
"""The cost figures a measured decode sweep (``cost.decode_from``) replaces."""


def cost_sources(cost: ClusterCostModel, workload: WorkloadModel) -> dict[str, dict]:
    """Every planner input with its value and whether it was measured or assumed; a workload
    whose lengths come from a run's metrics (``lengths_from``) is measured, and so are the decode
    figures a decode sweep (``decode_from``) replaces."""
    out = {f"cost.{k}": {"value": getattr(cost, k), "source": src, "note": note} for k, (src, note) in COST_SOURCES.items()}
    if cost.decode_from:
        for k in DECODE_FIGURES:
            out[f"cost.{k}"] = {"value": cost.decode_from, "source": "measured",
                                "note": "not used: the decode model is the sweep's fit"}
    for k, (src, note) in WORKLOAD_SOURCES.items():
        measured = bool(workload.lengths_from) and k == "gen_mean_tokens"
        out[f"workload.{k}"] = {"value": workload.lengths_from if measured else getattr(workload, k),
                                "source": "measured" if measured else src,
                                "note": "lengths of a real run's metrics.jsonl" if measured else note}
    return out


def decode_model(cost: ClusterCostModel, *, params: int, engine_tp: int, kv_bytes_per_token_per_gpu: float,
                 mean_context: float, kv_capacity_tokens: int, prompt_tokens: int,
                 active_params: int | None = None) -> DecodeModel:
    """``params``: weights read per decode step (all of them; a large MoE batch touches every
    expert); ``active_params``: the weights one token computes with (MoE: k of E experts;
    default = params). With ``cost.decode_from``: that sweep's fit at ``prompt_tokens``
    (the KV capacity still the engine estimate's)."""
    if cost.decode_from:
        return DecodeFit.load(cost.decode_from).decode_model(prompt_tokens=prompt_tokens,
                                                             kv_capacity_tokens=kv_capacity_tokens)
    bw = cost.hbm_bandwidth_gbps * 1e9 * cost.decode_bandwidth_efficiency
    flops = cost.peak_bf16_tflops * 1e12 * cost.decode_compute_efficiency
    active = params if active_params is None else active_params
    t0 = 2.0 * params / (engine_tp * bw)
    t1 = mean_context * kv_bytes_per_token_per_gpu / bw + 2.0 * active / (engine_tp * flops)
    return DecodeModel(peak_tokens_per_s=1.0 / t1, half_batch=t0 / t1, kv_capacity_tokens=kv_capacity_tokens,
                       request_latency_s=cost.request_latency_s)


def learner_flops_per_token(*, params: int, layers: int, hidden: int, mean_context: float, decoupled: bool,
                            reference: bool, critic: bool, recompute: str, frozen_base: bool = False) -> float:
    attn = 4.0 * layers * hidden * mean_context
    # frozen_base (LoRA): the backward computes the activations' gradients only, none for the base
    # weights (2P fewer; the adapters' own FLOPs are ~r/h of the base's, left out)
    flops = (4.0 if frozen_base else 6.0) * params + 3.0 * attn
    if decoupled:
        flops += 2.0 * params + attn
    if reference:
        flops += 2.0 * params + attn
    if critic:  # values forward + its own train step, about the actor's size
        flops += 8.0 * params + 4.0 * attn
    if recompute == "selective":
        flops += attn
    elif recompute == "full":
        flops += 2.0 * params + attn
    return flops


def learner_model(cost: ClusterCostModel, *, flops_per_token: float, world: int, pp: int, vpp: int | None, dp: int,
                  tokens_per_step: float, micro_batch_tokens: int) -> LearnerModel:
    m = max(1, math.ceil(tokens_per_step / (dp * micro_batch_tokens)))
    bubble = 1.0 + (pp - 1) / ((vpp or 1) * m)
    per_token = flops_per_token / (world * cost.peak_bf16_tflops * 1e12 * cost.train_mfu) * bubble
    return LearnerModel(fixed_s=cost.learner_fixed_s, per_token_s=per_token)


def sync_bytes(*, mode: str, params: int, engine_tp: int, num_servers: int, world: int,
               dtype_bytes: float = 2) -> float:
    """The bytes on one sync's critical path for ``weight_sync.mode`` (module docstring): the busiest
    link's for reshard; for broadcast every stage's, one stage after another (so PP does not shorten it)."""
    full = dtype_bytes * params
    if mode == "lora_adapter":
        return full * engine_tp * num_servers * 4 / 3
    if mode == "reshard":
        return max(full / engine_tp, num_servers * full / world)
    return full


def sync_model(cost: ClusterCostModel, *, mode: str, params: int, engine_tp: int, num_servers: int,
               world: int, dtype_bytes: float = 2) -> SyncModel:
    return SyncModel(weight_bytes=sync_bytes(mode=mode, params=params, engine_tp=engine_tp,
                                             num_servers=num_servers, world=world, dtype_bytes=dtype_bytes),
                     bandwidth_bytes_per_s=cost.nic_gbit_per_gpu / 8 * 1e9 * cost.weight_sync_efficiency,
                     latency_s=cost.weight_sync_latency_s)
