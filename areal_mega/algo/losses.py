"""Policy and value losses: pure functions over flat per-token tensors and a loss mask.

    loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    r_t = pi_theta / pi_prox,   w_t = pi_prox / pi_behav  (no grad)

Invariants: log-ratios are clamped to +-``LOG_RATIO_CLAMP`` before ``exp`` and KL estimates to
+-``KL_CLAMP`` (finite for any non-NaN input); ``aggregate`` normalises by whole-global-batch
counts, so the engine SUMS gradients over micro-batches and DP ranks. The three policies, the
clamps and the aggregation: docs/algorithms.md ("Module notes").
"""

from __future__ import annotations

from typing import Any

import torch

from areal_mega.algo.advantages import segment_ids
from areal_mega.algo.config import AlgorithmConfig

__all__ = [
    "KL_CLAMP", "LOG_RATIO_CLAMP", "PPOActorLoss", "PPOCriticLoss", "aggregate", "global_counts", "kl_estimate",
    "ppo_policy_loss", "value_loss"
]

Stats = dict[str, torch.Tensor]

LOG_RATIO_CLAMP = 20.0
"""Bound on every log-ratio before ``exp`` (e^20 ~ 4.9e8, finite in float32 even multiplied
by an advantage, a capped importance weight and the KL coefficient)."""
KL_CLAMP = 10.0
"""Bound on per-token KL estimates (k1 in [-10, 10], k2 / k3 in [0, 10])."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence"): with d = clamp(logp - logp_ref, -20, 20), k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d; the estimate is then clamped to [-10, 10].

    The clamps (as verl's and OpenRLHF's, which apply them to k3 / to all three) keep the value
    and its gradient finite for any gap, +-inf log-probs included; a token whose estimate hits
    a clamp contributes no KL gradient. k1 hits it at |d| = 10, k2 at |d| = 4.47, k3 at
    d = -2.61 (pi far below pi_ref) or d = 11. Inside, the value is the textbook estimator."""
    if estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"kl_estimator: unknown estimator {estimator!r} (k1, k2, k3)")
    d = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.expm1(-d) + d
    return kl.clamp(-KL_CLAMP, KL_CLAMP)


