"""Settings of the RL algorithm maths (advantages, losses): ``algorithm.*`` in the experiment YAML.

The rollout side's settings (staleness, controller) are ``areal_mega.rollout.config.RolloutConfig``;
datasets, rewards and workflows own their configs next to their code. The formulas, the numeric
safeguards and how each convention compares with verl / TRL / OpenRLHF / AReaL are in
docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from areal_mega.kinds import fill_default_options, resolve

__all__ = ["AlgorithmConfig"]

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """How advantages are computed from rewards: a built-in below or "package.module:Class" (the
    contract: ``api.algorithm.AdvantageEstimator``; its own settings in ``adv_options``). "grpo": (r - group mean) / (group std + eps);
    "dr_grpo": r - group mean (no std, pair with aggregation "seq_mean_token_sum_norm");
    "rloo": r - mean of the *other* samples of the group; "reinforce_pp": per-token discounted
    returns (optionally with the KL penalty in the reward) normalised over the whole batch;
    "gae": generalised advantage estimation with a critic (PPO).
    Group estimators: a group of ONE sample gets advantage 0 for all three (verl gives it its raw
    reward), and a group whose rewards are all equal (up to float32 round-off: max - min <=
    4 * eps_float32 * max|r|) gets exactly 0; group statistics are computed in float64."""
    adv_options: Any = None
    """The typed options of a user estimator (its ``Options`` dataclass); None for the built-ins,
    whose settings are the fields of this section."""
    policy_loss: str = "ppo"
    """The policy loss: "ppo" (clipped, decoupled or not, with the KL and entropy terms below),
    "gspo" (sequence-level ratio, arXiv 2507.18071), "cispo" (clipped IS weight times log-prob,
    MiniMax-M1) -- both decoupled and weighted like "ppo", their clips in ``loss_options`` -- or
    "package.module:Class" (the contract: ``api.algorithm.PolicyLoss``; options in ``loss_options``)."""
    loss_options: Any = None
    """The typed options of a user policy loss (its ``Options`` dataclass)."""
    std_normalize: bool = True
    """GRPO only: divide by the group's reward std. Off = Dr.GRPO-style. The std is the
    POPULATION std (unbiased=False, divide by n); verl's GRPO and TRL's GRPOTrainer use the
    sample std (torch.std, divide by n - 1), so for a group of n our advantages are larger by
    sqrt(n / (n - 1)) (1.069 for n = 8) before eps."""
    adv_eps: float = 1e-6
    """Added to the std before dividing (group std for GRPO, batch std for REINFORCE++). 0 is
    allowed: numerically constant groups get advantage 0 whatever eps is."""
    gamma: float = 1.0
    """Discount for "reinforce_pp" and "gae" (per generated token; prompt / tool-output tokens
    are not steps). After a sequence's last generated token the value is 0 whether it ended with
    EOS or was truncated at max_new_tokens: truncated sequences are NOT bootstrapped with the
    critic, they are treated as terminated (as verl and OpenRLHF do)."""
    lam: float = 1.0
    """GAE lambda. GAE advantages are used as computed: NOT normalised (whitened) across the
    batch, unlike verl's GAE, which whitens them. REINFORCE++ advantages are whitened."""
    reward_scale: float = 1.0
    """Rewards are mapped to clip(reward_scale * (r + reward_bias), -reward_clip, reward_clip)
    before advantages are computed."""
    reward_bias: float = 0.0
    """See ``reward_scale``."""
    reward_clip: float = 20.0
    """See ``reward_scale``."""

    eps_clip_low: float = 0.2
    """PPO clip: the ratio is clipped to [1 - eps_clip_low, 1 + eps_clip_high]. Before that,
    log(pi_theta / pi_old) is clamped to [-20, 20] (as verl) so a stale token cannot give an
    inf ratio; inside that range the gradient is unchanged."""
    eps_clip_high: float = 0.2
    """Upper clip; > eps_clip_low is DAPO's clip-higher (e.g. 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the loss is capped at -c * A.
    None disables it."""
    decoupled: bool = True
    """Decoupled PPO (AReaL): clip pi_theta / pi_prox where pi_prox is recomputed by the learner
    before the update, and weight each token's term by pi_prox / pi_behav (pi_behav = the
    inference engine's log-probs). False: standard PPO with pi_old = pi_behav.
    Only the clipped policy-gradient term is weighted: the KL (kl_coef) and entropy
    (entropy_coef) terms are NOT multiplied by pi_prox / pi_behav, and tokens dropped by the
    "mask" mode keep their KL and entropy terms. log(pi_prox / pi_behav) is clamped to
    [-20, 20] before exp (a -inf behaviour log-prob gives weight e^20, then capped / masked)."""
    behav_imp_weight_cap: float | None = 5.0
    """Cap C on pi_prox / pi_behav (decoupled only). None = no cap."""
    behav_imp_weight_mode: Literal["truncate", "mask"] = "mask"
    """"truncate": weight = min(w, C) (truncated importance sampling); "mask": tokens whose
    weight exceeds C are dropped from the policy-gradient term (weight 0) but still count in
    the normaliser, as AReaL does."""
    behav_imp_weight_level: Literal["token", "sequence", "geometric"] = "token"
    """What the cap (and floor) of pi_prox / pi_behav act on: "token" per token; "sequence" the
    product over the sequence's tokens (verl's sequence-level TIS / MIS); "geometric" its
    geometric mean (length-independent). Sequence levels weight and drop whole sequences."""
    behav_imp_weight_floor: float | None = None
    """With ``behav_imp_weight_mode: mask``: tokens whose weight is below this are dropped too;
    with the cap this is IcePop's two-sided mask (e.g. floor 0.5, cap 2). None = no floor."""
    m2_threshold: float | None = None
    """M2PO (arXiv 2510.01161; decoupled only): drop the tokens with the largest
    (log pi_prox / pi_behav)^2 until the mean over the rest is <= this (the paper's tau, e.g.
    0.04), on top of the cap / floor. Computed per micro-batch (a batch-wide rule when
    ``engine.micro_batch_max_tokens`` holds the whole batch). None = off."""
    proximal: Literal["forward", "interpolate"] = "forward"
    """How the decoupled loss gets pi_prox: "forward" recomputes it (one extra forward per step);
    "interpolate" (A-3PO, arXiv 2512.06547) skips that forward and uses
    log pi_behav + alpha (log pi_theta - log pi_behav), alpha = (V - v) / (V + 1 - v) for a token
    of version v trained at version V (0 when fresh)."""
    kl_coef: float = 0.0
    """Coefficient of the KL to a reference model; 0 disables the reference model entirely.
    In the loss the term is kl_coef * KL per token, aggregated like the policy term and not
    weighted by the behaviour importance weight."""
    kl_estimator: KLEstimator = "k3"
    """Estimator of KL(pi_theta || pi_ref) per token: k1 = log r, k2 = (log r)^2 / 2,
    k3 = exp(-log r) - 1 + log r (Schulman's unbiased, non-negative one), with
    log r = logp_theta - logp_ref. Clamped as verl's k3 / OpenRLHF: log r to [-20, 20], then the
    estimate to [-10, 10]; a token at the clamp gives no KL gradient (k3 reaches 10 at
    log r = -2.61 or 11, k2 at |log r| = 4.47, k1 at |log r| = 10)."""
    kl_in_reward: bool = False
    """Put the KL penalty into the per-token reward (REINFORCE++ / GAE) instead of the loss."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one number. "token_mean": sum / total masked tokens of the
    global batch; "seq_mean_token_sum": mean over sequences of per-sequence sums;
    "seq_mean_token_mean": mean over sequences of per-sequence means;
    "seq_mean_token_sum_norm": Dr.GRPO, sum / (num sequences * ``loss_norm_const``).
    Counts are of the whole global batch (tokens = masked tokens; sequences = those with one)."""
    loss_norm_const: float = 1024.0
    """Dr.GRPO's constant normaliser L in sum / (num sequences * L), used only by
    "seq_mean_token_sum_norm". A fixed number: it is NOT derived from the sampling's
    max_new_tokens (Dr.GRPO uses the generation budget; verl defaults to the padded response
    length), so set it to your budget -- per-turn max_new_tokens times turns for multi-turn.
    It scales the whole loss uniformly; it never reweights tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the loss subtracts entropy_coef * entropy)."""
    value_eps_clip: float = 0.2
    """PPO critic: values are clipped to old_values +- value_eps_clip."""
    num_minibatches: int = 1
    """Policy optimizer steps per rollout batch and epoch (AReaL's ppo_n_minibatches, verl's
    ppo_mini_batch_size as a count): the batch is split by sequences into this many mini-batches,
    whole groups kept together (``rollout.split_minibatches``), after advantages and proximal
    log-probs were computed once on the whole batch. Each mini-batch's loss is normalised by its
    own token/sequence counts. From the second mini-batch on the policy has moved, so the PPO
    ratio (against pi_prox, or pi_behav without ``decoupled``) leaves 1 and the clip can act.
    The weights are synced and the version bumped once per rollout batch, after all steps; the
    LR schedule counts optimizer steps. The critic still takes one step per batch."""
    ppo_epochs: int = 1
    """Passes over the mini-batches of a rollout batch (steps per batch = ppo_epochs *
    num_minibatches), in the same order each pass."""
    process_weight: float = 0.0
    """Weight of the process term (step rewards, ``Trajectory.step_rewards``); 0 = outcome
    rewards only (advantages exactly as without steps). "grpo" / "dr_grpo":
    A_t = outcome_weight * A_outcome + process_weight * A_process_t, where A_process_t is the
    sum of the normalised rewards of t's step and every later step of its trajectory, step
    rewards normalised over ALL steps of the group ("grpo": (r - mean) / (std + eps),
    population std; "dr_grpo": r - mean); "reinforce_pp" / "gae": the token reward is
    outcome_weight * outcome (on the last action) + process_weight * step reward (on each
    step's last token), then the estimator as usual. "rloo": refused. Needs step rewards:
    ``workflow.steps`` and a reward that scores steps (``reward.step_scoring``)."""
    outcome_weight: float = 1.0
    """Weight of the outcome term (the sequence reward) in the mix above."""

    OPEN_KINDS: ClassVar[dict[str, str]] = {"adv_estimator": "advantage", "policy_loss": "policy_loss"}
    """Fields naming an open kind -> its family in ``areal_mega.kinds`` (options: ``kinds.OPTIONS_OF``)."""

    def __post_init__(self) -> None:
        fill_default_options(self)

    @property
    def estimator(self) -> Any:
        """The advantage estimator's class (``adv_estimator`` resolved)."""
        return resolve("advantage", self.adv_estimator)

    @property
    def loss(self) -> Any:
        """The policy loss's class (``policy_loss`` resolved)."""
        return resolve("policy_loss", self.policy_loss)

    @property
    def needs_critic(self) -> bool:
        """The estimator reads a critic's values: the trainer builds one (PPO)."""
        return bool(getattr(self.estimator, "needs_values", False))

    @property
    def needs_reference(self) -> bool:
        """A frozen reference policy is built (the KL term or KL-in-reward)."""
        return self.kl_coef > 0

    def validate(self) -> None:
        est = self.estimator
        if self.eps_clip_low <= 0 or self.eps_clip_low >= 1:
            raise ValueError(f"eps_clip_low: must be in (0, 1), got {self.eps_clip_low}")
        if self.eps_clip_high <= 0:
            raise ValueError(f"eps_clip_high: must be > 0, got {self.eps_clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip: must be > 1 (or null), got {self.dual_clip}")
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
            raise ValueError(f"behav_imp_weight_cap: must be > 1 (or null), got {self.behav_imp_weight_cap}")
        if self.behav_imp_weight_floor is not None and not (
                0 < self.behav_imp_weight_floor < 1 and self.behav_imp_weight_mode == "mask"):
            raise ValueError(f"behav_imp_weight_floor: must be in (0, 1) with behav_imp_weight_mode mask, got "
                             f"{self.behav_imp_weight_floor} ({self.behav_imp_weight_mode})")
        if self.m2_threshold is not None and self.m2_threshold <= 0:
            raise ValueError(f"m2_threshold: must be > 0 (or null), got {self.m2_threshold}")
        if self.proximal == "interpolate" and not self.decoupled:
            raise ValueError("proximal: 'interpolate' approximates pi_prox, which only algorithm.decoupled uses")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma: must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam: must be in [0, 1], got {self.lam}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        if self.adv_eps < 0:
            raise ValueError(f"adv_eps: must be >= 0, got {self.adv_eps}")
        if self.value_eps_clip <= 0:
            raise ValueError(f"value_eps_clip: must be > 0, got {self.value_eps_clip}")
        if self.loss_norm_const <= 0:
            raise ValueError(f"loss_norm_const: must be > 0, got {self.loss_norm_const}")
        if self.num_minibatches < 1:
            raise ValueError(f"num_minibatches: must be >= 1, got {self.num_minibatches}")
        if self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs: must be >= 1, got {self.ppo_epochs}")
        if self.reward_clip <= 0:
            raise ValueError(f"reward_clip: must be > 0, got {self.reward_clip}")
        if self.process_weight < 0 or self.outcome_weight < 0:
            raise ValueError(f"process_weight / outcome_weight: must be >= 0, got {self.process_weight}, "
                             f"{self.outcome_weight}")
        if self.process_weight == 0 and self.outcome_weight == 0:
            raise ValueError("outcome_weight: with process_weight 0 it must be > 0 (no reward would remain)")
        if self.process_weight > 0 and not getattr(est, "supports_process", False):
            raise ValueError(f"process_weight: process supervision is implemented for grpo, dr_grpo, reinforce_pp "
                             f"and gae, not {self.adv_estimator}")
        if self.kl_in_reward and not getattr(est, "token_rewards", False):
            raise ValueError(
                f"kl_in_reward: only meaningful with an estimator of per-token rewards (reinforce_pp, gae), "
                f"got {self.adv_estimator}"
            )
