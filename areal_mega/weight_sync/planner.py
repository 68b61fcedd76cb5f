"""Pure weight-sync planner: learner parameter metadata -> ordered, bucketed HF tensors per stage.

No process group, no tensors: everything here is computed from metadata, so the plan for a
TP8 x PP4 layout of a 70B model can be built and checked on a laptop (tests pass the world size
as an argument). The transport (transport.py) only executes a plan.

Dataflow::

    adapter metadata (per PP stage: ordered HF names, full shapes, dtypes)
        -> plan_weight_sync(stage_tensors, layout, bucket_bytes)
        -> SyncPlan: for each stage, its sender rank (tp=0, cp=0, dp=0 of that stage) and its
           buckets, in order; every HF tensor appears exactly once across the whole plan.
        -> check_plan_against(plan, expected)  (the servers' model, before anything is sent)

Invariants of a :class:`SyncPlan` (checked when it is built):

* every HF name appears exactly once across all stages (tied embeddings are the adapter's job:
  a tied ``lm_head.weight`` is not exported, so it is not sent twice);
* a bucket holds at most ``bucket_bytes`` bytes, except a bucket holding a single tensor (or one
  group of tensors the adapter keeps together) larger than ``bucket_bytes``, which gets a bucket
  of its own;
* inside a bucket each tensor starts at a byte offset that is a multiple of its dtype's item size
  (SGLang's flattened-bucket receiver rejects unaligned tensors);
* order is deterministic: the adapter's order within a stage, stages in pipeline order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from areal_mega.parallel import ParallelLayout

__all__ = [
    "Bucket", "DTYPE_BYTES", "PlanMismatchError", "SenderPlan", "SyncPlan", "TensorSpec", "bucketize",
    "check_plan_against", "dtype_name", "plan_weight_sync"
]

# Item sizes of the dtypes weights travel in (names as SGLang's HTTP API spells them).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not supported by weight sync (known: {sorted(DTYPE_BYTES)})")
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One full (un-sharded) HF tensor: what the servers receive under ``name``."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @classmethod
    def of(cls, item: Any) -> "TensorSpec":
        """Normalise an adapter metadata entry: an object with ``name``/``shape``/``dtype``
        attributes, or a ``(name, shape, dtype)`` tuple."""
        if isinstance(item, TensorSpec):
            return item
        if isinstance(item, (tuple, list)) and len(item) == 3:
            name, shape, dtype = item
        else:
            name, shape, dtype = item.name, item.shape, item.dtype
        return cls(name=str(name), shape=tuple(int(d) for d in shape), dtype=dtype_name(dtype))


@dataclass(frozen=True)
class Bucket:
    """Tensors sent in one collective (one flattened uint8 buffer), in order."""

    stage: int
    index: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


@dataclass(frozen=True)
class SenderPlan:
    """What one sender rank broadcasts: pipeline stage ``stage``'s HF tensors, in buckets. (What a
    stage HOLDS, its megatron params, is ``models.base.StagePlan``.)"""

    stage: int
    sender_rank: int
    """Global learner rank that gathers this stage's TP shards and broadcasts them."""
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def tensors(self) -> list[TensorSpec]:
        return [t for b in self.buckets for t in b.tensors]


@dataclass(frozen=True)
class SyncPlan:
    layout: ParallelLayout
    bucket_bytes: int
    stages: tuple[SenderPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stages)

    @property
    def tensors(self) -> list[TensorSpec]:
        return [t for s in self.stages for t in s.tensors]

    @property
    def num_buckets(self) -> int:
        return sum(len(s.buckets) for s in self.stages)

    def stage_of_rank(self, rank: int) -> SenderPlan | None:
        """The stage this rank sends, or None when the rank is not a sender."""
        for s in self.stages:
            if s.sender_rank == rank:
                return s
        return None

    def summary(self) -> dict[str, Any]:
        return {
            "layout": str(self.layout),
            "num_tensors": len(self.tensors),
            "num_buckets": self.num_buckets,
            "bytes": self.nbytes,
            "bucket_bytes": self.bucket_bytes,
            "stage_bytes": [s.nbytes for s in self.stages],
        }


