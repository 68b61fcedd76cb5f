"""SGLang's own parameter layout (0.5.23), per engine TP rank, as pure metadata.

What each TP rank of an SGLang server holds, in SGLang's parameter names
(``model.named_parameters()`` of the loaded model) and local shapes, and which HF boxes live
where inside each parameter (:class:`~areal_mega.models.base.Block`). The resharding planner
(reshard.py) intersects these with the learner's shards. Read from SGLang's source:

* ``QKVParallelLinear`` (``self_attn.qkv_proj``): rank ``r`` holds ``[q_r; k_r; v_r]``, the query
  heads ``[r*nh/tp, (r+1)*nh/tp)`` then its KV heads; with fewer KV heads than ranks each KV head
  is replicated on ``tp / nkv`` consecutive ranks (``num_kv_head_replicas``).
* ``MergedColumnParallelLinear`` (``mlp.gate_up_proj``): ``[gate_r; up_r]``; ``RowParallelLinear``
  (``o_proj``, ``down_proj``): columns ``[r*n/tp, (r+1)*n/tp)``; norms and routers replicated.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64
  (of ``64 * tp`` when that does not divide evenly), rank ``r`` holding padded rows
  ``[r*Vp/tp, (r+1)*Vp/tp)``; rows past ``vocab_size`` are padding (zero, never sent). Tied
  embeddings: ``lm_head`` is ``embed_tokens`` (one parameter).
* ``FusedMoE`` (``mlp.experts.w13_weight`` ``[E_local, 2 f/moe_tp, h]`` = per expert
  ``[gate; up]``, ``w2_weight`` ``[E_local, h, f/moe_tp]``): with ``--ep-size ep`` the TP ranks
  form ``moe_tp = tp / ep`` x ``ep`` (moe-TP fastest: ``moe_ep_rank = r // moe_tp``), expert
  ``g`` on EP rank ``g // (E / ep)``.
* Which of these a family uses, in which order, is the family's own fact:
  ``ModelAdapter.sglang_layout(b)`` (areal_mega/models/) calls the builders of :class:`EngineRank`;
  a family without one (``sglang_layout = None``) is refused with a one-line error (weight_sync.mode
  broadcast serves it), and one whose sync SGLang would have to finish says why in its
  ``sglang_not_synced`` (none of the built-ins: DeepSeek-V3's absorbed MLA weights are recomputed
  by the receiver, which runs SGLang's post_load_weights after a sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_mega.models.base import Block, ModelAdapter
from areal_mega.models.registry import FAMILIES

__all__ = ["EngineLayout", "EngineParam", "EngineRank", "check_supported", "check_syncable", "engine_params",
           "sglang_vocab_padded"]


@dataclass(frozen=True)
class EngineLayout:
    """One SGLang server's parallel layout."""

    tp: int
    """--tp-size: ranks of the server."""
    ep: int = 1
    """--ep-size: the experts split over ep groups of tp / ep ranks (1 = every rank holds every
    expert, split over all tp ranks)."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1 or self.tp % self.ep:
            raise ValueError(f"engine layout: ep({self.ep}) must divide tp({self.tp}) (both >= 1)")


@dataclass(frozen=True)
class EngineParam:
    """One parameter of one engine rank: SGLang's name, this rank's local shape, and the HF boxes
    it holds (padding rows belong to no block)."""

    name: str
    shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    dtype: str | None = None
    """None = the server's serving dtype (fp32 for SGLang's own fp32 params, e.g. the MoE
    correction bias)."""

    @property
    def numel(self) -> int:
        """Elements that carry weights (padding excluded): what a sync must write."""
        return sum(b.numel for b in self.blocks)


def sglang_vocab_padded(vocab: int, tp: int) -> int:
    """SGLang's VocabParallelEmbedding padding (vocab_parallel_embedding.py): to a multiple of 64,
    or of 64 * tp when the 64-padded size does not split evenly."""
    pad = 64
    if (-(-vocab // pad) * pad) % tp:
        pad *= tp
    return -(-vocab // pad) * pad


class EngineRank:
    """Builders for one engine rank (``tp``, ``rank``) over an adapter's HF shapes: a family's
    ``ModelAdapter.sglang_layout(b)`` calls them in SGLang's load order; ``b.out`` collects."""

    def __init__(self, adapter: ModelAdapter, layout: EngineLayout, rank: int):
        self.a, self.arch, self.tp, self.r = adapter, adapter.arch, layout.tp, rank
        self.moe_tp = layout.tp // layout.ep
        self.ep, self.ep_rank, self.moe_tp_rank = layout.ep, rank // self.moe_tp, rank % self.moe_tp
        self.out: list[EngineParam] = []

    def _box(self, n: str, dim: int | None = None, lo: int = 0, hi: int = 0):
        return tuple((lo, hi) if i == dim else (0, s) for i, s in enumerate(self.a.hf_shape(n)))

    @staticmethod
    def _at(ndim: int, dim: int, off: int) -> tuple[int, ...]:
        return tuple(off if i == dim else 0 for i in range(ndim))

    def add(self, name: str, blocks: list[Block], shape: tuple[int, ...], dtype: str | None = None) -> None:
        self.out.append(EngineParam(name, tuple(shape), tuple(blocks), dtype))

    def replicated(self, name: str, *hf: str, dtype: str | None = None) -> None:
        """Whole HF tensors, fused along dim 0 in order."""
        blocks, off = [], 0
        for n in hf:
            s = self.a.hf_shape(n)
            blocks.append(Block(n, self._box(n), self._at(len(s), 0, off)))
            off += s[0]
        self.add(name, blocks, (off, *self.a.hf_shape(hf[0])[1:]), dtype)

    def column(self, name: str, *hf: str) -> None:
        """Each HF tensor split into tp row blocks; this rank's blocks fused in order (gate_up)."""
        blocks, off = [], 0
        for n in hf:
            s = self.a.hf_shape(n)
            per = s[0] // self.tp
            blocks.append(Block(n, self._box(n, 0, self.r * per, (self.r + 1) * per), self._at(len(s), 0, off)))
            off += per
        self.add(name, blocks, (off, *self.a.hf_shape(hf[0])[1:]))

    def row(self, name: str, n: str) -> None:
        s = self.a.hf_shape(n)
        per = s[1] // self.tp
        self.add(name, [Block(n, self._box(n, 1, self.r * per, (self.r + 1) * per), (0, 0))], (s[0], per))

    def qkv(self, name: str, q: str, k: str, v: str) -> None:
        a = self.arch
        d, nh, nkv = a.head_dim, a.num_heads, a.num_kv_heads
        hq = nh // self.tp
        if nkv >= self.tp:
            hkv, kv0 = nkv // self.tp, self.r * (nkv // self.tp)
        else:  # each KV head replicated on tp / nkv consecutive ranks
            hkv, kv0 = 1, self.r // (self.tp // nkv)
        rest = self.a.hf_shape(q)[1:]
        nd = 1 + len(rest)
        blocks = [Block(q, self._box(q, 0, self.r * hq * d, (self.r + 1) * hq * d), self._at(nd, 0, 0)),
                  Block(k, self._box(k, 0, kv0 * d, (kv0 + hkv) * d), self._at(nd, 0, hq * d)),
                  Block(v, self._box(v, 0, kv0 * d, (kv0 + hkv) * d), self._at(nd, 0, (hq + hkv) * d))]
        self.add(name, blocks, ((hq + 2 * hkv) * d, *rest))

    def vocab(self, name: str, n: str) -> None:
        v, h = self.a.hf_shape(n)
        per = sglang_vocab_padded(v, self.tp) // self.tp
        lo, hi = min(self.r * per, v), min((self.r + 1) * per, v)
        self.add(name, [Block(n, ((lo, hi), (0, h)), (0, 0))] if hi > lo else [], (per, h))

    def experts(self, prefix: str, layer: int) -> None:
        """FusedMoE w13 / w2 of one layer: this rank's EP group of experts, split over moe-TP."""
        a = self.a
        e_all = self.arch.num_experts
        local = e_all // self.ep
        gate, up, down = a.hf_expert_proj
        h, f = self.arch.hidden_size, self.arch.moe_ffn_hidden_size
        fp = f // self.moe_tp
        lo, hi = self.moe_tp_rank * fp, (self.moe_tp_rank + 1) * fp
        w13, w2 = [], []
        for j in range(local):
            g = self.ep_rank * local + j
            hf = f"model.layers.{layer}.{a.hf_moe}.experts.{g}."
            w13 += [Block(hf + f"{gate}.weight", ((lo, hi), (0, h)), (0, 0), (j,)),
                    Block(hf + f"{up}.weight", ((lo, hi), (0, h)), (fp, 0), (j,))]
            w2.append(Block(hf + f"{down}.weight", ((0, h), (lo, hi)), (0, 0), (j,)))
        self.add(f"{prefix}.experts.w13_weight", w13, (local, 2 * fp, h))
        self.add(f"{prefix}.experts.w2_weight", w2, (local, h, fp))

    # ---- the pieces most families share (Llama's names) ----------------------------------------
    def embedding(self) -> None:
        self.vocab("model.embed_tokens.weight", "model.embed_tokens.weight")

    def final(self) -> None:
        """The final norm, and ``lm_head`` unless tied to the embedding (one parameter then)."""
        self.replicated("model.norm.weight", "model.norm.weight")
        if not self.arch.tie_word_embeddings:
            self.vocab("lm_head.weight", "lm_head.weight")

    def gqa_attention(self, L: str) -> None:
        """Layer ``L``'s two norms and GQA attention: ``qkv_proj`` (+ bias), q/k norms, ``o_proj``."""
        self.replicated(f"{L}.input_layernorm.weight", f"{L}.input_layernorm.weight")
        self.qkv(f"{L}.self_attn.qkv_proj.weight", *(f"{L}.self_attn.{p}_proj.weight" for p in "qkv"))
        if self.arch.qkv_bias:
            self.qkv(f"{L}.self_attn.qkv_proj.bias", *(f"{L}.self_attn.{p}_proj.bias" for p in "qkv"))
        if self.arch.qk_layernorm:
            self.replicated(f"{L}.self_attn.q_norm.weight", f"{L}.self_attn.q_norm.weight")
            self.replicated(f"{L}.self_attn.k_norm.weight", f"{L}.self_attn.k_norm.weight")
        self.row(f"{L}.self_attn.o_proj.weight", f"{L}.self_attn.o_proj.weight")
        self.replicated(f"{L}.post_attention_layernorm.weight", f"{L}.post_attention_layernorm.weight")

    def dense_mlp(self, L: str, mlp: str = "mlp") -> None:
        """A SwiGLU MLP: ``gate_up_proj`` [gate_r; up_r] and row-parallel ``down_proj``."""
        self.column(f"{L}.{mlp}.gate_up_proj.weight", f"{L}.{mlp}.gate_proj.weight", f"{L}.{mlp}.up_proj.weight")
        self.row(f"{L}.{mlp}.down_proj.weight", f"{L}.{mlp}.down_proj.weight")


