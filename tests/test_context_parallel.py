"""Context parallelism (docs/context_parallel.md): the load-balanced split, and CP layouts equal to CP1.

* fast: the split of packed rows over CP ranks (batching/packing.py), the global-index mask;
* ``make test`` (slow, in tests/dist/engine_sp.py's launch, asserted in tests/test_engine_sp.py):
  CP2 vs TP1 with every gradient, CP2 x TP2 (SP) vs TP2, the unadjusted-RoPE negative control;
* ``make test-cp`` (cp_heavy: one 4-rank launch of tests/dist/cp_layouts.py, ~3-5 min on 2 busy
  cores): CP2, CP2 x TP2, CP2 x PP2 and (tiny Qwen3-MoE) CP2 x EP2 vs CP1 for log-probs, entropy,
  loss, grad norm, every gradient and the step's effect; the critic; selective recompute; MoE
  routing replay with the routes split like the tokens; a CP2 checkpoint loaded at TP1.

Upstream behaviour pinned: megatron-core 0.16.1's THD RoPE under CP (``_apply_rotary_pos_emb_thd``
with ``cu_seqlens_q_padded``) expects exactly this split (chunks r and 2cp-1-r of each sequence
padded to 2 x cp); the negative control shows a wrong split of positions is caught.
"""

from __future__ import annotations

import pytest
import torch

from areal_mega.batching.packing import context_shard, context_shard_index, cp_padded_length, cu_seqlens_of
from areal_mega.megatron.attention import block_causal_mask
from tests.support.cp import ADAM_EPS, FWD, GRAD_REL_TOL, VOCAB, _t, after_tol, assert_cp_equal, lp_tol, maxdiff
from tests.support.launch import run_dist_script
from tests.support.models import count_params
from tests.support.numerics import adam_step_rel, fp32_tol

