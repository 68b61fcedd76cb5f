"""Policy and value losses: pure functions over flat per-token tensors and a loss mask.

    loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    r_t = pi_theta / pi_prox,   w_t = pi_prox / pi_behav  (no grad)

Invariants: log-ratios are clamped to +-``LOG_RATIO_CLAMP`` before ``exp`` and KL estimates to
+-``KL_CLAMP`` (finite for any non-NaN input); ``aggregate`` normalises by whole-global-batch
counts, so the engine SUMS gradients over micro-batches and DP ranks. The three policies, the
clamps and the aggregation: docs/algorithms.md ("Module notes").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from areal_mega.algo.advantages import segment_ids
from areal_mega.algo.config import AlgorithmConfig

__all__ = [
    "KL_CLAMP", "LOG_RATIO_CLAMP", "CISPOLoss", "GSPOLoss", "PPOActorLoss", "PPOCriticLoss", "aggregate",
    "behaviour_weight", "cispo_surrogate", "global_counts", "gspo_surrogate", "interpolation_weights", "kl_estimate",
    "m2_keep", "ppo_policy_loss", "ppo_surrogate", "value_loss"
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


def interpolation_weights(versions: torch.Tensor, version: int) -> torch.Tensor:
    """A-3PO's (arXiv 2512.06547) per-token weight alpha for ``algorithm.proximal: interpolate``:
    the update in progress turns the learner's ``version`` V into V + 1 and pi_prox is version V,
    so a token sampled by version v sits at alpha = (V - v) / (V + 1 - v) of the way from
    pi_behav (version v) to pi_theta (V + 1): 0 for a fresh token (pi_prox = pi_behav), -> 1 as
    it ages. Tokens without a version (prompt, tool output: -1) get 0."""
    v = versions.to(torch.float64)
    alpha = torch.where(v >= 0, (version - v) / (version + 1 - v).clamp(min=1), torch.zeros_like(v))
    return alpha.clamp(0.0, 1.0).to(torch.float32)


def _segment_reduce(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, mean: bool) -> torch.Tensor:
    """Per-token broadcast of each sequence's sum (or mean) of ``x`` over its masked tokens."""
    seg = segment_ids(cu_seqlens, x.numel())
    n = len(cu_seqlens) - 1
    fm = mask.to(x.dtype)
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seg, torch.where(mask, x, torch.zeros_like(x)))
    if mean:
        sums = sums / torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seg, fm).clamp(min=1)
    return sums[seg]


