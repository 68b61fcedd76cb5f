"""Sequence packing and token-budget micro-batching (pure logic; no process groups).

A *packed batch*: ``input_ids`` [T] and ``cu_seqlens`` [B + 1] (sequences back to back, never
padded to the longest), plus per-token [T] and per-sequence [B] fields.

Invariant: the plan (DP split, then micro-batches under ``max_tokens_per_microbatch``, the same
count on every DP rank) is a deterministic function of the sequence lengths, so every rank
computes it without communicating; :func:`scatter_to_batch` restores the batch order.
Algorithm, fillers, alignment: docs/engine.md ("Packing").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = [
    "MicroBatch", "MicroBatchPlan", "PAD_TOKEN_ID", "cu_seqlens_of", "last_token_mask", "next_token_labels",
    "pack_into_bins", "pack_sequences", "pad_to_longest_efficiency", "plan_microbatches", "scatter_to_batch",
    "seqlens_of", "shift_to_next_token", "slice_microbatch", "split_for_dp", "validate_batch",
    "ContextShard", "context_shard", "context_shard_index", "cp_padded_length",
]

PAD_TOKEN_ID = 0


def seqlens_of(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    cu = [int(x) for x in cu_seqlens]
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def cu_seqlens_of(lens: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    if len(lens):
        out[1:] = torch.cumsum(torch.as_tensor(list(lens), dtype=torch.int64), 0)
    return out


def pack_sequences(seqs: Sequence[dict[str, Sequence[Any]]]) -> dict[str, torch.Tensor]:
    """List of per-sequence dicts of equal-length lists -> packed batch dict.

    Every sequence must have the same keys, including ``input_ids``. Integer lists become int64,
    float lists float32.
    """
    if not seqs:
        raise ValueError("pack_sequences: empty list of sequences")
    keys = list(seqs[0].keys())
    if "input_ids" not in keys:
        raise ValueError("pack_sequences: each sequence needs 'input_ids'")
    lens = []
    for i, s in enumerate(seqs):
        if set(s.keys()) != set(keys):
            raise ValueError(f"pack_sequences: sequence {i} has keys {sorted(s)} != {sorted(keys)}")
        n = len(s["input_ids"])
        if n < 1:
            raise ValueError(f"pack_sequences: sequence {i} has empty input_ids")
        for k in keys:
            if len(s[k]) != n:
                raise ValueError(f"pack_sequences: sequence {i} field '{k}' has {len(s[k])} != {n} tokens")
        lens.append(n)
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        flat = [v for s in seqs for v in s[k]]
        is_float = any(isinstance(v, float) for v in flat)
        out[k] = torch.tensor(flat, dtype=torch.float32 if is_float else torch.int64)
    out["cu_seqlens"] = cu_seqlens_of(lens)
    return out


def validate_batch(batch: dict[str, torch.Tensor]) -> list[int]:
    """Check a packed batch's shapes; return its sequence lengths. Errors name the tensor."""
    for k in ("input_ids", "cu_seqlens"):
        if k not in batch:
            raise ValueError(f"packed batch: missing '{k}'")
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    if ids.dim() != 1:
        raise ValueError(f"packed batch: 'input_ids' must be flat [T], got shape {tuple(ids.shape)}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"packed batch: 'cu_seqlens' must be [B+1] with B >= 1, got {tuple(cu.shape)}")
    lens = seqlens_of(cu)
    if int(cu[0]) != 0 or int(cu[-1]) != ids.numel() or min(lens) < 1:
        raise ValueError(
            f"packed batch: 'cu_seqlens' must start at 0, increase strictly and end at "
            f"len(input_ids)={ids.numel()}; got {cu.tolist()[:8]}..."
        )
    num_seqs = len(lens)
    for k, v in batch.items():
        if k == "cu_seqlens" or not isinstance(v, torch.Tensor):
            continue
        if v.dim() == 0 or v.shape[0] not in (ids.numel(), num_seqs):
            raise ValueError(
                f"packed batch: field '{k}' has leading dim {tuple(v.shape)[:1]}, expected "
                f"T={ids.numel()} (per token) or B={num_seqs} (per sequence)"
            )
    return lens


@dataclass
class MicroBatch:
    """One micro-batch: which input sequences it holds, in packing order."""

    seq_indices: list[int]
    """Indices into the input batch's sequences (empty for a filler micro-batch)."""
    num_tokens: int
    """Real tokens (sum of the sequences' lengths); 0 for a filler."""

    @property
    def is_filler(self) -> bool:
        return not self.seq_indices


@dataclass
class MicroBatchPlan:
    """Per-DP-rank micro-batches; every rank has the same number (``num_microbatches``)."""

    per_rank: list[list[MicroBatch]]
    max_tokens_per_microbatch: int
    seq_lens: list[int] = field(default_factory=list)

    @property
    def num_microbatches(self) -> int:
        return len(self.per_rank[0])

    def tokens_per_rank(self) -> list[int]:
        return [sum(mb.num_tokens for mb in mbs) for mbs in self.per_rank]

    def packing_efficiency(self) -> float:
        """Real tokens / (micro-batch slots * budget): how full fixed-budget micro-batches are."""
        slots = sum(len(m) for m in self.per_rank) * self.max_tokens_per_microbatch
        return sum(self.seq_lens) / slots if slots else 1.0


def split_for_dp(seq_lens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Deal sequences to ``dp_size`` ranks, longest first to the least-loaded rank (LPT).

    Returns, per rank, sequence indices in ascending order. Ties go to the lowest rank, so the
    result depends only on ``seq_lens`` and ``dp_size``. A rank may get no sequence when there
    are fewer sequences than ranks (it then runs filler micro-batches only).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size: must be >= 1, got {dp_size}")
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    loads = [0] * dp_size
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        r = min(range(dp_size), key=lambda j: (loads[j], j))
        ranks[r].append(i)
        loads[r] += seq_lens[i]
    return [sorted(r) for r in ranks]


def _fit_bins(
    seq_lens: Sequence[int], indices: Sequence[int], max_tokens: int, num_bins: int, worst_fit: bool
) -> list[list[int]]:
    """Longest first; into the first (or least-filled, ``worst_fit``) bin with room, else a new
    bin. An empty bin takes anything, so a sequence over the budget sits alone."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(indices, key=lambda i: (-seq_lens[i], i)):
        n = seq_lens[i]
        fits = [b for b in range(len(bins)) if loads[b] + n <= max_tokens or loads[b] == 0]
        if not fits:
            bins.append([])
            loads.append(0)
            fits = [len(bins) - 1]
        b = min(fits, key=lambda b: (loads[b], b)) if worst_fit else fits[0]
        bins[b].append(i)
        loads[b] += n
    return bins


def pack_into_bins(
    seq_lens: Sequence[int], indices: Sequence[int], max_tokens: int, min_bins: int = 1
) -> list[MicroBatch]:
    """Pack ``indices`` into as few micro-batches as first-fit-decreasing finds (but at least
    ``min_bins``), then balance them.

    FFD fixes the count k (FFD is within 11/9 of the optimum); "worst-fit decreasing" into k
    pre-opened bins (longest first, into the least-filled bin with room) then evens out the
    loads, which shortens pipeline bubbles and DP stragglers. If WFD cannot fit into k bins
    the FFD assignment is kept. Bins left empty (fewer sequences than ``min_bins``) become
    fillers, placed last. Inside a bin sequences keep their input order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch: must be >= 1, got {max_tokens}")
    k = max(len(_fit_bins(seq_lens, indices, max_tokens, 0, worst_fit=False)), min_bins, 1)
    bins = _fit_bins(seq_lens, indices, max_tokens, k, worst_fit=True)
    if len(bins) > k:
        bins = _fit_bins(seq_lens, indices, max_tokens, k, worst_fit=False)
    order = sorted(range(len(bins)), key=lambda b: (not bins[b], b))
    return [MicroBatch(sorted(bins[b]), sum(seq_lens[i] for i in bins[b])) for b in order]


def plan_microbatches(
    seq_lens: Sequence[int], max_tokens: int, dp_size: int = 1, min_microbatches: int = 1
) -> MicroBatchPlan:
    """Split a batch over ``dp_size`` ranks, then into the same number of micro-batches per rank.

    Invariants (tested): every sequence appears in exactly one micro-batch of exactly one
    rank; all ranks have ``num_microbatches`` micro-batches; a micro-batch exceeds
    ``max_tokens`` only if it holds a single sequence longer than the budget.
    """
    lens = [int(n) for n in seq_lens]
    if any(n < 1 for n in lens):
        raise ValueError("seq_lens: every sequence needs >= 1 token")
    shards = split_for_dp(lens, dp_size)
    target = max(min_microbatches, 1)
    while True:
        per_rank = [pack_into_bins(lens, s, max_tokens, min_bins=target) for s in shards]
        most = max(len(m) for m in per_rank)
        if all(len(m) == most for m in per_rank):
            return MicroBatchPlan(per_rank, max_tokens, lens)
        target = most


def slice_microbatch(batch: dict[str, torch.Tensor], mb: MicroBatch) -> dict[str, torch.Tensor]:
    """Gather ``mb``'s sequences from ``batch`` into a packed micro-batch dict.

    Per-token fields ([T]) are concatenated, per-sequence fields ([B]) indexed; the result has
    its own ``cu_seqlens`` and ``seq_indices``. A filler is one pad token with all fields 0.
    """
    cu = batch["cu_seqlens"].tolist()
    total, num_seqs = int(cu[-1]), len(cu) - 1
    out: dict[str, torch.Tensor] = {}
    if mb.is_filler:
        for k, v in batch.items():
            if k == "cu_seqlens" or not isinstance(v, torch.Tensor):
                continue
            out[k] = torch.zeros((1, *v.shape[1:]), dtype=v.dtype)
        out["input_ids"].fill_(PAD_TOKEN_ID)
        out["cu_seqlens"] = torch.tensor([0, 1], dtype=torch.int64)
        out["seq_indices"] = torch.zeros(0, dtype=torch.int64)
        return out
    tok_idx = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in mb.seq_indices])
    seq_idx = torch.as_tensor(mb.seq_indices, dtype=torch.int64)
    for k, v in batch.items():
        if k == "cu_seqlens" or not isinstance(v, torch.Tensor):
            continue
        if v.shape[0] == total:  # per-token wins if T == B (only ambiguous for 1-token seqs)
            out[k] = v[tok_idx]
        elif v.shape[0] == num_seqs:
            out[k] = v[seq_idx]
    out["cu_seqlens"] = cu_seqlens_of([cu[i + 1] - cu[i] for i in mb.seq_indices])
    out["seq_indices"] = seq_idx
    return out


