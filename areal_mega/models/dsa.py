"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): DeepSeek-V3's MLA + MoE plus DeepSeek
sparse attention -- per layer a lightning indexer (wq_b on the q latent, wk + LayerNorm k_norm on
the hidden state, weights_proj) scores every earlier key and the attention keeps its top
``index_topk`` keys. Megatron side: megatron-core 0.16.1's DSAIndexer inside the project's
PackedDSAttention (megatron/sparse_attention.py). RL keeps the indexer frozen: docs/engine.md
"DeepSeek sparse attention".

The indexer's head layout differs between the checkpoints and megatron's module: HF holds each
index head as [rope dims, plain dims] (DeepSeek-V3.2 rotates halves (x_i, x_i+r/2), GLM-5 pairs
(x0, x1)); megatron's DSAIndexer holds [plain dims, rope dims] and rotates pairs (it de-interleaves
under multi_latent_attention). Index scores are dot products q . k of per-head vectors (through
a LayerNorm on k, which commutes with a permutation of its dims and its weight / bias), so one
fixed permutation of each head's rows of wq_b, wk, k_norm maps one onto the other exactly (fusion
"indexer_rows": pure indexing, so conversion stays bit-exact).
"""

from __future__ import annotations

from functools import cached_property

import torch

from areal_mega.models.base import DSAArch, McoreParam, ModelArch, _Rule
from areal_mega.models.moe_families import DeepseekV3Adapter, _arch
from areal_mega.models.registry import register_family

_INDEXER = "self_attention.core_attention.indexer."
# (megatron leaf, HF leaf, rows permuted per index head)
_INDEXER_RULES = (
    ("linear_wq_b.weight", "wq_b.weight", True),
    ("linear_wk.weight", "wk.weight", True),
    ("k_norm.weight", "k_norm.weight", True),
    ("k_norm.bias", "k_norm.bias", True),
    ("linear_weights_proj.weight", "weights_proj.weight", False),
)


@register_family
class DeepseekV32Adapter(DeepseekV3Adapter):
    """DeepSeek-V3.2(-Exp): DeepSeek-V3 (q_lora_rank set) with an indexer in every layer whose
    RoPE rotates halves (HF's apply_rotary_pos_emb)."""

    model_type = "deepseek_v32"
    architecture = "DeepseekV32ForCausalLM"
    sglang_layout = None  # SGLang cannot serve DSA on CPU (docs/engine.md): mode reshard refused, broadcast serves it
    known_keys = DeepseekV3Adapter.known_keys | {"index_topk", "index_n_heads", "index_head_dim", "mlp_layer_types",
                                                 "layer_types"}
    rope_interleaved = False

    def parse_config(self, c: dict) -> ModelArch:
        n = int(c["num_hidden_layers"])
        first = int(c.get("first_k_dense_replace") or 0)
        mlp = c.get("mlp_layer_types")
        if mlp is not None and list(mlp) != ["dense"] * first + ["sparse"] * (n - first):
            raise ValueError(f"mlp_layer_types: {mlp} is not supported (only first_k_dense_replace({first}) dense "
                             "layers then MoE ones)")
        lt = c.get("layer_types")
        if lt is not None and set(lt) != {"indexed_attention"}:
            raise ValueError(f"layer_types: {sorted(set(lt))} is not supported for {self.model_type} (only "
                             "'indexed_attention': every layer DSA)")
        if not c.get("q_lora_rank"):
            raise ValueError(f"q_lora_rank: {c.get('q_lora_rank')!r} is not supported for {self.model_type} (the "
                             "indexer reads the q latent; HF's model needs it too)")
        arch = super().parse_config(c)
        d, r = int(c.get("index_head_dim", 128)), arch.mla.qk_rope_head_dim
        if not (r % 2 == 0 and r <= d):
            raise ValueError(f"index_head_dim: {d} must be >= qk_rope_head_dim({r}), which must be even")
        dsa = DSAArch(index_topk=int(c.get("index_topk", 2048)), index_n_heads=int(c.get("index_n_heads", 64)),
                      index_head_dim=d, rope_interleaved=self.rope_interleaved)
        if dsa.index_topk < 1:
            raise ValueError(f"index_topk: must be >= 1, got {dsa.index_topk}")
        return _arch(arch, dsa=dsa)

    # ---- naming -------------------------------------------------------------------------------
    def layer_rules(self, spec="local", layer=0) -> list[_Rule]:
        rules = super().layer_rules(spec, layer)
        at = next(i for i, r in enumerate(rules) if r.mcore == "self_attention.linear_proj.weight")
        idx = [_Rule(_INDEXER + m, (f"self_attn.indexer.{h}",), None, "indexer_rows" if perm else "none")
               for m, h, perm in _INDEXER_RULES]
        return rules[:at] + idx + rules[at:]

    def _leaf_shapes(self):
        a, x = self.arch, self.arch.dsa
        d, q = x.index_head_dim, a.mla.q_lora_rank
        return {**super()._leaf_shapes(),
                "self_attn.indexer.wq_b.weight": (x.index_n_heads * d, q),
                "self_attn.indexer.wk.weight": (d, a.hidden_size),
                "self_attn.indexer.k_norm.weight": (d,),
                "self_attn.indexer.k_norm.bias": (d,),
                "self_attn.indexer.weights_proj.weight": (x.index_n_heads, a.hidden_size)}

    def mcore_shape(self, leaf):
        if leaf.startswith(_INDEXER):
            hf = dict((m, h) for m, h, _ in _INDEXER_RULES)[leaf[len(_INDEXER):]]
            return self._leaf_shapes()[f"self_attn.indexer.{hf}"]
        return super().mcore_shape(leaf)

    # ---- the index-head permutation -------------------------------------------------------------
    @cached_property
    def _perm(self) -> torch.Tensor:
        """Megatron row i of an index head = HF row perm[i]: [plain dims; rope dims], the rope dims
        laid out so that megatron's de-interleave gives HF's rotation pairs."""
        x, r = self.arch.dsa, self.arch.mla.qk_rope_head_dim
        d = x.index_head_dim
        if x.rope_interleaved:
            rope = list(range(r))
        else:  # megatron pair (2j, 2j+1) = HF half pair (j, j + r/2)
            rope = [j // 2 + (r // 2) * (j % 2) for j in range(r)]
        return torch.tensor(list(range(r, d)) + rope)

    def _permute(self, t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        d = self.arch.dsa.index_head_dim
        return t.reshape(-1, d, *t.shape[1:])[:, perm].reshape(t.shape)

    def to_hf(self, prm: McoreParam, canon):
        if prm.fusion == "indexer_rows":
            return [self._permute(canon, torch.argsort(self._perm))]
        return super().to_hf(prm, canon)

    def from_hf(self, prm: McoreParam, hf, shape=None):
        if prm.fusion == "indexer_rows":
            return self._permute(hf[0], self._perm)
        return super().from_hf(prm, hf, shape)

    def shard_blocks(self, prm, tp, tp_rank):
        if prm.fusion == "indexer_rows":  # only the reshard planner asks; sglang_layout is None for DSA
            raise ValueError(f"{prm.name}: the indexer's permuted rows are not planned for the reshard sync")
        return super().shard_blocks(prm, tp, tp_rank)


@register_family
class GlmMoeDsaAdapter(DeepseekV32Adapter):
    """GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's blocks with the indexer's RoPE on pairs
    (interleaved, as MLA's), no expert groups by default, LayerNorm eps 1e-6 in the indexer
    whatever rms_norm_eps is. Cross-layer top-k sharing (indexer_types "shared") is refused."""

    model_type = "glm_moe_dsa"
    architecture = "GlmMoeDsaForCausalLM"
    known_keys = DeepseekV32Adapter.known_keys | {"indexer_types"}
    rope_interleaved = True

    def parse_config(self, c: dict) -> ModelArch:
        kinds = c.get("indexer_types")
        if kinds is not None and set(kinds) != {"full"}:
            raise ValueError(f"indexer_types: {kinds} is not supported (only 'full'; a 'shared' layer reuses the "
                             "previous layer's top-k, which would run with the indices passed between "
                             "PackedDSAttention layers -- and across pipeline stages)")
        return super().parse_config(c)
