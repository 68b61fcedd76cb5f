"""The one parallel-layout object: how a learner's world is split into dp x pp x cp x tp.

Built from :class:`ParallelConfig` and the world size, validated once; every error message
prints the arithmetic. Rank order follows megatron-core's default ``tp-cp-ep-dp-pp``
(tensor-parallel ranks are adjacent, pipeline stages are the slowest-varying axis), so
``coords(rank)`` here agrees with ``megatron.core.parallel_state`` and the weight-sync planner
can reason about ranks without any process group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    """Tensor-parallel size (megatron TP). Must divide the attention heads and KV groups."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (number of stages). Must divide the number of layers."""
    context_parallel: int = 1
    """Context-parallel size (sequence split across ranks); 1 on CPU."""
    virtual_pipeline_parallel: int | None = None
    """Model chunks per pipeline stage (interleaved schedule); None = not interleaved."""
    data_parallel: int | None = None
    """Data-parallel size; None = whatever the world size leaves after tp*pp*cp."""

    def validate(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
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


@dataclass(frozen=True)
class ParallelLayout:
    """A validated dp x pp x cp x tp split of ``world_size`` ranks."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int | None = None

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
        return cls(world_size=world_size, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp)

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

    # Rank <-> coordinates, megatron order "tp-cp-ep-dp-pp": tp fastest, pp slowest.
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world_size({self.world_size})")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return RankCoords(dp=dp, pp=pp, cp=cp, tp=tp)

    def rank(self, *, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def ranks_of_stage(self, pp: int) -> list[int]:
        return [r for r in range(self.world_size) if self.coords(r).pp == pp]

    def __str__(self) -> str:
        v = f" vpp={self.vpp}" if self.vpp else ""
        return f"dp={self.dp} pp={self.pp} cp={self.cp} tp={self.tp}{v} (world_size={self.world_size})"