def scatter_to_batch(
    cu_seqlens: torch.Tensor, pieces: Sequence[tuple[Sequence[int], torch.Tensor]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Write per-micro-batch flat outputs back into the batch's flat [T] layout.

    ``pieces`` holds (seq_indices, values) where values is the micro-batch's flat output, its
    sequences in ``seq_indices`` order. Positions not covered stay 0 (so partial results from
    several ranks can be combined by summation).
    """
    cu = cu_seqlens.tolist()
    if out is None:
        dtype = pieces[0][1].dtype if pieces else torch.float32
        out = torch.zeros(int(cu[-1]), dtype=dtype)
    for seq_indices, values in pieces:
        off = 0
        for i in seq_indices:
            n = cu[i + 1] - cu[i]
            out[cu[i] : cu[i + 1]] = values[off : off + n]
            off += n
        assert off == values.shape[0], f"micro-batch output has {values.shape[0]} tokens, expected {off}"
    return out


def shift_to_next_token(x: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``out[i] = x[i + 1]`` inside each sequence; the last token of each sequence gets ``fill``.

    Converts "this-token" trajectory fields (loss_mask, behaviour logprobs, versions) to the
    engine's next-token alignment: e.g. ``shift_to_next_token(loss_mask)[i] == 1`` iff the
    prediction made at position i is trained on.
    """
    out = torch.full_like(x, fill)
    out[:-1] = x[1:]
    ends = cu_seqlens[1:].long() - 1
    out[ends] = fill
    return out


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction: ``input_ids`` shifted left per sequence, 0 at ends."""
    return shift_to_next_token(input_ids, cu_seqlens, fill=0)


def last_token_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Bool [T], True at each sequence's last token (which predicts nothing)."""
    m = torch.zeros(total, dtype=torch.bool, device=cu_seqlens.device)
    m[cu_seqlens[1:].long() - 1] = True
    return m


def pad_to_longest_efficiency(seq_lens: Sequence[int], max_tokens: int) -> tuple[float, int]:
    """Baseline: micro-batches of consecutive sequences padded to their longest member.

    Sequences are taken in arrival order while ``count * longest <= max_tokens`` (a longer
    sequence goes alone). Returns (real tokens / computed tokens, number of micro-batches).
    """
    computed = 0
    num_mb = 0
    cur: list[int] = []
    for n in seq_lens:
        if cur and (len(cur) + 1) * max(max(cur), n) > max_tokens:
            computed += len(cur) * max(cur)
            num_mb += 1
            cur = []
        cur.append(n)
    if cur:
        computed += len(cur) * max(cur)
        num_mb += 1
    return sum(seq_lens) / computed, num_mb


# -- context parallelism: the load-balanced split of a packed row over the CP ranks ---------------

def cp_padded_length(cu_seqlens: torch.Tensor | Sequence[int], cp: int, multiple: int = 1) -> int:
    """Row length a packed row runs at under context parallelism ``cp``: every sequence padded to
    a multiple of 2 x cp (each is cut into 2 x cp equal chunks), the total rounded up to a
    multiple of ``2 * cp * multiple`` (``multiple`` = tp under sequence parallelism: each CP
    rank's share must split over the TP ranks). ``cp`` = 1: the plain length, to ``multiple``."""
    lens = seqlens_of(cu_seqlens)
    if cp <= 1:
        return -(-sum(lens) // multiple) * multiple
    c = 2 * cp
    total = sum(-(-n // c) * c for n in lens)
    step = c * multiple
    return -(-total // step) * step


@dataclass(frozen=True)
class ContextShard:
    """One CP rank's share of a packed row (the split megatron and transformer-engine use for THD).

    Every sequence of the row is padded at its end to a multiple of 2 x cp and cut into 2 x cp
    equal chunks; rank r holds chunks r and 2cp-1-r of EVERY sequence (so each rank gets an equal
    share of the causal work: an early chunk with few keys and a late one with many). Pads
    appended to reach ``padded_len`` form one trailing pad sequence, split the same way.

    ``cu_padded`` [n + 2] (or [n + 1] with no trailing pad): the padded row's cu_seqlens;
    ``cu_real`` [same]: cumulative REAL lengths of the same sequences (0 for the trailing pad):
    transformer-engine's ``cu_seqlens_q`` beside ``cu_seqlens_q_padded`` = ``cu_padded``;
    ``index`` [padded_len / cp]: the padded-row positions this rank holds, in its local order;
    ``real_pos`` [T]: the padded-row position of each real token (row order).
    """

    cp: int
    rank: int
    cu_padded: torch.Tensor
    cu_real: torch.Tensor
    index: torch.Tensor
    real_pos: torch.Tensor

    @property
    def padded_len(self) -> int:
        return int(self.cu_padded[-1])

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_padded[1:] - self.cu_padded[:-1]).max())

    def all_index(self) -> torch.Tensor:
        """Padded-row positions of every rank's tokens, rank 0's first: the order an all-gather
        over the CP group lays them out in."""
        return torch.cat([context_shard_index(self.cu_padded, self.cp, r) for r in range(self.cp)])

    def to_local(self, x: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """A row-order per-token tensor [T, ...] -> this rank's tokens [padded_len / cp, ...]
        (pads = ``fill``)."""
        full = x.new_full((self.padded_len, *x.shape[1:]), fill)
        full[self.real_pos.to(x.device)] = x
        return full[self.index.to(x.device)]


def context_shard_index(cu_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions in the padded row of CP rank ``rank``'s tokens: per sequence, chunk ``rank``
    then chunk ``2cp-1-rank`` (every padded length must divide by 2 x cp)."""
    cu = [int(x) for x in cu_padded]
    parts = []
    for s, e in zip(cu[:-1], cu[1:]):
        if (e - s) % (2 * cp):
            raise ValueError(f"context parallel: padded sequence length {e - s} is not a multiple of 2 x cp = {2 * cp}")
        c = (e - s) // (2 * cp)
        parts += [torch.arange(s + rank * c, s + (rank + 1) * c),
                  torch.arange(s + (2 * cp - 1 - rank) * c, s + (2 * cp - rank) * c)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def context_shard(cu_seqlens: torch.Tensor | Sequence[int], cp: int, rank: int, padded_len: int) -> ContextShard:
    """CP rank ``rank``'s :class:`ContextShard` of the row ``cu_seqlens``, padded to ``padded_len``
    (>= :func:`cp_padded_length`, a multiple of 2 x cp)."""
    lens = seqlens_of(cu_seqlens)
    c = 2 * cp
    plens = [-(-n // c) * c for n in lens]
    rest = padded_len - sum(plens)
    if rest < 0 or rest % c:
        raise ValueError(f"context parallel: padded_len {padded_len} cannot hold the row {lens} split in 2 x cp = {c}")
    if rest:
        plens, lens = plens + [rest], lens + [0]
    cu_padded = cu_seqlens_of(plens)
    real_pos = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_padded[:-1].tolist(), lens)])
    return ContextShard(cp=cp, rank=rank, cu_padded=cu_padded, cu_real=cu_seqlens_of(lens),
                        index=context_shard_index(cu_padded, cp, rank), real_pos=real_pos)
