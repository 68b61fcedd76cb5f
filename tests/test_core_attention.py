"""areal_mega/megatron/attention.py: the project's core attention for the local layer spec.

In-process (no torch.distributed group: a TP size of 1 is all the module asks of its process
groups). Pins:

* bit-identical (fp32 and bf16, ``torch.equal``) to megatron-core 0.16.1's local
  ``DotProductAttention`` where both run (one head size, GQA, explicit packed mask and causal);
* any q/k and v head sizes (MLA: k_channels != v_channels, which DotProductAttention rejects)
  against a float64 reference softmax(q k^T * scale) v;
* packed THD input (``PackedSeqParams`` with cu_seqlens) = each sequence attended alone;
* :func:`block_causal_mask` with the rows of one (context-parallel-style) chunk = those rows of
  the full mask (what a CP rank holding all-gathered K/V will pass).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.support.numerics import fp64_tol, rounding_tol

SEQS = [5, 9, 3, 7]


@pytest.fixture(scope="module")
def megatron_env():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from areal_mega.megatron import cpu_compat

    cpu_compat.apply()
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    tracker = get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 1234)
    return SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


def _config(dtype=torch.float32, heads=4, groups=2, kv=16):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=kv, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                             attention_softmax_in_fp32=True, masked_softmax_fusion=False, attention_dropout=0.0)


def _qkv(T, heads, groups, dk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, 1, heads, dk, generator=g).to(dtype)
    k = torch.randn(T, 1, groups, dk, generator=g).to(dtype)
    v = torch.randn(T, 1, groups, dv, generator=g).to(dtype)
    return q, k, v


def _cu():
    return torch.tensor([0] + list(torch.tensor(SEQS).cumsum(0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
def test_bit_identical_to_dot_product_attention(megatron_env, dtype, masked):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from areal_mega.megatron.attention import CoreAttention, block_causal_mask

    cfg = _config(dtype)
    ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=megatron_env)
    ours = CoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=megatron_env)
    T = sum(SEQS)
    q, k, v = _qkv(T, 4, 2, 16, 16, dtype)
    mask = block_causal_mask(_cu()) if masked else torch.triu(torch.ones(T, T, dtype=torch.bool), 1).view(1, 1, T, T)
    a, b = ref(q, k, v, mask), ours(q, k, v, mask)
    assert a.shape == b.shape == (T, 1, 4 * 16)
    assert torch.equal(a, b)


def _reference(q, k, v, mask, scale):
    """float64 softmax(q k^T * scale + mask) v, q [T, 1, h, dk], k/v [T, 1, g, d]."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (x.double()[:, 0].transpose(0, 1) for x in (q, k, v))  # [h, T, d]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(1, 2)) * scale
    s = s.masked_fill(mask[0], float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[1], 1, -1)


def test_any_head_dims_mla_shapes(megatron_env):
    """k_channels 24 (nope 16 + rope 8), v_channels 12, 4 heads (MLA: K/V per head), a given
    softmax scale: against the float64 reference. Bound: fp32 reductions of K = max(dk, T)
    terms, ops 3 (scores, softmax normaliser, probs . v), magnitude = the largest |output|
    contribution (|v| <= ~4 for these N(0,1) inputs, probs <= 1)."""
    from megatron.core.transformer.enums import AttnMaskType

    from areal_mega.megatron.attention import CoreAttention, block_causal_mask

    cfg = _config(heads=4, groups=4, kv=24)
    scale = 0.37
    ours = CoreAttention(cfg, 1, AttnMaskType.causal, "self", softmax_scale=scale, k_channels=24, v_channels=12,
                         pg_collection=megatron_env)
    T = sum(SEQS)
    q, k, v = _qkv(T, 4, 4, 24, 12, torch.float32, seed=1)
    mask = block_causal_mask(_cu())
    out = ours(q, k, v, mask)
    ref = _reference(q, k, v, mask, scale)
    assert out.shape == (T, 1, 4 * 12)
    tol = rounding_tol("float32", max(24, T), float(v.abs().max()), ops=3)
    d = (out.double() - ref).abs().max().item()
    assert d <= tol, (d, tol)
    # the mask matters: attending across sequences moves outputs far beyond the bound
    full = _reference(q, k, v, torch.triu(torch.ones(T, T, dtype=torch.bool), 1).view(1, 1, T, T), scale)
    assert (full - ref).abs().max().item() > 1000 * tol
    assert fp64_tol(T) < tol  # the float64 reference's own error is negligible


def test_packed_thd_equals_each_sequence_alone(megatron_env):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from areal_mega.megatron.attention import CoreAttention

    cfg = _config(heads=4, groups=2, kv=16)
    ours = CoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=megatron_env)
    T, cu = sum(SEQS), _cu()
    q, k, v = _qkv(T, 4, 2, 16, 16, torch.float32, seed=2)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(SEQS),
                          max_seqlen_kv=max(SEQS))
    packed = ours(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=psp)
    assert packed.shape == (T, 4 * 16)
    tol = rounding_tol("float32", max(SEQS), float(v.abs().max()), ops=3)
    for i in range(len(SEQS)):
        s, e = int(cu[i]), int(cu[i + 1])
        alone = ours(q[s:e], k[s:e], v[s:e], None)[:, 0]  # causal mask built by megatron's softmax
        assert (packed[s:e] - alone).abs().max().item() <= tol, i


def test_block_causal_mask_chunk_rows():
    from areal_mega.megatron.attention import block_causal_mask

    cu = _cu()
    full = block_causal_mask(cu)
    T = sum(SEQS)
    rows = torch.cat([torch.arange(0, 4), torch.arange(T - 4, T)])  # a CP rank's two chunks
    part = block_causal_mask(cu, q_index=rows)
    assert torch.equal(part[0, 0], full[0, 0, rows])
    # same sequence and causal: token 1 sees 0 and 1 only; the first token of sequence 2 sees itself
    assert full[0, 0, 1].tolist()[:3] == [False, False, True]
    assert (~full[0, 0, SEQS[0]]).nonzero().flatten().tolist() == [SEQS[0]]
    assert not math.isnan(float(full.float().mean()))