def m2_keep(log_w: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO (arXiv 2510.01161): drop the tokens with the largest squared log importance weight
    until the mean of (log w)^2 over the rest is <= ``threshold``; the kept tokens, [T] bool.
    At least one masked token is always kept."""
    keep = mask.clone()
    m2 = (log_w * log_w)[mask]
    if m2.numel() == 0:
        return keep
    order = torch.argsort(m2, descending=True)
    sorted_m2 = m2[order]
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(m2.numel(), 0, -1, dtype=m2.dtype)
    ok = torch.nonzero(suffix_mean <= threshold)
    drop = int(ok[0]) if len(ok) else m2.numel() - 1
    kept = torch.ones_like(m2, dtype=torch.bool)
    kept[order[:drop]] = False
    keep[mask] = kept
    return keep


def behaviour_weight(
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    level: str = "token",
    cap: float | None = None,
    floor: float | None = None,
    mode: str = "mask",
    m2_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Stats]:
    """The decoupled loss's importance weight w = pi_prox / pi_behav [T] (no gradient), the
    tokens it drops [T] bool, and its statistics.

    * level "token": w_t; "sequence": prod over the sequence's tokens (exp of the summed log
      ratio, verl's seq-level TIS/MIS); "geometric": exp of the mean log ratio (the geometric
      mean, length-independent). Sequence levels give every token of a sequence one weight.
    * ``cap`` C: "truncate" -> min(w, C); "mask" -> w > C dropped. ``floor`` (mask only): w <
      floor dropped too -- with a floor this is IcePop's two-sided mask [floor, C].
    * ``m2_threshold`` tau: M2PO's token mask on log w (``m2_keep``), after the above.
    Dropped tokens get weight 0 and still count in the loss's normaliser.

    Stats (over masked tokens): mean/max/min of the kept weights, capped_frac (dropped or
    truncated), ess = (sum w)^2 / (n sum w^2) of the RAW weights (1: on-policy; -> 1/n as one
    token dominates; the collapse predictor of VCPO, arXiv 2602.17616), p01/p50/p99 quantiles
    of the raw weights, behav_kl = mean log(pi_prox / pi_behav)."""
    if mode not in ("mask", "truncate"):
        raise ValueError(f"behav_imp_weight_mode: must be 'mask' or 'truncate', got {mode!r}")
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"behav_imp_weight_level: must be token, sequence or geometric, got {level!r}")
    mask = loss_mask.bool()
    fmask = mask.float()
    log_w = torch.where(mask, prox_logprobs.detach() - behav_logprobs.detach(), torch.zeros_like(prox_logprobs))
    log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_w = log_w
    if level != "token":
        if cu_seqlens is None:
            raise ValueError(f"behav_imp_weight_level {level} needs cu_seqlens")
        log_w = _segment_reduce(log_w, mask, cu_seqlens, mean=level == "geometric").clamp(-LOG_RATIO_CLAMP,
                                                                                            LOG_RATIO_CLAMP)
    raw = torch.where(mask, log_w.exp(), torch.zeros_like(log_w))
    w = raw
    dropped = torch.zeros_like(mask)
    touched = torch.zeros_like(mask)
    if cap is not None:
        touched = (raw > cap) & mask
        if mode == "truncate":
            w = w.clamp(max=cap)
        else:
            dropped = touched
    if floor is not None:
        low = (raw < floor) & mask
        dropped, touched = dropped | low, touched | low
    if m2_threshold is not None:
        gone = mask & ~m2_keep(token_log_w, mask & ~dropped, m2_threshold) & ~dropped
        dropped, touched = dropped | gone, touched | gone
    w = torch.where(dropped, torch.zeros_like(w), w)
    kept = mask & ~dropped
    stats: Stats = {}
    with torch.no_grad():
        stats["importance_weight/mean"] = _masked_mean(w, kept)
        stats["importance_weight/max"] = w[kept].max() if kept.any() else torch.zeros(())
        stats["importance_weight/min"] = w[kept].min() if kept.any() else torch.zeros(())
        stats["importance_weight/capped_frac"] = _masked_mean(touched.float(), fmask)
        r = raw[mask].double()
        stats["importance_weight/ess"] = _ess(r)
        if r.numel():
            q = torch.quantile(r, torch.tensor([0.01, 0.5, 0.99], dtype=r.dtype)).float()
            stats.update({"importance_weight/p01": q[0], "importance_weight/p50": q[1], "importance_weight/p99": q[2]})
        stats["behav_kl"] = _masked_mean(token_log_w, fmask)
    return w, dropped, stats


def _ess(r: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size (sum r)^2 / (n sum r^2) of weights r [n]: 1 when all are
    equal, -> 1/n as one dominates."""
    if not r.numel():
        return torch.ones(())
    return (r.sum() ** 2 / (r.numel() * (r * r).sum()).clamp(min=1e-300)).float()


def ppo_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, *,
                  eps_clip_low: float = 0.2, eps_clip_high: float = 0.2,
                  dual_clip: float | None = None) -> tuple[torch.Tensor, Stats]:
    """PPO's clipped term per token: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r =
    exp(log_ratio), with dual clip (Ye et al. 2020) capping it at -c A for A < 0."""
    ratio = log_ratio.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    pg = torch.maximum(loss1, loss2)
    stats = {"clip_frac": _masked_mean(((loss2 > loss1) & mask).float(), mask)}
    dual_mask = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual_mask = (adv < 0) & (pg > cap) & mask
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    stats["dual_clip_frac"] = _masked_mean(dual_mask.float(), mask)
    return pg, stats


def gspo_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, *,
                   eps_low: float, eps_high: float) -> tuple[torch.Tensor, Stats]:
    """GSPO (arXiv 2507.18071), its token form: s_i = exp(mean_{t in i} log r_t) per sequence,
    s_{i,t} = sg(s_i) * r_t / sg(r_t) (value s_i, gradient s_i * grad log pi_t), clipped like
    PPO's ratio to [1 - eps_low, 1 + eps_high]: max(-A s, -A clip(s))."""
    if cu_seqlens is None:
        raise ValueError("gspo: needs cu_seqlens")
    seq_log = _segment_reduce(log_ratio.detach(), mask, cu_seqlens, mean=True)
    s = torch.exp(seq_log + log_ratio - log_ratio.detach())
    loss1 = -adv * s
    loss2 = -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(loss1, loss2)
    return pg, {"clip_frac": _masked_mean(((loss2 > loss1) & mask).float(), mask),
                "seq_ratio/mean": _masked_mean(seq_log.exp(), mask)}


