"""Pure resharding plan: the learner's megatron shards -> every SGLang rank's own shards.

No process group, no tensors (beside planner.py, same style): from the learner's layout
(TP/PP/VPP/EP/ETP, DP replicas) and each server's layout (TP, EP), computed from metadata only,
so a 70B or 671B plan is built and checked on a laptop. The transport (sync.py) and the
SGLang-side receiver execute it.

Dataflow::

    adapter.plan(learner layout)        -> megatron params per stage (McoreParam)
    adapter.shard_blocks(param, tp, r)  -> HF boxes each learner rank holds, and where
    sglang_layout.engine_params(...)    -> HF boxes each engine rank holds, in SGLang's names
        -> intersect per HF tensor: Pieces (src rank, src param, src box) -> (dst param, dst box)
        -> group per (learner rank, engine rank), cut into Messages of <= bucket_bytes
           (a destination's pieces together, in its memory order: they can travel without a copy)
        -> schedule Messages into rounds (a matching: a rank sends / receives <= 1 per round)

Invariants of a :class:`ReshardPlan` (``check()``, also run by the tests at 70B / 235B / 671B):

* every element of every engine parameter that carries weights is written exactly once, by
  exactly one piece (padding rows are never sent), so the bytes each engine rank receives are
  exactly its shard bytes, and no byte crosses the network twice;
* a piece lies inside its source shard and its destination parameter;
* who sends: among the learner ranks that hold a box (DP / CP replicas, TP ranks for replicated
  tensors, expert-DP replicas), the one with the fewest bytes assigned so far: the replicas
  split the work;
* order is deadlock-free: each rank runs its messages in (round, learner rank) order, with
  blocking send / recv. Proof: the earliest unfinished message's two ranks have finished all
  their earlier messages (those are earlier in the same total order), so both are at it and it
  completes. The rounds also make it fast: inside a round no two messages share a rank, so every
  pair transfers at once (NCCL's one stream per rank serialises a rank's ops anyway).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from areal_mega.models.base import Block, ModelAdapter
from areal_mega.parallel import ParallelLayout
from areal_mega.weight_sync.planner import DTYPE_BYTES, dtype_name
from areal_mega.weight_sync.sglang_layout import EngineLayout, EngineParam, engine_params

__all__ = ["Message", "Piece", "ReshardPlan", "plan_reshard"]

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Piece:
    """One box of one HF tensor: from a learner rank's local megatron shard into an engine
    rank's local SGLang parameter (both boxes in local coordinates, the same extents)."""

    hf_name: str
    src_chunk: int
    src_param: str
    """megatron name inside model chunk ``src_chunk`` (``named_tensors`` of that chunk)."""
    src_box: Box
    dst_param: str
    dst_index: tuple[int, ...]
    """Leading indices into the destination (a FusedMoE expert), then ``dst_box``."""
    dst_box: Box
    dtype: str
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", _vol(self.src_box) * DTYPE_BYTES[self.dtype])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.src_box)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Message:
    """Pieces one learner rank sends to one engine rank in one transfer: one flat uint8 buffer,
    each piece at an offset that is a multiple of its item size (:meth:`offsets`)."""

    round: int
    src: int
    """Global learner rank."""
    server: int
    engine_rank: int
    """TP rank inside server ``server``."""
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...] = field(init=False, compare=False, repr=False)
    """Byte offset of each piece in the buffer."""
    nbytes: int = field(init=False, compare=False)
    """Wire bytes (alignment padding included)."""
    payload_bytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        out, off = [], 0
        for p in self.pieces:
            item = DTYPE_BYTES[p.dtype]
            off = -(-off // item) * item
            out.append(off)
            off += p.nbytes
        object.__setattr__(self, "offsets", tuple(out))
        object.__setattr__(self, "nbytes", off)
        object.__setattr__(self, "payload_bytes", sum(p.nbytes for p in self.pieces))


@dataclass(frozen=True)
class ReshardPlan:
    learner: ParallelLayout
    engines: tuple[EngineLayout, ...]
    dtype: str
    bucket_bytes: int
    messages: tuple[Message, ...]
    """In execution order: (round, src)."""
    shard_bytes: dict[tuple[int, int], int] = field(repr=False)
    """(server, engine rank) -> bytes of the weights it holds (from SGLang's layout alone)."""
    engine_params: dict[tuple[int, int], tuple[EngineParam, ...]] = field(repr=False)

    @property
    def num_rounds(self) -> int:
        return 1 + max((m.round for m in self.messages), default=-1)

    @property
    def nbytes(self) -> int:
        return sum(m.payload_bytes for m in self.messages)

    def bytes_per_engine_rank(self) -> dict[tuple[int, int], int]:
        out = {k: 0 for k in self.shard_bytes}
        for m in self.messages:
            out[(m.server, m.engine_rank)] += m.payload_bytes
        return out

    def bytes_per_learner_rank(self) -> dict[int, int]:
        out = {r: 0 for r in range(self.learner.world_size)}
        for m in self.messages:
            out[m.src] += m.payload_bytes
        return out

    def sent_by(self, rank: int) -> list[Message]:
        return [m for m in self.messages if m.src == rank]

    def received_by(self, server: int, engine_rank: int) -> list[Message]:
        return [m for m in self.messages if (m.server, m.engine_rank) == (server, engine_rank)]

    def summary(self) -> dict[str, Any]:
        per_engine = self.bytes_per_engine_rank()
        per_learner = self.bytes_per_learner_rank()
        return {
            "learner": str(self.learner),
            "engines": [f"tp={e.tp} ep={e.ep}" for e in self.engines],
            "bytes": self.nbytes,
            "messages": len(self.messages),
            "rounds": self.num_rounds,
            "max_bytes_per_engine_rank": max(per_engine.values(), default=0),
            "max_bytes_per_learner_rank": max(per_learner.values(), default=0),
            "min_bytes_per_learner_rank": min(per_learner.values(), default=0),
        }

    def check(self) -> None:
        """Raise AssertionError unless every weight element of every engine rank is written
        exactly once, inside bounds, and each engine rank receives exactly its shard bytes."""
        by_dst: dict[tuple[int, int, str, tuple[int, ...]], list[Box]] = defaultdict(list)
        for m in self.messages:
            for p in m.pieces:
                by_dst[(m.server, m.engine_rank, p.dst_param, p.dst_index)].append(p.dst_box)
        for (srv, r), params in self.engine_params.items():
            want = {(q.name, b.local_index): [] for q in params for b in q.blocks}
            for q in params:
                for b in q.blocks:
                    want[(q.name, b.local_index)].append(_shift(b.hf_box, b.hf_box, b.local_start))
            for (name, idx), regions in want.items():
                got = by_dst.pop((srv, r, name, idx), [])
                assert sum(_vol(x) for x in got) == sum(_vol(x) for x in regions), (srv, r, name, idx)
                for x in got:  # inside the weights (never padding), pairwise disjoint
                    assert any(_inside(x, w) for w in regions), (srv, r, name, x)
                _assert_disjoint(got, (srv, r, name, idx))
        assert not by_dst, f"pieces for parameters the engine does not have: {list(by_dst)[:3]}"
        assert self.bytes_per_engine_rank() == self.shard_bytes


def _vol(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _inside(x: Box, w: Box) -> bool:
    return all(wa <= a and b <= wb for (a, b), (wa, wb) in zip(x, w))


def _assert_disjoint(boxes: list[Box], what: Any) -> None:
    boxes = sorted(boxes)
    for i, x in enumerate(boxes):
        for y in boxes[i + 1:]:
            if y[0][0] >= x[0][1]:
                break  # sorted by the first dim's start: no later box overlaps x there
            overlap = all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(x, y))
            assert not overlap, f"{what}: boxes {x} and {y} overlap"


def _intersect(x: Box, y: Box) -> Box | None:
    out = []
    for (a, b), (c, d) in zip(x, y):
        lo, hi = (a if a > c else c), (b if b < d else d)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _shift(box: Box, ref: Box, start: tuple[int, ...]) -> Box:
    """``box`` (HF coordinates, inside ``ref``) in the local coordinates where ``ref`` starts at ``start``."""
    return tuple((s + a - r0, s + b - r0) for (a, b), (r0, _), s in zip(box, ref, start))


@dataclass(frozen=True)
class _Source:
    block: Block
    chunk: int
    param: str
    ranks: tuple[int, ...]
    """Learner ranks holding this block (replicas), any of which may send it."""


def learner_sources(adapter: ModelAdapter, layout: ParallelLayout, dtype: str) -> dict[str, list[_Source]]:
    """HF name -> the learner blocks holding parts of it, with the ranks that hold each."""
    out: dict[str, list[_Source]] = defaultdict(list)
    lay = layout
    for stage in adapter.plan(layout, dtype=dtype):
        p = stage.stage
        for prm in stage.params:
            if not prm.exported:
                continue
            if prm.ep_rank is not None:
                size = lay.etp
                ranks_of = lambda t: tuple(lay.expert_rank(pp=p, edp=x, ep=prm.ep_rank, etp=t)  # noqa: E731
                                           for x in range(lay.edp))
            else:
                size = lay.tp
                ranks_of = lambda t: tuple(lay.rank(dp=x, pp=p, cp=c, tp=t)  # noqa: E731
                                           for x in range(lay.dp) for c in range(lay.cp))
            if prm.tp_dim is None:  # replicated over TP: every TP rank of every replica holds it
                ranks = tuple(r for t in range(size) for r in ranks_of(t))
                for b in adapter.shard_blocks(prm, size, 0):
                    out[b.hf_name].append(_Source(b, prm.chunk, prm.name, ranks))
                continue
            for t in range(size):
                for b in adapter.shard_blocks(prm, size, t):
                    out[b.hf_name].append(_Source(b, prm.chunk, prm.name, ranks_of(t)))
    return out


def plan_reshard(
    adapter: ModelAdapter,
    learner: ParallelLayout,
    engines: Sequence[EngineLayout],
    *,
    dtype: str | None = None,
    bucket_bytes: int = 512 << 20,
    backend: str = "nccl",
) -> ReshardPlan:
    """The plan for pushing ``adapter``'s model from ``learner`` into servers of ``engines``
    layouts, every tensor in ``dtype`` (default: the checkpoint's) unless SGLang keeps it in its
    own dtype (EngineParam.dtype); messages cut for the transport ``backend`` (DIRECT_BYTES)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: must be >= 1, got {bucket_bytes}")
    if not engines:
        raise ValueError("reshard plan: no engine layouts (no servers)")
    dtype = dtype_name(dtype or adapter.arch.dtype)
    sources = learner_sources(adapter, learner, dtype)
    load = [0] * learner.world_size
    pairs: dict[tuple[int, int, int], list[Piece]] = defaultdict(list)
    shard: dict[tuple[int, int], int] = {}
    params_of: dict[tuple[int, int], tuple[EngineParam, ...]] = {}
    geometry: dict[tuple[EngineLayout, int], tuple] = {}
    for srv, eng in enumerate(engines):
        for r in range(eng.tp):
            if (eng, r) not in geometry:  # servers of one layout share it
                geometry[(eng, r)] = _rank_geometry(adapter, eng, r, sources, dtype)
            params, pieces, total = geometry[(eng, r)]
            params_of[(srv, r)] = params
            shard[(srv, r)] = total
            for piece, ranks in pieces:
                src = min(ranks, key=lambda x: (load[x], x))
                load[src] += piece.nbytes
                pairs[(src, srv, r)].append(piece)
    if backend not in DIRECT_BYTES:
        raise ValueError(f"reshard plan: backend must be one of {sorted(DIRECT_BYTES)}, got {backend!r}")
    messages = _schedule(_cut(pairs, bucket_bytes, DIRECT_BYTES[backend]))
    plan = ReshardPlan(learner, tuple(engines), dtype, bucket_bytes, tuple(messages), shard, params_of)
    return plan


def _rank_geometry(adapter: ModelAdapter, eng: EngineLayout, r: int, sources: dict, dtype: str) -> tuple:
    """(engine params, [(piece, candidate learner ranks)], shard bytes) of engine rank ``r``."""
    params = tuple(engine_params(adapter, eng, r))
    pieces, total = [], 0
    for q in params:
        dt = q.dtype or dtype
        for b in q.blocks:
            total += b.numel * DTYPE_BYTES[dt]
            for s in sources.get(b.hf_name, ()):
                box = _intersect(b.hf_box, s.block.hf_box)
                if box is not None:
                    pieces.append((Piece(b.hf_name, s.chunk, s.param, _shift(box, s.block.hf_box, s.block.local_start),
                                         q.name, b.local_index, _shift(box, b.hf_box, b.local_start), dt), s.ranks))
    return params, pieces, total


DIRECT_BYTES = {"gloo": 256 << 10, "nccl": None}
"""By transport backend: the pieces a pair sends into one destination parameter travel as
messages of their own once they reach this many bytes, in the destination's memory order: where
they tile a contiguous span (a whole TP shard; fused qkv rows from their per-group sources) the
engine receives the message straight into the parameter, and where the source side is one span
too (fused gate/up) the learner sends it without packing (reshard_transport.py,
tools/env/sglang_reshard.py). Worth it where a copy costs about what the wire does (CPU: memcpy
vs loopback TCP) and the group is bigger than one message's latency (~tens of us) of copying.
On GPUs a copy runs in HBM at ~60x a 400 Gb/s link, so there (None) pieces share
bucket_bytes messages: fewer rounds (the projections in docs/weight_sync.md)."""


def _cut(pairs: dict[tuple[int, int, int], list[Piece]], bucket_bytes: int,
         direct_bytes: int | None) -> dict[tuple[int, int, int], list[list[Piece]]]:
    if direct_bytes is None:
        return {key: _buckets(pieces, bucket_bytes) for key, pieces in pairs.items()}
    out = {}
    for key, pieces in pairs.items():
        by_dst: dict[str, list[Piece]] = defaultdict(list)
        for p in pieces:  # a FusedMoE parameter's experts together: consecutive ones are adjacent
            by_dst[p.dst_param].append(p)
        chunks, small = [], []
        for group in by_dst.values():
            group.sort(key=lambda p: (p.dst_index, p.dst_box))
            if sum(p.nbytes for p in group) >= min(direct_bytes, bucket_bytes):
                chunks.extend(_buckets(group, bucket_bytes))  # memory order kept
            else:
                small.extend(group)
        out[key] = chunks + _buckets(small, bucket_bytes)
    return out


def _buckets(pieces: list[Piece], bucket_bytes: int) -> list[list[Piece]]:
    """Pieces in plan order, cut into messages of <= bucket_bytes (a larger piece alone)."""
    chunks, cur, used = [], [], 0
    for p in pieces:
        if cur and used + p.nbytes > bucket_bytes:
            chunks.append(cur)
            cur, used = [], 0
        cur.append(p)
        used += p.nbytes
    if cur:
        chunks.append(cur)
    return chunks


def _schedule(queues: dict[tuple[int, int, int], list[list[Piece]]]) -> list[Message]:
    """Greedy rounds: each round a matching of learner ranks to engine ranks, pairs with the most
    bytes left first (the longest queues bound the number of rounds)."""
    left = {k: list(v) for k, v in queues.items() if v}
    remaining = {k: sum(sum(p.nbytes for p in c) for c in v) for k, v in left.items()}
    out: list[Message] = []
    rnd = 0
    while left:
        busy_src: set[int] = set()
        busy_dst: set[tuple[int, int]] = set()
        for key in sorted(left, key=lambda k: (-remaining[k], k)):
            src, srv, r = key
            if src in busy_src or (srv, r) in busy_dst:
                continue
            busy_src.add(src)
            busy_dst.add((srv, r))
            chunk = left[key].pop(0)
            remaining[key] -= sum(p.nbytes for p in chunk)
            out.append(Message(rnd, src, srv, r, tuple(chunk)))
        left = {k: v for k, v in left.items() if v}
        rnd += 1
    out.sort(key=lambda m: (m.round, m.src))
    return out


def iter_pieces(messages: Iterable[Message]) -> Iterable[tuple[Message, int, Piece]]:
    for m in messages:
        for off, p in zip(m.offsets, m.pieces):
            yield m, off, p


def wire_messages(messages: Iterable[Message], group_rank_of_src: Any = lambda r: r) -> list:
    """The receiver's form of one engine rank's messages (tools/env/sglang_reshard.py ``sync``):
    ``[src group rank, nbytes, [[param, index, box, dtype, offset], ...]]`` in order."""
    return [[group_rank_of_src(m.src), m.nbytes,
             [[p.dst_param, list(p.dst_index), [list(b) for b in p.dst_box], p.dtype, off]
              for off, p in zip(m.offsets, m.pieces)]] for m in messages]