def bucketize(tensors: Iterable[TensorSpec], bucket_bytes: int,
              group_of: Callable[[str], str | None] | None = None) -> list[list[TensorSpec]]:
    """Greedy in-order packing: start a new bucket when the next tensor would overflow the
    current one or start at a byte offset that is not a multiple of its item size.
    ``group_of(name)``: consecutive tensors of one (non-None) group are one unit -- never split
    across buckets (a server that fuses them on load needs them in one update; a group larger
    than ``bucket_bytes`` gets a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: must be >= 1, got {bucket_bytes}")
    units: list[list[TensorSpec]] = []
    last = None
    for t in tensors:
        g = group_of(t.name) if group_of else None
        if g is not None and g == last:
            units[-1].append(t)
        else:
            units.append([t])
        last = g
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    used = 0
    for unit in units:
        size, pos, aligned = sum(t.nbytes for t in unit), used, True
        for t in unit:
            aligned &= pos % DTYPE_BYTES[t.dtype] == 0
            pos += t.nbytes
        if current and (used + size > bucket_bytes or not aligned):
            buckets.append(current)
            current, used = [], 0
        current.extend(unit)
        used += size
    if current:
        buckets.append(current)
    return buckets


def plan_weight_sync(
    stage_tensors: Sequence[Sequence[Any]], layout: ParallelLayout, bucket_bytes: int,
    group_of: Callable[[str], str | None] | None = None,
) -> SyncPlan:
    """Build the plan. ``stage_tensors[s]`` is the adapter's ordered metadata for PP stage ``s``
    (entries accepted by :meth:`TensorSpec.of`); ``group_of``: the adapter's ``bucket_group``
    (tensors kept in one bucket, see :func:`bucketize`)."""
    if len(stage_tensors) != layout.pp:
        raise ValueError(
            f"weight sync plan: metadata has {len(stage_tensors)} stages but the layout has pp={layout.pp}"
        )
    seen: dict[str, int] = {}
    stages = []
    for s, items in enumerate(stage_tensors):
        specs = [TensorSpec.of(x) for x in items]
        for t in specs:
            if t.name in seen:
                raise ValueError(
                    f"weight sync plan: tensor {t.name!r} is exported by stage {seen[t.name]} and stage {s}"
                )
            if any(d < 0 for d in t.shape):
                raise ValueError(f"weight sync plan: tensor {t.name!r} has a negative dimension {t.shape}")
            seen[t.name] = s
        buckets = tuple(
            Bucket(stage=s, index=i, tensors=tuple(b)) for i, b in enumerate(bucketize(specs, bucket_bytes, group_of))
        )
        stages.append(SenderPlan(stage=s, sender_rank=layout.rank(pp=s), buckets=buckets))
    return SyncPlan(layout=layout, bucket_bytes=bucket_bytes, stages=tuple(stages))


class PlanMismatchError(ValueError):
    """The learner's plan disagrees with a server's model; nothing was sent."""


def check_plan_against(plan: SyncPlan, expected: Mapping[str, TensorSpec], where: str = "server") -> None:
    """Raise :class:`PlanMismatchError` naming the first offending tensor(s) and both shapes.

    ``expected`` maps every HF name the server's model has to its spec. Checks: same set of
    names, same shapes, same dtypes. The message lists the first 10 problems.
    """
    problems: list[str] = []
    sent = {t.name: t for t in plan.tensors}
    for name, t in sent.items():
        e = expected.get(name)
        if e is None:
            problems.append(f"tensor {name!r}: learner sends shape {list(t.shape)} but {where} has no such tensor")
        elif tuple(e.shape) != t.shape:
            problems.append(
                f"tensor {name!r}: learner shape {list(t.shape)} != {where} shape {list(e.shape)}"
            )
        elif e.dtype != t.dtype:
            problems.append(f"tensor {name!r}: learner dtype {t.dtype} != {where} dtype {e.dtype}")
    missing = [n for n in expected if n not in sent]
    for name in missing:
        problems.append(f"tensor {name!r}: {where} expects shape {list(expected[name].shape)} but the learner does not send it")
    if problems:
        shown = problems[:10]
        more = f" (and {len(problems) - len(shown)} more)" if len(problems) > len(shown) else ""
        raise PlanMismatchError(
            f"weight sync refused before sending anything: the learner's weights do not match {where}: "
            + "; ".join(shown)
            + more
        )
