"""Advantage estimators over packed batches: GRPO, Dr.GRPO, RLOO, REINFORCE++, GAE, process GRPO.

B sequences back to back in flat per-token tensors [T] delimited by ``cu_seqlens`` [B + 1];
per-sequence scalars are [B]; ``loss_mask`` [T] marks the action positions, the only time steps
of the per-token estimators. Group estimators take ``group_index`` [B].
Invariant: a group whose values are numerically equal (``EQUAL_ULPS``) gets advantage exactly 0.
Layout, numerics and process supervision: docs/algorithms.md ("Module notes").
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from areal_mega.algo.config import AlgorithmConfig

__all__ = [
    "DrGRPO", "EQUAL_ULPS", "GAE", "GRPO", "RLOO", "ReinforcePP", "broadcast_to_tokens", "compute_advantages", "gae_advantages", "group_index_of",
    "grpo_advantages", "last_action_rewards", "reinforce_pp_advantages", "rloo_advantages", "segment_ids",
    "shape_rewards"
]


def segment_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[T] index of the sequence each token belongs to."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    out = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens)
    assert total is None or out.numel() == total, (out.numel(), total)
    return out


def broadcast_to_tokens(per_seq: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] -> [T]: every token gets its sequence's value."""
    cu = cu_seqlens.long()
    return torch.repeat_interleave(per_seq, cu[1:] - cu[:-1])


def group_index_of(group_ids: Sequence[str]) -> torch.Tensor:
    """Strings naming groups -> dense int64 indices in order of first appearance."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.int64)


def shape_rewards(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    """clip(scale * (r + bias), -clip, clip)."""
    return ((rewards + cfg.reward_bias) * cfg.reward_scale).clamp(-cfg.reward_clip, cfg.reward_clip)


# Two members of a group whose rewards are "the same" number computed along different float32
# paths (reward shaping = two float32 operations, each rounding by <= 1/2 ulp) differ by up to
# ~2 ulps. eps_float32 * |r| (eps = ulp(1) = 2**-23) is 1 to 2 ulps of r, so the threshold
# 4 * eps_float32 * max|r| is 4 to 8 ulps: a margin over that. Rewards closer than this are
# indistinguishable from float32 round-off: their "signal" is noise, and dividing it by its
# own std would turn it into advantages of order 1.
EQUAL_ULPS = 4.0


def _group_stats(
    values: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group statistics of float32 ``values`` [N] in float64.

    Returns (centred [N] = v - group mean, std [N] (population, unbiased=False), count [N],
    equal [N] bool: the member's group is numerically constant, see ``EQUAL_ULPS``), each
    indexed per member. A float64 sum of n <= 2**29 copies of one float32 value is exact (24 +
    29 bits), so the mean of a constant group is exactly its value and ``centred`` is exactly 0
    there even without the ``equal`` test; ``equal`` also catches groups that differ only by
    float32 round-off.
    """
    resolution = torch.finfo(values.dtype).eps if values.dtype.is_floating_point else 0.0
    x = values.double()
    gi = group_index.long()
    num_groups = int(gi.max()) + 1 if gi.numel() else 0
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=x.device)
    counts = zeros.index_add(0, gi, torch.ones_like(x))
    mean = zeros.index_add(0, gi, x) / counts.clamp(min=1)
    centred = x - mean[gi]
    var = zeros.index_add(0, gi, centred * centred) / counts.clamp(min=1)
    gmax = zeros.scatter_reduce(0, gi, x, reduce="amax", include_self=False)
    gmin = zeros.scatter_reduce(0, gi, x, reduce="amin", include_self=False)
    scale = torch.maximum(gmax.abs(), gmin.abs())
    equal = (gmax - gmin) <= EQUAL_ULPS * resolution * scale
    return centred, var.sqrt()[gi], counts[gi], equal[gi]


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), std over the group with unbiased=False
    (population std; verl and TRL use the sample std, unbiased=True, which is larger by
    sqrt(n / (n - 1))). ``std_normalize=False`` gives Dr.GRPO's A_i = r_i - mean_g.
    Numerically constant groups (all rewards equal, groups of one included) get exactly 0.
    Statistics in float64, result float32. [B] -> [B]."""
    rewards = rewards.float()
    centred, std, _, equal = _group_stats(rewards, group_index)
    adv = centred / (std + eps) if std_normalize else centred
    return torch.where(equal, torch.zeros_like(adv), adv).float()


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - mean of the other samples of i's group = (n / (n - 1)) (r_i - mean_g).
    A group of one sample has no baseline and gets advantage 0, as does a numerically constant
    group. Statistics in float64, result float32. [B] -> [B]."""
    rewards = rewards.float()
    centred, _, n, equal = _group_stats(rewards, group_index)
    adv = centred * n / (n - 1).clamp(min=1)
    return torch.where(equal | (n <= 1), torch.zeros_like(adv), adv).float()