def global_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[int, int]:
    """(masked tokens, sequences with at least one masked token) of a batch: the normalisers
    ``aggregate`` needs. Compute them on the whole global batch, before micro-batching."""
    mask = loss_mask.bool()
    seg = segment_ids(cu_seqlens, mask.numel())
    per_seq = torch.bincount(seg[mask], minlength=len(cu_seqlens) - 1)
    return int(mask.sum()), int((per_seq > 0).sum())


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "token_mean",
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    norm_const: float = 1.0,
) -> torch.Tensor:
    """Reduce per-token ``values`` [T] under ``loss_mask`` to this micro-batch's share of the
    global objective.

    * token_mean: sum_t v_t / total_tokens
    * seq_mean_token_sum: sum_s (sum_{t in s} v_t) / total_seqs
    * seq_mean_token_mean: sum_s (sum_{t in s} v_t / n_s) / total_seqs
    * seq_mean_token_sum_norm (Dr.GRPO): sum_t v_t / (total_seqs * norm_const)

    ``total_tokens`` / ``total_seqs``: masked tokens / sequences with a masked token in the
    global batch (see ``global_counts``); None = this micro-batch's own counts.
    Sequences are never split across micro-batches, so n_s is local.
    """
    mask = loss_mask.to(values.dtype)
    # where, not values * mask: an inf/NaN at a masked-out position must not leak (inf * 0 = NaN).
    masked = torch.where(loss_mask.bool(), values, torch.zeros_like(values))
    if mode == "token_mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1)
        return masked.sum() / denom
    if cu_seqlens is None:
        raise ValueError(f"aggregate: mode {mode} needs cu_seqlens")
    seg = segment_ids(cu_seqlens, values.numel())
    num_seqs = len(cu_seqlens) - 1
    n_s = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seg, mask)
    if total_seqs is None:
        total_seqs = (n_s > 0).sum().clamp(min=1)
    if mode == "seq_mean_token_sum":
        return masked.sum() / total_seqs
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / (total_seqs * norm_const)
    if mode == "seq_mean_token_mean":
        sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seg, masked)
        return (sums / n_s.clamp(min=1)).sum() / total_seqs
    raise ValueError(f"aggregation: unknown mode {mode!r}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    behav_logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None = None,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    behav_imp_weight_mode: str = "mask",
    cu_seqlens: torch.Tensor | None = None,
    aggregation: str = "token_mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    loss_norm_const: float = 1.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, Stats]:
    """(Decoupled) PPO clipped policy loss. All tensors [T], one alignment.

    Log-ratios are clamped to +-``LOG_RATIO_CLAMP`` before ``exp`` (so ratio and importance
    weight lie in [e^-20, e^20]) and the KL term goes through ``kl_estimate``'s clamps: see
    docs/algorithms.md ("Extreme log-prob gaps"). The KL and entropy terms are NOT multiplied by
    the behaviour importance weight, and tokens dropped by the weight cap ("mask" mode) keep their
    KL and entropy terms; only the clipped policy-gradient term is weighted.

    Returns (loss, stats). ``stats`` are detached scalars over this micro-batch's masked tokens
    (weight them by ``stats["n_tokens"]`` to combine micro-batches): clip_frac (tokens whose
    clipped branch was active), dual_clip_frac, approx_kl = mean(log pi_old - log pi_theta)
    with pi_old = pi_prox (or pi_behav), ratio mean/max, importance weight
    pi_prox/pi_behav mean/max/min and capped_frac, behav_kl = mean(log pi_prox - log pi_behav),
    entropy, ref_kl, pg_loss (token mean, unweighted by the aggregation), ratio/clamped_frac
    (tokens whose policy log-ratio hit the clamp). Stats use the clamped log-ratios.
    """
    mask = loss_mask.bool()
    fmask = mask.float()
    if behav_imp_weight_mode not in ("mask", "truncate"):
        raise ValueError(f"behav_imp_weight_mode: must be 'mask' or 'truncate', got {behav_imp_weight_mode!r}")
    old = (prox_logprobs if prox_logprobs is not None else behav_logprobs).detach()
    adv = advantages.detach()
    raw_log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
    log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    loss1 = -adv * ratio
    loss2 = -adv * clipped
    pg = torch.maximum(loss1, loss2)
    clip_mask = (loss2 > loss1) & mask
    dual_mask = torch.zeros_like(mask)
    if dual_clip is not None:
        # Dual clip (Ye et al. 2020): for A < 0 a huge ratio would make -A r unbounded; cap at -c A.
        cap = -dual_clip * adv
        dual_mask = (adv < 0) & (pg > cap) & mask
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)

    stats: Stats = {}
    weight_mask = fmask
    if prox_logprobs is not None:
        behav_kl = torch.where(mask, prox_logprobs.detach() - behav_logprobs.detach(), torch.zeros_like(prox_logprobs))
        behav_kl = behav_kl.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        w = torch.where(mask, behav_kl.exp(), torch.zeros_like(behav_kl))
        capped = torch.zeros_like(mask)
        if behav_imp_weight_cap is not None:
            capped = (w > behav_imp_weight_cap) & mask
            if behav_imp_weight_mode == "truncate":
                w = w.clamp(max=behav_imp_weight_cap)
            else:
                w = torch.where(capped, torch.zeros_like(w), w)
                weight_mask = fmask * (~capped).float()
        pg = pg * w
        kept = weight_mask.bool()
        stats["importance_weight/mean"] = _masked_mean(w, weight_mask)
        stats["importance_weight/max"] = w[kept].max() if kept.any() else torch.zeros(())
        stats["importance_weight/min"] = w[kept].min() if kept.any() else torch.zeros(())
        stats["importance_weight/capped_frac"] = _masked_mean(capped.float(), fmask)
        stats["behav_kl"] = _masked_mean(behav_kl, fmask)

    per_token = pg
    if ref_logprobs is not None and kl_coef > 0:
        # Masked-out positions compare pi_theta with itself (d = 0): whatever ref holds there
        # (-inf, NaN) cannot reach the loss or the gradient.
        ref = torch.where(mask, ref_logprobs.detach(), logprobs.detach())
        kl = kl_estimate(logprobs, ref, kl_estimator)
        per_token = per_token + kl_coef * kl
        stats["ref_kl"] = _masked_mean(kl.detach(), fmask)
    if entropy is not None:
        if entropy_coef:
            per_token = per_token - entropy_coef * entropy
        stats["entropy"] = _masked_mean(entropy.detach().float(), fmask)
    # Tokens dropped by the importance-weight mask still count in the normaliser: dropping must
    # not up-weight the remaining tokens (AReaL does the same).
    loss = aggregate(
        per_token,
        loss_mask,
        cu_seqlens,
        aggregation,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        norm_const=loss_norm_const,
    )
    with torch.no_grad():
        stats["pg_loss"] = _masked_mean(pg.detach(), fmask)
        stats["clip_frac"] = _masked_mean(clip_mask.float(), fmask)
        stats["dual_clip_frac"] = _masked_mean(dual_mask.float(), fmask)
        stats["approx_kl"] = _masked_mean(-log_ratio.detach(), fmask)
        stats["ratio/mean"] = _masked_mean(ratio.detach(), fmask)
        stats["ratio/max"] = ratio.detach()[mask].max() if mask.any() else torch.zeros(())
        stats["ratio/clamped_frac"] = _masked_mean((raw_log_ratio.detach().abs() > LOG_RATIO_CLAMP).float(), fmask)
        stats["n_tokens"] = fmask.sum()
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    cu_seqlens: torch.Tensor | None = None,
    aggregation: str = "token_mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    loss_norm_const: float = 1.0,
) -> tuple[torch.Tensor, Stats]:
    """PPO critic loss with value clipping: 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    fmask = loss_mask.float()
    ret = returns.detach()
    v_clipped = old_values.detach() + (values - old_values.detach()).clamp(-eps_clip, eps_clip)
    l1 = (values - ret) ** 2
    l2 = (v_clipped - ret) ** 2
    per_token = 0.5 * torch.maximum(l1, l2)
    loss = aggregate(
        per_token,
        loss_mask,
        cu_seqlens,
        aggregation,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        norm_const=loss_norm_const,
    )
    stats = {
        "value_loss": _masked_mean(per_token.detach(), fmask),
        "value_clip_frac": _masked_mean((l2 > l1).float(), fmask),
        "value_mean": _masked_mean(values.detach(), fmask),
        "n_tokens": fmask.sum(),
    }
    return loss, stats


class PPOActorLoss:
    """The actor's ``loss_fn`` for ``TrainEngine.train_batch``, configured once per step.

        loss_fn = PPOActorLoss(cfg.algorithm, total_tokens=n_tok, total_seqs=n_seq)
        loss, stats = loss_fn(logprobs, entropy, micro_batch)

    Micro-batch keys (flat [T], aligned with ``logprobs``): ``loss_mask``, ``advantages``,
    ``logprobs`` (behaviour, from the inference engine), ``prox_logprobs`` (required when
    ``cfg.decoupled``), ``ref_logprobs`` (when ``cfg.kl_coef > 0`` and not ``kl_in_reward``),
    ``cu_seqlens``. ``total_tokens`` / ``total_seqs`` come from ``global_counts`` on the
    global batch.
    """

    def __init__(self, cfg: AlgorithmConfig, *, total_tokens: float | None, total_seqs: float | None) -> None:
        self.cfg = cfg
        self.total_tokens = total_tokens
        self.total_seqs = total_seqs

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: dict[str, Any]
    ) -> tuple[torch.Tensor, Stats]:
        cfg = self.cfg
        for key in ("loss_mask", "advantages", "logprobs"):
            if key not in mb:
                raise ValueError(f"PPOActorLoss: micro-batch has no '{key}' (keys: {sorted(mb)})")
        if cfg.decoupled and "prox_logprobs" not in mb:
            raise ValueError("PPOActorLoss: algorithm.decoupled needs 'prox_logprobs' in the micro-batch")
        use_ref = cfg.kl_coef > 0 and not cfg.kl_in_reward
        if use_ref and "ref_logprobs" not in mb:
            raise ValueError("PPOActorLoss: algorithm.kl_coef > 0 needs 'ref_logprobs' in the micro-batch")
        return ppo_policy_loss(
            logprobs,
            mb["advantages"],
            mb["loss_mask"],
            behav_logprobs=mb["logprobs"],
            prox_logprobs=mb["prox_logprobs"] if cfg.decoupled else None,
            eps_clip_low=cfg.eps_clip_low,
            eps_clip_high=cfg.eps_clip_high,
            dual_clip=cfg.dual_clip,
            behav_imp_weight_cap=cfg.behav_imp_weight_cap,
            behav_imp_weight_mode=cfg.behav_imp_weight_mode,
            cu_seqlens=mb.get("cu_seqlens"),
            aggregation=cfg.aggregation,
            total_tokens=self.total_tokens,
            total_seqs=self.total_seqs,
            loss_norm_const=cfg.loss_norm_const,
            entropy=entropy,
            entropy_coef=cfg.entropy_coef,
            ref_logprobs=mb.get("ref_logprobs") if use_ref else None,
            kl_coef=cfg.kl_coef if use_ref else 0.0,
            kl_estimator=cfg.kl_estimator,
        )


class PPOCriticLoss:
    """The critic's ``loss_fn``: micro-batch keys ``values`` (old, from before the update),
    ``returns``, ``loss_mask``, ``cu_seqlens``; the engine passes the current values."""

    def __init__(self, cfg: AlgorithmConfig, *, total_tokens: float | None, total_seqs: float | None) -> None:
        self.cfg = cfg
        self.total_tokens = total_tokens
        self.total_seqs = total_seqs

    def __call__(self, values: torch.Tensor, _unused: Any, mb: dict[str, Any]) -> tuple[torch.Tensor, Stats]:
        for key in ("values", "returns", "loss_mask"):
            if key not in mb:
                raise ValueError(f"PPOCriticLoss: micro-batch has no '{key}' (keys: {sorted(mb)})")
        return value_loss(
            values,
            mb["values"],
            mb["returns"],
            mb["loss_mask"],
            eps_clip=self.cfg.value_eps_clip,
            cu_seqlens=mb.get("cu_seqlens"),
            aggregation=self.cfg.aggregation,
            total_tokens=self.total_tokens,
            total_seqs=self.total_seqs,
            loss_norm_const=self.cfg.loss_norm_const,
        )