# ---------------------------------------------------------------- the split (fast)
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_split_is_balanced_complete_and_megatrons(cp):
    lens = [17, 3, 61, 1, 40]  # 3 and 1 are shorter than 2 x cp chunks
    cu = cu_seqlens_of(lens)
    n = cp_padded_length(cu, cp, multiple=2)
    assert n % (2 * cp * 2) == 0 and n >= sum(-(-x // (2 * cp)) * 2 * cp for x in lens)
    shards = [context_shard(cu, cp, r, n) for r in range(cp)]
    held = torch.cat([s.index for s in shards])
    assert sorted(held.tolist()) == list(range(n))  # every padded position on exactly one rank
    assert torch.equal(shards[0].all_index(), held)  # the all-gather's order
    c = 2 * cp
    for r, s in enumerate(shards):
        assert s.index.numel() == n // cp  # equal tokens per rank
        pc = s.cu_padded.tolist()
        for i in range(len(pc) - 1):  # per sequence: chunk r then chunk 2cp-1-r (megatron's THD split)
            L = pc[i + 1] - pc[i]
            w = L // c
            mine = [p for p in s.index.tolist() if pc[i] <= p < pc[i + 1]]
            assert mine == list(range(pc[i] + r * w, pc[i] + (r + 1) * w)) + \
                list(range(pc[i] + (c - 1 - r) * w, pc[i] + (c - r) * w))
        # real tokens: first in their padded sequence, in order; the padded cu holds a pad tail
        assert s.real_pos.numel() == sum(lens) and torch.all(s.real_pos[1:] > s.real_pos[:-1])
        assert s.cu_real[:len(lens) + 1].tolist() == cu.tolist()
    x = torch.arange(sum(lens)) + 100
    back = torch.zeros(n, dtype=torch.long)
    for s in shards:
        back[s.index] = s.to_local(x, -1)
    assert torch.equal(back[shards[0].real_pos], x) and int((back == -1).sum()) == n - sum(lens)
    with pytest.raises(ValueError, match="padded_len"):
        context_shard(cu, cp, 0, n - 2 * cp * 3 - 1)
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        context_shard_index(torch.tensor([0, 5]), cp, 0)


def test_global_index_mask_is_the_rows_of_the_full_mask():
    """A CP rank's mask over (its queries, all ranks' gathered keys) = the full block-causal
    mask's rows and columns in those positions: each query sees exactly its own sequence's
    earlier tokens, pads never reach a real token."""
    cu = cu_seqlens_of([7, 3, 10])
    n = cp_padded_length(cu, 2)
    s = context_shard(cu, 2, 1, n)
    full = block_causal_mask(s.cu_padded)[0, 0]
    mine = block_causal_mask(s.cu_padded, q_index=s.index, k_index=s.all_index())[0, 0]
    assert torch.equal(mine, full[s.index][:, s.all_index()])
    pad = torch.ones(n, dtype=torch.bool)
    pad[s.real_pos] = False
    visible = ~full  # True = attends
    assert not visible[~pad][:, pad].any()  # no real token attends to a pad


# ---------------------------------------------------------------- make test-cp: every layout
@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run_dist_script("cp_layouts.py", 4, tmp_path_factory.mktemp("cp_layouts"), timeout_s=1200)


@pytest.mark.slow
@pytest.mark.cp_heavy
@pytest.mark.timeout(1500)
def test_cp_layouts_equal_cp1(res):
    C = res["cp"]
    assert min(res["lens"]) < 2 * 2  # a sequence shorter than 2 x CP chunks is in the batch
    for ref, name in (("tp1", "cp2"), ("tp2", "cp2tp2"), ("pp2", "cp2pp2")):
        assert_cp_equal(C[ref], C[name], name)
    bad = C["cp2_rope_unadjusted"]
    # negative control: positions not following the balanced split (measured 0.069) fail the bound
    assert maxdiff(bad["logprobs"], C["tp1"]["logprobs"]) > 10 * lp_tol(C["tp1"]["logprobs"])


@pytest.mark.slow
@pytest.mark.cp_heavy
def test_critic_and_recompute_under_cp(res):
    c1, c2 = res["critic"]["critic_tp1"], res["critic"]["critic_cp2"]
    v_tol = fp32_tol(VOCAB, max(float(_t(c1["values"]).abs().max()), 1.0), ops=FWD)
    assert maxdiff(c2["values"], c1["values"]) <= v_tol
    assert c2["stats"]["loss"] == pytest.approx(c1["stats"]["loss"], rel=GRAD_REL_TOL)
    assert c2["stats"]["grad_norm"] == pytest.approx(c1["stats"]["grad_norm"], rel=GRAD_REL_TOL)
    assert maxdiff(c2["after"], c1["after"]) <= v_tol + maxdiff(c1["after"], c1["values"]) * adam_step_rel(
        GRAD_REL_TOL, c1["stats"]["grad_norm"], count_params(tie_word_embeddings=True), ADAM_EPS)
    r = res["recompute"]
    for k in ("logprobs", "after"):
        assert maxdiff(r["cp2tp2_selective"][k], r["tp2_selective"][k]) <= after_tol(
            r["tp2_selective"]["after"], r["tp2_selective"]["logprobs"], r["tp2_selective"]["stats"]), k
    assert r["cp2tp2_selective"]["stats"]["grad_norm"] == pytest.approx(r["tp2_selective"]["stats"]["grad_norm"],
                                                                        rel=GRAD_REL_TOL)


@pytest.mark.slow
@pytest.mark.cp_heavy
def test_cp_with_experts_and_routing_replay(res):
    M = res["moe"]
    moe_params = None  # count_params is the dense tiny Qwen2's; the MoE's step bound uses its own N below
    from tests.support.models import tiny_model

    m = tiny_model("qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   intermediate_size=96, tie_word_embeddings=False)
    moe_params = sum(p.numel() for p in m.parameters())
    assert_cp_equal(M["ep2"], M["cp2ep2"], "cp2ep2", num_params=moe_params)
    a, b = M["ep2_replay"], M["cp2ep2_replay"]
    # replayed routes split like the tokens: the same forced-route log-probs, and the routers'
    # own choices come back in token order (integers: exactly equal)
    assert maxdiff(b["replayed"], a["replayed"]) <= lp_tol(a["replayed"])
    assert maxdiff(b["plain"], a["plain"]) <= lp_tol(a["plain"])
    assert b["natural"] == a["natural"] and b["natural_under_replay"] == a["natural_under_replay"]
    assert maxdiff(a["replayed"], a["plain"]) > 100 * lp_tol(a["plain"])  # the forced routes do matter
    assert b["stats"]["loss"] == pytest.approx(a["stats"]["loss"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.cp_heavy
def test_checkpoint_saved_at_cp2_loads_at_tp1(res):
    c = res["checkpoint"]
    assert maxdiff(c["loaded_tp1"], c["saved_cp2"]) <= lp_tol(c["saved_cp2"])
    assert maxdiff(c["fresh_tp1"], c["saved_cp2"]) > 100 * lp_tol(c["saved_cp2"])  # the step is what was loaded