def last_action_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] sequence rewards -> [T] token rewards placed at each sequence's last masked position
    (a sequence without masked tokens drops its reward: it has no action to credit)."""
    mask = loss_mask.bool()
    seg = segment_ids(cu_seqlens, mask.numel())
    pos = torch.arange(mask.numel(), device=mask.device)
    last = torch.full((len(cu_seqlens) - 1,), -1, dtype=torch.long, device=mask.device)
    last = last.scatter_reduce(0, seg[mask], pos[mask], reduce="amax")
    out = torch.zeros(mask.numel(), dtype=torch.float32, device=mask.device)
    has = last >= 0
    out[last[has]] = rewards.float()[has]
    return out


def _to_action_grid(
    x: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Gather the masked positions of each sequence into a right-padded [B, L] grid so the
    backward recursions run vectorised over sequences (L = most actions in one sequence)."""
    mask = loss_mask.bool()
    idx = mask.nonzero(as_tuple=True)[0]
    seq = segment_ids(cu_seqlens, mask.numel())[idx]
    num_seqs = len(cu_seqlens) - 1
    counts = torch.bincount(seq, minlength=num_seqs)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(idx.numel(), device=idx.device) - starts[seq]
    width = int(counts.max()) if num_seqs and idx.numel() else 0
    grid = torch.zeros(num_seqs, width, dtype=torch.float32, device=x.device)
    valid = torch.zeros(num_seqs, width, dtype=torch.bool, device=x.device)
    grid[seq, rank] = x.float()[idx]
    valid[seq, rank] = True
    return grid, valid, (idx, seq, rank)


