"""The one parallel-layout object: how a learner's world is split into dp x pp x cp x tp.

Mixture-of-experts layers split the same ranks a second way (megatron's expert grid): inside
each pipeline stage the ``dp * cp * tp`` ranks are re-divided into ``edp x ep x etp`` (expert
data x expert parallel x expert tensor parallel), in megatron's order ``tp-ep-dp-pp`` (etp
fastest). So ``ep * etp`` must divide ``dp * cp * tp``; the expert data-parallel size is what is
left. Dense layers never see ep/etp.

Built from :class:`ParallelConfig` and the world size, validated once; every error message
prints the arithmetic. Rank order follows megatron-core's default ``tp-cp-ep-dp-pp``
(tensor-parallel ranks are adjacent, pipeline stages are the slowest-varying axis), so
``coords(rank)`` here agrees with ``megatron.core.parallel_state`` and the weight-sync planner
can reason about ranks without any process group.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelConfig", "ParallelLayout", "RankCoords"]


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    """Tensor-parallel size (megatron TP). Must divide the attention heads and KV groups."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (number of stages). Must divide the number of layers."""
    context_parallel: int = 1
    """Context-parallel size: every packed sequence split in 2 x cp chunks over cp ranks (rank r
    holds chunks r and 2cp-1-r), each rank holding T / cp tokens of a micro-batch and attending
    over all T (docs/context_parallel.md). For long traces; attention across the ranks by
    ``actor.model.cp_comm_type``. 1 = off."""
    virtual_pipeline_parallel: int | None = None
    """Model chunks per pipeline stage (interleaved schedule); None = not interleaved."""
    data_parallel: int | None = None
    """Data-parallel size; None = whatever the world size leaves after tp*pp*cp."""
    expert_parallel: int = 1
    """Expert-parallel size (megatron EP): each MoE layer's experts are split into this many
    groups of num_experts / ep, one per EP rank; tokens travel to their experts by all-to-all.
    ep * expert_tensor_parallel must divide data_parallel * context_parallel * tensor_parallel
    (the ranks of one pipeline stage). 1 for dense models."""
    expert_tensor_parallel: int | None = None
    """Tensor-parallel size inside each expert (megatron ETP); None = tensor_parallel (megatron's
    default). Must divide the experts' moe_intermediate_size."""

    def validate(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel is not None and self.expert_tensor_parallel < 1:
            raise ValueError(f"expert_tensor_parallel: must be >= 1, got {self.expert_tensor_parallel}")
        if self.data_parallel is not None and self.data_parallel < 1:
            raise ValueError(f"data_parallel: must be >= 1, got {self.data_parallel}")
        vpp = self.virtual_pipeline_parallel
        if vpp is not None and (vpp < 1 or (vpp > 1 and self.pipeline_parallel < 2)):
            raise ValueError(
                f"virtual_pipeline_parallel: {vpp} needs pipeline_parallel >= 2 "
                f"(got {self.pipeline_parallel})"
            )


@dataclass(frozen=True)
class RankCoords:
    dp: int
    pp: int
    cp: int
    tp: int
    ep: int = 0
    """Expert-parallel rank (which group of experts this rank holds in MoE layers)."""
    etp: int = 0
    """Expert tensor-parallel rank."""
    edp: int = 0
    """Expert data-parallel rank (0 = the replica of the experts that exports them)."""


@dataclass(frozen=True)
class ParallelLayout:
    """A validated dp x pp x cp x tp split of ``world_size`` ranks."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int | None = None
    ep: int = 1
    """Expert-parallel size (MoE layers)."""
    etp_size: int | None = None
    """Expert tensor-parallel size; None = tp (see :attr:`etp`)."""

    @property
    def etp(self) -> int:
        return self.tp if self.etp_size is None else self.etp_size

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the stage's ranks left after ep x etp."""
        return (self.tp * self.cp * self.dp) // (self.ep * self.etp)

    @classmethod
    def build(cls, cfg: ParallelConfig, world_size: int) -> "ParallelLayout":
        cfg.validate()
        tp, pp, cp = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel
        model = tp * pp * cp
        if world_size % model != 0:
            raise ValueError(
                f"parallel layout: world_size({world_size}) is not divisible by "
                f"tp({tp}) * pp({pp}) * cp({cp}) = {model}"
            )
        dp = world_size // model
        if cfg.data_parallel is not None and cfg.data_parallel != dp:
            raise ValueError(
                f"parallel layout: tp({tp}) * pp({pp}) * cp({cp}) * dp({cfg.data_parallel}) "
                f"= {model * cfg.data_parallel} != world_size({world_size})"
            )
        vpp = cfg.virtual_pipeline_parallel if (cfg.virtual_pipeline_parallel or 1) > 1 else None
        ep = cfg.expert_parallel
        etp = tp if cfg.expert_tensor_parallel is None else cfg.expert_tensor_parallel
        stage = dp * cp * tp
        if stage % (ep * etp) != 0:
            raise ValueError(
                f"parallel layout: expert_parallel({ep}) * expert_tensor_parallel({etp}) = {ep * etp} "
                f"does not divide the ranks of a pipeline stage, dp({dp}) * cp({cp}) * tp({tp}) = {stage} "
                f"(world_size({world_size}) / pp({pp}))"
            )
        return cls(world_size=world_size, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, ep=ep,
                   etp_size=None if etp == tp else etp)

    @classmethod
    def smallest(cls, cfg: ParallelConfig) -> "ParallelLayout":
        """The layout on the fewest ranks ``cfg`` allows: tp * pp * cp (* dp when it is set)."""
        model = cfg.tensor_parallel * cfg.pipeline_parallel * cfg.context_parallel
        return cls.build(cfg, model * (cfg.data_parallel or 1))

    def check_model(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        """Raise if the model's shape cannot be split this way (arithmetic in the message)."""
        chunks = self.pp * (self.vpp or 1)
        if num_layers % chunks != 0:
            raise ValueError(
                f"parallel layout: num_layers({num_layers}) is not divisible by "
                f"pp({self.pp}) * vpp({self.vpp or 1}) = {chunks}"
            )
        if num_heads % self.tp != 0:
            raise ValueError(f"parallel layout: num_heads({num_heads}) % tp({self.tp}) != 0")
        if num_kv_heads % self.tp != 0:
            raise ValueError(
                f"parallel layout: num_kv_heads({num_kv_heads}) % tp({self.tp}) != 0 "
                "(KV-head replication across TP ranks is not supported)"
            )

    def check_experts(self, num_experts: int, moe_ffn_hidden_size: int) -> None:
        """Raise if the MoE layers cannot be split this way (arithmetic in the message)."""
        if num_experts % self.ep != 0:
            raise ValueError(f"parallel layout: num_experts({num_experts}) % expert_parallel({self.ep}) != 0")
        if moe_ffn_hidden_size % self.etp != 0:
            raise ValueError(
                f"parallel layout: moe_intermediate_size({moe_ffn_hidden_size}) % expert_tensor_parallel({self.etp}) != 0"
            )

    # Rank <-> coordinates, megatron order "tp-cp-ep-dp-pp": tp fastest, pp slowest; the expert
    # grid re-divides each stage's ranks in order "tp-ep-dp" (etp fastest), megatron's
    # expert_decoder_rank_generator (cp=1 there).
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world_size({self.world_size})")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        local = rank % (self.tp * self.cp * self.dp)
        etp = local % self.etp
        ep = (local // self.etp) % self.ep
        edp = local // (self.etp * self.ep)
        return RankCoords(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, etp=etp, edp=edp)

    def expert_rank(self, *, pp: int = 0, edp: int = 0, ep: int = 0, etp: int = 0) -> int:
        """Global rank of expert-grid coordinates (inverse of coords' ep/etp/edp)."""
        return etp + self.etp * (ep + self.ep * edp) + self.tp * self.cp * self.dp * pp

    def exports(self, rank: int) -> bool:
        """Does ``rank`` take part in exporting its stage's weights (weight sync, HF export)?
        The dense replica dp=0, cp=0 (its TP ranks gather) and, with MoE, the expert replica
        edp=0 (each expert's owner gathers it over ETP and sends it to the stage's sender)."""
        c = self.coords(rank)
        return (c.dp == 0 and c.cp == 0) or (self.ep > 1 and c.edp == 0)

    def rank(self, *, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def ranks_of_stage(self, pp: int) -> list[int]:
        return [r for r in range(self.world_size) if self.coords(r).pp == pp]

    def __str__(self) -> str:
        v = f" vpp={self.vpp}" if self.vpp else ""
        e = f" ep={self.ep} etp={self.etp}" if (self.ep > 1 or self.etp != self.tp) else ""
        return f"dp={self.dp} pp={self.pp} cp={self.cp} tp={self.tp}{v}{e} (world_size={self.world_size})"