def check_syncable(adapter: ModelAdapter) -> None:
    """One-line ValueError unless a reshard sync of ``adapter``'s family can run (WeightSync,
    at construction): planned, and nothing left for SGLang to derive after the receiver wrote
    (the adapter's ``sglang_not_synced``)."""
    check_supported(adapter)
    why = adapter.sglang_not_synced
    if why:
        raise ValueError(f"weight_sync.mode: reshard is planned but not run for model_type "
                         f"{adapter.arch.model_type!r}: {why}; use broadcast")


def check_supported(adapter: ModelAdapter) -> None:
    """One-line ValueError unless ``adapter``'s family has an SGLang layout (its ``sglang_layout``)."""
    if adapter.sglang_layout is None:
        known = sorted(mt for mt, cls in FAMILIES.items() if cls.sglang_layout is not None)
        raise ValueError(f"weight_sync.mode: reshard has no SGLang layout for model_type {adapter.arch.model_type!r} "
                         f"(known: {known}); use broadcast")


def engine_params(adapter: ModelAdapter, layout: EngineLayout, rank: int) -> list[EngineParam]:
    """Every parameter SGLang rank ``rank`` of a server with ``layout`` holds, in load order."""
    check_supported(adapter)
    a = adapter.arch
    if a.num_heads % layout.tp:
        raise ValueError(f"engine layout: num_heads({a.num_heads}) % tp({layout.tp}) != 0")
    if a.num_kv_heads % layout.tp and layout.tp % a.num_kv_heads:
        raise ValueError(f"engine layout: num_kv_heads({a.num_kv_heads}) and tp({layout.tp}) do not divide each other")
    if a.is_moe and (a.num_experts % layout.ep or a.moe_ffn_hidden_size % (layout.tp // layout.ep)):
        raise ValueError(f"engine layout: num_experts({a.num_experts}) % ep({layout.ep}) or moe_intermediate_size"
                         f"({a.moe_ffn_hidden_size}) % (tp/ep)({layout.tp // layout.ep}) != 0")
    if not 0 <= rank < layout.tp:
        raise ValueError(f"engine rank {rank} outside tp({layout.tp})")
    b = EngineRank(adapter, layout, rank)
    adapter.sglang_layout(b)
    for p in b.out:  # internal invariant: every block inside its parameter
        for blk in p.blocks:
            local = p.shape[len(blk.local_index):]
            assert all(s + (hi - lo) <= n for s, (lo, hi), n in zip(blk.local_start, blk.hf_box, local)), (p.name, blk)
            assert math.prod(hi - lo for lo, hi in blk.hf_box) >= 0
    return b.out