def _discounted_backward(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE on a [B, L] grid: delta_t = r_t + gamma V_{t+1} - V_t (V after the last action = 0),
    A_t = delta_t + gamma lam A_{t+1}; padded cells stay 0 and never propagate."""
    num_seqs, width = rewards.shape
    adv = torch.zeros_like(rewards)
    carry = torch.zeros(num_seqs, dtype=rewards.dtype, device=rewards.device)
    for t in range(width - 1, -1, -1):
        next_v = values[:, t + 1] if t + 1 < width else torch.zeros_like(carry)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        carry = torch.where(valid[:, t], delta + gamma * lam * carry, torch.zeros_like(carry))
        adv[:, t] = carry
    return adv


def _scatter_back(grid: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor, torch.Tensor], total: int) -> torch.Tensor:
    idx, seq, rank = where
    out = torch.zeros(total, dtype=grid.dtype, device=grid.device)
    out[idx] = grid[seq, rank]
    return out


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE per sequence over its masked positions. Returns (advantages [T], returns [T]) with
    returns = advantages + values (the critic's target); 0 outside the mask."""
    r, valid, where = _to_action_grid(token_rewards, loss_mask, cu_seqlens)
    v, _, _ = _to_action_grid(values, loss_mask, cu_seqlens)
    adv = _discounted_backward(r, v, valid, gamma, lam)
    total = loss_mask.numel()
    return _scatter_back(adv, where, total), _scatter_back(adv + v, where, total)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: per-token discounted returns G_t = r_t + gamma G_{t+1} within each sequence,
    then normalised over all masked tokens of the batch: A = (G - mean) / (std + eps), std
    unbiased=False. Returns (advantages [T], returns [T]); 0 outside the mask. Pass the whole
    batch (the normalisation is global). The batch statistics are those of a single GRPO
    group (float64; a numerically constant batch of returns gives exactly 0)."""
    r, valid, where = _to_action_grid(token_rewards, loss_mask, cu_seqlens)
    ret = _discounted_backward(r, torch.zeros_like(r), valid, gamma, 1.0)
    returns = _scatter_back(ret, where, loss_mask.numel())
    mask = loss_mask.bool()
    sel = returns[mask]
    adv = torch.zeros_like(returns)
    if sel.numel() == 0:
        return adv, returns
    adv[mask] = grpo_advantages(sel, torch.zeros(sel.numel(), dtype=torch.long, device=sel.device), eps=eps)
    return adv, returns


def process_grpo_advantages(
    step_rewards: torch.Tensor,
    step_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_index: torch.Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Process-supervised GRPO: every step reward r_j of group g is normalised over ALL step
    rewards of g (the steps of all its trajectories, whatever their count): r~_j = (r_j - mean_g)
    / (std_g + eps) (population std; ``std_normalize=False``: r_j - mean_g); then
    A_t = sum of r~_j over t's step and the later steps of its trajectory, on masked positions
    (backward cumulative sum of r~ placed on step ends). Trajectories without steps add nothing
    to the statistics and get 0; numerically constant groups of step rewards get 0 (as GRPO).
    Statistics in float64, normalised rewards rounded to float32, the sum in float32. [T] -> [T]."""
    total = loss_mask.numel()
    ends = step_mask.bool() & loss_mask.bool()
    seg = segment_ids(cu_seqlens, total)
    vals = step_rewards.float()[ends]
    out_tok = torch.zeros(total, dtype=torch.float32, device=loss_mask.device)
    if vals.numel():
        centred, std, _, equal = _group_stats(vals, group_index.long()[seg[ends]])
        norm = centred / (std + eps) if std_normalize else centred
        out_tok[ends] = torch.where(equal, torch.zeros_like(norm), norm).float()
    r, valid, where = _to_action_grid(out_tok, loss_mask, cu_seqlens)
    return _scatter_back(_discounted_backward(r, torch.zeros_like(r), valid, 1.0, 1.0), where, total)


def _step_token_rewards(batch: dict[str, torch.Tensor], cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(shaped step rewards on step ends, 0 elsewhere [T]; step ends [T] bool), on the loss mask."""
    for key in ("step_rewards", "step_mask"):
        if key not in batch:
            raise ValueError(f"compute_advantages: algorithm.process_weight > 0 needs '{key}' [T] in the batch "
                             "(trajectories with step rewards: workflow.steps and a step-scoring reward)")
    ends = batch["step_mask"].bool() & batch["loss_mask"].bool()
    shaped = shape_rewards(batch["step_rewards"].float(), cfg)
    return torch.where(ends, shaped, torch.zeros_like(shaped)), ends


def _require(batch: dict[str, torch.Tensor], keys: Sequence[str], who: str) -> None:
    for key in keys:
        if key not in batch:
            raise ValueError(f"compute_advantages: {who} needs '{key}' in the batch (keys: {sorted(batch)})")


class GroupEstimator:
    """GRPO / Dr.GRPO / RLOO: one advantage per sequence from its group's rewards, on every
    action token; with ``process_weight`` the process term of ``process_grpo_advantages``."""

    needs_values: ClassVar[bool] = False
    token_rewards: ClassVar[bool] = False
    supports_process: ClassVar[bool] = True
    std_normalize: ClassVar[bool] = True
    reads: ClassVar[tuple[str, ...]] = ("rewards", "cu_seqlens", "loss_mask", "group_index")

    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg

    def per_sequence(self, rewards: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:
        return grpo_advantages(rewards, gi, std_normalize=self.normalizes, eps=self.cfg.adv_eps)

    @property
    def normalizes(self) -> bool:
        return self.std_normalize and self.cfg.std_normalize

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        _require(batch, self.reads, f"adv_estimator {cfg.adv_estimator}")
        cu, mask, gi = batch["cu_seqlens"], batch["loss_mask"], batch["group_index"].long()
        adv = broadcast_to_tokens(self.per_sequence(shape_rewards(batch["rewards"].float(), cfg), gi), cu) * mask.float()
        if cfg.outcome_weight != 1.0:
            adv = cfg.outcome_weight * adv
        if cfg.process_weight > 0:
            step_r, ends = _step_token_rewards(batch, cfg)
            adv = adv + cfg.process_weight * process_grpo_advantages(
                step_r, ends, mask, cu, gi, std_normalize=self.normalizes, eps=cfg.adv_eps)
        return {"advantages": adv}


class GRPO(GroupEstimator):
    """(r - group mean) / (group std + eps); ``std_normalize: false`` drops the std."""


class DrGRPO(GroupEstimator):
    """r - group mean (no std; pair with aggregation "seq_mean_token_sum_norm")."""

    std_normalize = False


class RLOO(GroupEstimator):
    """r - mean of the other samples of the group."""

    supports_process = False

    def per_sequence(self, rewards: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:
        return rloo_advantages(rewards, gi)


class TokenEstimator:
    """REINFORCE++ / GAE: per-token rewards (outcome on the last action, step rewards on step
    ends, minus the KL when ``kl_in_reward``) -> advantages and returns."""

    needs_values: ClassVar[bool] = False
    token_rewards: ClassVar[bool] = True
    supports_process: ClassVar[bool] = True
    reads: ClassVar[tuple[str, ...]] = ("rewards", "cu_seqlens", "loss_mask")

    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg

    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        _require(batch, self.reads, f"adv_estimator {cfg.adv_estimator}")
        mask = batch["loss_mask"]
        token_rewards = last_action_rewards(shape_rewards(batch["rewards"].float(), cfg), mask, batch["cu_seqlens"])
        if cfg.outcome_weight != 1.0:
            token_rewards = cfg.outcome_weight * token_rewards
        if cfg.process_weight > 0:
            step_r, _ = _step_token_rewards(batch, cfg)
            token_rewards = token_rewards + cfg.process_weight * step_r
        if cfg.kl_in_reward and cfg.kl_coef > 0:
            _require(batch, ("kl",), "kl_in_reward")
            token_rewards = token_rewards - cfg.kl_coef * batch["kl"].float() * mask.float()
        return token_rewards


class ReinforcePP(TokenEstimator):
    """Discounted returns normalised over the whole batch."""

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        adv, ret = reinforce_pp_advantages(self.rewards(batch), batch["loss_mask"], batch["cu_seqlens"],
                                           gamma=self.cfg.gamma, eps=self.cfg.adv_eps)
        return {"advantages": adv, "returns": ret}


class GAE(TokenEstimator):
    """Generalised advantage estimation on the critic's ``values`` (PPO)."""

    needs_values = True
    reads = ("rewards", "cu_seqlens", "loss_mask", "values")

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        adv, ret = gae_advantages(self.rewards(batch), batch["values"], batch["loss_mask"], batch["cu_seqlens"],
                                  gamma=self.cfg.gamma, lam=self.cfg.lam)
        return {"advantages": adv, "returns": ret}


def compute_advantages(batch: dict[str, torch.Tensor], cfg: AlgorithmConfig) -> dict[str, torch.Tensor]:
    """The estimator ``cfg.adv_estimator`` names (a built-in above or a user class, kinds.resolve)
    over a whole packed batch: {"advantages": [T]} plus "returns" [T] for the token estimators;
    all 0 outside the mask. With process_weight 0 and outcome_weight 1 the result is exactly that
    of the outcome-only estimators. The batch keys: ``api.algorithm.BATCH_KEYS``."""
    return cfg.estimator(cfg)(batch)