def cispo_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, *,
                    eps_high: float, eps_low: float | None = None) -> tuple[torch.Tensor, Stats]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi.
    The IS weight is clipped, never the gradient: every token keeps its log-prob gradient.
    ``eps_low`` None: no lower bound (the paper's setting)."""
    r = log_ratio.detach().exp()
    clipped = r.clamp(min=1.0 - eps_low if eps_low is not None else None, max=1.0 + eps_high)
    # log_ratio = log pi_theta - const: the gradient of the paper's -sg(r^) A log pi_theta; its
    # value (-r^ A log r) is 0 on-policy instead of depending on the log-prob's level.
    pg = -clipped * adv * log_ratio
    return pg, {"clip_frac": _masked_mean(((clipped != r) & mask).float(), mask)}


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
    surrogate: Any = None,
    behav_imp_weight_cap: float | None = None,
    behav_imp_weight_mode: str = "mask",
    behav_imp_weight_level: str = "token",
    behav_imp_weight_floor: float | None = None,
    m2_threshold: float | None = None,
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
    """(Decoupled) policy-gradient loss. All tensors [T], one alignment.

    The per-token term is ``surrogate(log_ratio, A, mask, cu_seqlens)`` (default: PPO's clip
    with ``eps_clip_low`` / ``eps_clip_high`` / ``dual_clip``; GSPO and CISPO pass theirs) on
    log_ratio = log pi_theta - log pi_old, pi_old = pi_prox (decoupled) or pi_behav; decoupled,
    it is multiplied by ``behaviour_weight`` (the cap / floor / level / M2 settings).

    Log-ratios are clamped to +-``LOG_RATIO_CLAMP`` before ``exp`` (so ratio and importance
    weight lie in [e^-20, e^20]) and the KL term goes through ``kl_estimate``'s clamps: see
    docs/algorithms.md ("Extreme log-prob gaps"). The KL and entropy terms are NOT multiplied by
    the behaviour importance weight, and tokens dropped by the weight's masks keep their KL and
    entropy terms; only the policy-gradient term is weighted.

    Returns (loss, stats). ``stats`` are detached scalars over this micro-batch's masked tokens
    (weight them by ``stats["n_tokens"]`` to combine micro-batches): the surrogate's (clip_frac,
    ...), approx_kl = mean(log pi_old - log pi_theta), ratio mean/max and clamped_frac (tokens
    whose log-ratio hit the clamp), ``behaviour_weight``'s, entropy, ref_kl, pg_loss (token mean,
    unweighted by the aggregation). Stats use the clamped log-ratios.
    """
    mask = loss_mask.bool()
    fmask = mask.float()
    old = (prox_logprobs if prox_logprobs is not None else behav_logprobs).detach()
    adv = advantages.detach()
    raw_log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
    log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if surrogate is None:
        pg, stats = ppo_surrogate(log_ratio, adv, mask, cu_seqlens, eps_clip_low=eps_clip_low,
                                  eps_clip_high=eps_clip_high, dual_clip=dual_clip)
    else:
        pg, stats = surrogate(log_ratio, adv, mask, cu_seqlens)
    if prox_logprobs is not None:
        w, _, w_stats = behaviour_weight(prox_logprobs, behav_logprobs, loss_mask, cu_seqlens,
                                         level=behav_imp_weight_level, cap=behav_imp_weight_cap,
                                         floor=behav_imp_weight_floor, mode=behav_imp_weight_mode,
                                         m2_threshold=m2_threshold)
        pg = pg * w
        stats.update(w_stats)

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
        ratio = log_ratio.detach().exp()
        stats["pg_loss"] = _masked_mean(pg.detach(), fmask)
        stats["approx_kl"] = _masked_mean(-log_ratio.detach(), fmask)
        stats["ratio/mean"] = _masked_mean(ratio, fmask)
        stats["ratio/max"] = ratio[mask].max() if mask.any() else torch.zeros(())
        # without decoupling, at the first update this is the ESS of pi_theta / pi_behav: the
        # staleness study's ESS for naive PPO (docs/staleness.md)
        stats["ratio/ess"] = _ess(ratio[mask].double())
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
    ``logprobs`` (behaviour, from the inference engine), ``prox_logprobs`` (decoupled with
    ``algorithm.proximal: forward``) or ``prox_alpha`` (``interpolate``: pi_prox is
    pi_behav^(1 - alpha) pi_theta^alpha, ``interpolation_weights``), ``ref_logprobs`` (when
    ``cfg.kl_coef > 0`` and not ``kl_in_reward``), ``cu_seqlens``. ``total_tokens`` /
    ``total_seqs`` come from ``global_counts`` on the global batch. GSPO and CISPO are this
    class with another ``surrogate``.
    """

    def __init__(self, cfg: AlgorithmConfig, *, total_tokens: float | None, total_seqs: float | None) -> None:
        self.cfg = cfg
        self.total_tokens = total_tokens
        self.total_seqs = total_seqs

    def surrogate(self) -> Any:
        """The per-token policy term (None: PPO's clip from ``algorithm.eps_clip_*``)."""
        return None

    def proximal(self, logprobs: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor | None:
        """log pi_prox for the decoupled loss: recomputed by the engine, or A-3PO's interpolation
        log pi_behav + alpha (log pi_theta - log pi_behav) with pi_theta detached."""
        if not self.cfg.decoupled:
            return None
        if self.cfg.proximal == "interpolate":
            if "prox_alpha" not in mb:
                raise ValueError("PPOActorLoss: algorithm.proximal interpolate needs 'prox_alpha' in the micro-batch")
            behav = mb["logprobs"].detach()
            return behav + mb["prox_alpha"] * (logprobs.detach() - behav)
        if "prox_logprobs" not in mb:
            raise ValueError("PPOActorLoss: algorithm.decoupled needs 'prox_logprobs' in the micro-batch")
        return mb["prox_logprobs"]

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: dict[str, Any]
    ) -> tuple[torch.Tensor, Stats]:
        cfg = self.cfg
        for key in ("loss_mask", "advantages", "logprobs"):
            if key not in mb:
                raise ValueError(f"PPOActorLoss: micro-batch has no '{key}' (keys: {sorted(mb)})")
        use_ref = cfg.kl_coef > 0 and not cfg.kl_in_reward
        if use_ref and "ref_logprobs" not in mb:
            raise ValueError("PPOActorLoss: algorithm.kl_coef > 0 needs 'ref_logprobs' in the micro-batch")
        return ppo_policy_loss(
            logprobs,
            mb["advantages"],
            mb["loss_mask"],
            behav_logprobs=mb["logprobs"],
            prox_logprobs=self.proximal(logprobs, mb),
            eps_clip_low=cfg.eps_clip_low,
            eps_clip_high=cfg.eps_clip_high,
            dual_clip=cfg.dual_clip,
            surrogate=self.surrogate(),
            behav_imp_weight_cap=cfg.behav_imp_weight_cap,
            behav_imp_weight_mode=cfg.behav_imp_weight_mode,
            behav_imp_weight_level=cfg.behav_imp_weight_level,
            behav_imp_weight_floor=cfg.behav_imp_weight_floor,
            m2_threshold=cfg.m2_threshold,
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


class GSPOLoss(PPOActorLoss):
    """``policy_loss: gspo``: the sequence-level ratio of ``gspo_surrogate`` in place of PPO's
    token ratio; everything else (decoupling, weights, KL, entropy, aggregation) as "ppo". The
    paper aggregates "seq_mean_token_mean"."""

    @dataclass
    class Options:
        eps_low: float = 3e-4
        """Lower clip of the sequence ratio (the Qwen3 recipe's 3e-4: a length-normalised ratio
        moves far less than a token's)."""
        eps_high: float = 4e-4
        """Upper clip of the sequence ratio (Qwen3 recipe: 4e-4)."""

        def validate(self) -> None:
            if not (0 < self.eps_low < 1 and self.eps_high > 0):
                raise ValueError(f"eps_low / eps_high: need 0 < eps_low < 1 and eps_high > 0, got "
                                 f"{self.eps_low}, {self.eps_high}")

    def surrogate(self) -> Any:
        o = self.cfg.loss_options
        return functools.partial(gspo_surrogate, eps_low=o.eps_low, eps_high=o.eps_high)


class CISPOLoss(PPOActorLoss):
    """``policy_loss: cispo``: ``cispo_surrogate`` (clipped IS weight times log-prob, no token
    loses its gradient) in place of PPO's clip; everything else as "ppo"."""

    @dataclass
    class Options:
        eps_high: float = 4.0
        """The IS weight is clipped to at most 1 + eps_high (a tuning knob like PPO's clip-high)."""
        eps_low: float | None = None
        """Lower clip 1 - eps_low of the IS weight; None: none (MiniMax-M1's setting)."""

        def validate(self) -> None:
            if self.eps_high <= 0 or (self.eps_low is not None and not 0 < self.eps_low < 1):
                raise ValueError(f"eps_high must be > 0 and eps_low in (0, 1) or null, got {self.eps_high}, "
                                 f"{self.eps_low}")

    def surrogate(self) -> Any:
        o = self.cfg.loss_options
        return functools.partial(cispo_surrogate, eps_high=o.eps_high, eps_low=o.eps_low)


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
