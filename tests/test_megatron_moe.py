"""Qwen3 (QK-norm, free head_dim) and Qwen3-MoE (top-2 of 8, expert parallelism) in megatron-core
vs HF transformers on CPU (gloo). One 4-rank torchrun launch (tests/dist/moe_layouts.py):

* logits vs HF at every layout: dense TP1 / TP2 / PP2; MoE TP1, EP2, TP2 (ETP2), EP2 x TP2 with
  ETP1 and ETP2, PP2, EP2 x PP2, EP4; per-token log-probs within 1e-4 of HF (fp32);
* ModelAdapter.export_hf (the weight-sync path) bit-exact and complete, each expert once;
* megatron's expert groups equal ParallelLayout's expert coordinates;
* negative controls: q/k norms swapped, experts rotated by one -- both far outside tolerance;
* one Adam step through megatron's DDP + optimizer: same loss before and after at every MoE
  layout;
* tools: HF -> megatron (EP2 x PP2) -> HF (EP2 x TP2) bit-exact;
* routing replay (learner side) at EP2: replaying recorded routes is exact; forcing another
  model's routes changes the computation.

Upstream behaviour pinned: transformers 5.19's Qwen3ForCausalLM / Qwen3MoeForCausalLM (eager,
fp32): Qwen3MoeTopKRouter = softmax over all experts, top-k, renormalised when norm_topk_prob;
experts saved per expert (``mlp.experts.{i}.{gate,up,down}_proj.weight``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launch import child_env, run_checked, torchrun_cmd
from tests.support.models import packed_logprobs as logprobs, tiny_model
from tests.support.numerics import fp32_tol, transformer_reductions

pytestmark = pytest.mark.slow  # every test reads the torchrun launch's results
LENS = [7, 13, 4, 10]
VOCAB = 300
# hidden 64, 4 heads of head_dim 32 (!= 64 / 4: megatron kv_channels), 2 KV heads, 2 layers.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_hidden_layers=2, max_position_embeddings=256, noise=0.1)
MOE = dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           intermediate_size=96, tie_word_embeddings=False)
MODELS = {
    "qwen3_tied": dict(family="qwen3", intermediate_size=96, tie_word_embeddings=True, rope_theta=1e6, noise_seed=1),
    "qwen3_moe": dict(**MOE, norm_topk_prob=True, noise_seed=2),
    "qwen3_moe_nonorm": dict(**MOE, norm_topk_prob=False, noise_seed=3),
}
LP_TOL = 1e-4  # the bar for fp32 log-probs; the derived logits bound below is tighter


def logits_tol(ref: torch.Tensor) -> float:
    """fp32 logits of the same weights computed two ways (megatron packed, any layout, vs HF
    per sequence): every reduction of the forward but the log-softmax may run in another order,
    of up to K = 128 terms (attention output 4 x 32; MLP 96, experts 32), relative to the
    largest |logit| (tests/support/numerics.py). Routing is discrete: a token whose top-2 tie
    flipped would move by O(1) and fail, which is the point."""
    return fp32_tol(128, float(ref.abs().max()), ops=transformer_reductions(2) - 1)


def _make_models(work: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (sum(LENS),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)))
    targets = torch.full_like(ids, -100)  # next token inside each sequence, -100 across boundaries
    for i in range(len(LENS)):
        targets[int(cu[i]) : int(cu[i + 1]) - 1] = ids[int(cu[i]) + 1 : int(cu[i + 1])]
    ref = {}
    for name, kw in MODELS.items():
        m = tiny_model(**kw, **COMMON)
        m.config._attn_implementation = "eager"
        m.save_pretrained(work / name)
        (work / name / "tokenizer_config.json").write_text(json.dumps({"marker": name}))
        with torch.no_grad():
            logits = torch.cat([m(ids[cu[i] : cu[i + 1]].view(1, -1)).logits[0] for i in range(len(LENS))])
        ref[name] = {"input_ids": ids, "cu_seqlens": cu, "targets": targets, "logits": logits.float()}
        if name == "qwen3_moe":
            ref[name].update(_forced_routes_reference(m, ids, cu, kw["num_experts"], kw["num_experts_per_tok"]))
    torch.save(ref, work / "ref.pt")
    return ref


def _forced_routes_reference(m, ids, cu, num_experts: int, k: int) -> dict:
    """HF references for routing replay: random top-k expert sets per (token, layer) as the
    "server's routes" (-1 on each sequence's last token: never fed to a server), the HF logits
    with every router forced to them (HF's own gate: softmax over all experts, the forced
    experts' probabilities renormalised), and HF's natural top-k routes (the last, unforced pass
    writes them)."""
    g = torch.Generator().manual_seed(5)
    layers = m.config.num_hidden_layers
    forced = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(ids.numel() * layers)])
    forced = forced.view(ids.numel(), layers * k).to(torch.int16)
    forced[cu[1:] - 1] = -1
    natural = torch.zeros(ids.numel(), layers, k, dtype=torch.int64)
    gates = [layer.mlp.gate for layer in m.model.layers]
    state = {}

    def forced_gate(gate, li):
        def fwd(hidden):
            h = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(h, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            rows = slice(state["s"], state["s"] + h.shape[0])
            natural[rows, li] = torch.topk(probs, k, dim=-1).indices
            idx = forced[rows].view(-1, layers, k)[:, li].long()
            if state["force"]:
                idx = torch.where(idx < 0, natural[rows, li], idx)  # the last token: its output is unused
                val = probs.gather(1, idx)
                if gate.norm_topk_prob:
                    val = val / val.sum(-1, keepdim=True)
                return logits, val.to(logits.dtype), idx
            return gate._orig(hidden)
        return fwd

    out = {}
    for force in (True, False):
        state["force"] = force
        for li, gate in enumerate(gates):
            gate._orig = gate.forward
            gate.forward = forced_gate(gate, li)
        lg = []
        with torch.no_grad():
            for i in range(len(cu) - 1):
                state["s"] = int(cu[i])
                lg.append(m(ids[cu[i]: cu[i + 1]].view(1, -1)).logits[0].float())
        for gate in gates:
            gate.forward = gate._orig
        out["forced_logits" if force else "natural_logits"] = torch.cat(lg)
    return {"forced_routes": forced, "natural_routes": natural.view(ids.numel(), layers * k),
            "forced_logits": out["forced_logits"]}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe_layouts")
    ref = _make_models(work)
    run_checked(torchrun_cmd(4, "tests/dist/moe_layouts.py", "--work-dir", work, "--out", work / "results.pt"),
                timeout_s=600, env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    return work, ref, torch.load(work / "results.pt")



def test_logprobs_match_hf_every_layout(moe):
    from tests.dist.moe_layouts import LAYOUTS, key_of

    _, ref, res = moe
    report = {}
    for name, r in ref.items():
        assert set(res["logits"][name]) == {key_of(*lay) for lay in LAYOUTS[name]}
        hf_lp = logprobs(r["logits"], r["input_ids"], r["cu_seqlens"])
        for key, lg in res["logits"][name].items():
            d = (lg - r["logits"]).abs().max().item()
            assert d <= logits_tol(r["logits"]), f"{name} {key}: max |megatron - HF| logits = {d}"
            dlp = (logprobs(lg, r["input_ids"], r["cu_seqlens"]) - hf_lp).abs().max().item()
            assert dlp <= LP_TOL, f"{name} {key}: max |log-prob diff| = {dlp}"
            report[f"{name}/{key}"] = dlp
    print("max |log-prob megatron - HF|:", json.dumps(report, indent=1))


def test_export_bit_exact_each_tensor_once(moe):
    from areal_mega.models import get_adapter

    work, ref, res = moe
    for name in ref:
        all_names = get_adapter(work / name).hf_names()
        assert len(all_names) == len(set(all_names))
        for key, rows in res["export"][name].items():
            rows = [r for r in rows if r is not None]
            seen = []
            for pp, tp, dp, ep, same, diff, none, names in rows:
                assert diff == 0, f"{name} {key} stage {pp}: {diff} tensors differ"
                if tp == 0 and dp == 0 and ep == 0:  # the stage's sender holds every tensor
                    assert none == 0 and same == len(names), (name, key, pp, none)
                    seen += names
            assert sorted(seen) == sorted(all_names), (name, key)
            if name == "qwen3_moe":
                assert sum(".mlp.experts." in n for n in seen) == 2 * 8 * 3  # layers x experts x 3


def test_expert_groups_match_layout(moe):
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from tests.dist.moe_layouts import MOE, key_of

    _, _, res = moe
    for tp, pp, ep, etp in MOE:
        lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                                  expert_tensor_parallel=etp), 4)
        for rank, coords, ep_ranks, etp_ranks, edp_ranks in res["groups"][key_of(tp, pp, ep, etp)]:
            assert coords == tuple(lay.coords(rank).__dict__.values())
            assert len(ep_ranks) == lay.ep and len(etp_ranks) == lay.etp and len(edp_ranks) == lay.edp


def test_negative_controls_fail(moe):
    _, ref, res = moe
    assert set(res["negative"]) == {"qwen3_tied", "qwen3_moe"}
    for name, (adapter, lg) in res["negative"].items():
        d = (lg - ref[name]["logits"]).abs().max().item()
        assert d > 100 * logits_tol(ref[name]["logits"]), f"{adapter}: a broken mapping went unnoticed ({d})"


def test_one_step_same_loss_every_layout(moe):
    _, ref, res = moe
    steps = res["step"]
    base_loss, base_norm, base_after = steps["tp1pp1ep1"]
    n_tok = sum(LENS) - len(LENS)
    assert base_after < base_loss  # the step learned something (lr 1e-2, same batch)
    # sum of n_tok NLLs, each within the logits bound of the TP1 value; after one Adam step the
    # parameters differ by rounding of the grads (Adam normalises them: |update| <= lr)
    tol = n_tok * 2 * logits_tol(ref["qwen3_moe"]["logits"])
    for key, (loss, norm, after) in steps.items():
        assert abs(loss - base_loss) <= tol, (key, loss, base_loss)
        assert abs(norm - base_norm) <= 1e-4 * base_norm, (key, norm, base_norm)
        assert abs(after - base_after) <= 10 * tol, (key, after, base_after)
    print("one step:", json.dumps(steps, indent=1))


def test_engine_trains_moe_same_at_every_layout(moe):
    """The product's MegatronTrainEngine (packing, micro-batches of 64 tokens, DDP, Adam) on
    Qwen3-MoE: the same loss and post-step log-probs at TP1, EP2, EP2 x TP2 (ETP1), EP2 x PP2.
    Bound: a sum of ~230 fp32 log-probs, each within the logits bound of another layout."""
    _, ref, res = moe
    eng = res["engine"]
    base = eng["tp1pp1ep1"]
    tol = 230 * 2 * logits_tol(ref["qwen3_moe"]["logits"])
    assert base[2] != base[1]  # the step changed the model
    for key, (loss, lp0, lp1) in eng.items():
        assert abs(loss - base[0]) <= 1e-5 * max(1.0, abs(base[0])), (key, loss, base[0])
        assert abs(lp0 - base[1]) <= tol and abs(lp1 - base[2]) <= 10 * tol, (key, lp0, lp1, base)
    print("engine:", json.dumps(eng))


def test_conversion_tools_roundtrip_bit_exact(moe):
    from safetensors.torch import load_file

    work, _, _ = moe
    a = load_file(work / "qwen3_moe" / "model.safetensors")
    b = {}
    for f in sorted((work / "tool_hf").glob("*.safetensors")):
        b.update(load_file(f))
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"not bit-exact: {bad[:5]}"
    cfg = json.loads((work / "tool_hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["norm_topk_prob"] is True


def test_routing_replay_learner_side(moe):
    """megatron's RouterReplay through areal_mega/megatron/routing.py at EP2: a model replaying
    its own recorded routes reproduces its logits bit for bit; a model whose routers were
    perturbed routes some tokens elsewhere, and replaying the original routes in it changes its
    logits (the forced experts are used)."""
    _, ref, res = moe
    r = res["replay"]
    assert r["layers"] == 2 and r["tokens"] == [sum(LENS)] * 2  # TP1: the whole packed row per layer
    assert r["a_replay_equal"] is True
    assert r["disagree_b_vs_a"] > 0.05, r  # the perturbation moved routes (else the test is void)
    tol = logits_tol(ref["qwen3_moe"]["logits"])
    assert r["b_replay_vs_plain"] > 100 * tol, r  # replay changed the experts B used
    # B stands in for a server whose routing drifted: on A's routes it agrees with A better
    # than on its own (measured 0.32 vs 1.13 max |logit diff|): what replay is for
    assert r["b_replay_vs_a"] < r["b_plain_vs_a"], r
    print("routing replay:", json.dumps(r))


def test_engine_replays_batch_routes_at_every_layout(moe):
    """The engine with moe_routing_replay=rollout on a packed batch (4 sequences, micro-batches of
    16 tokens, DP ranks) at TP1 x DP4, EP2, EP2 x PP2 and TP2 (SP): per token, its log-probs
    with the batch's routed_experts equal HF's with every router forced to the same experts
    (so each token used exactly those experts, in the proximal AND the training forward), and
    without routes they do not (negative control); the natural routes the engine reports equal
    HF's own top-k."""
    from tests.dist.moe_layouts import REPLAY_KEYS

    _, ref, res = moe
    r = ref["qwen3_moe"]
    ids, cu = r["input_ids"], r["cu_seqlens"]
    forced = _aligned(logprobs(r["forced_logits"], ids, cu), cu)
    plain_ref = _aligned(logprobs(r["logits"], ids, cu), cu)
    moved = (forced - plain_ref).abs()
    assert moved.max() > 0.1, "the forced routes changed nothing: the check would be void"
    for key in REPLAY_KEYS:
        got = res["engine_replay"][key]
        rep, plain = torch.tensor(got["replayed"], dtype=torch.float64), torch.tensor(got["plain"], dtype=torch.float64)
        assert (rep - forced).abs().max() < LP_TOL, (key, float((rep - forced).abs().max()))
        assert (plain - plain_ref).abs().max() < LP_TOL, key
        assert (plain - forced).abs().max() > 100 * LP_TOL, key  # negative control: routes matter
        # training forward: mean replayed log-prob over the loss tokens, as the engine's loss saw it
        mask = torch.ones_like(ids)
        mask[cu[1:] - 1] = 0
        want = float((rep * mask).sum() / mask.sum())
        assert abs(got["train_lp_mean"] / got["train_n"] - want) < LP_TOL, key
        nat = torch.tensor(got["natural"])
        assert torch.equal(nat.view(-1, 2, 2).sort(-1).values,
                           r["natural_routes"].view(-1, 2, 2).sort(-1).values), key
        print(f"replay {key}: max |replayed - HF forced| {float((rep - forced).abs().max()):.2e}, "
              f"plain vs forced {float((plain - forced).abs().max()):.3f}")


def _aligned(lp: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """logprobs() drops each sequence's last position; the engine's outputs keep it (0)."""
    out, j = [], 0
    for i in range(len(cu) - 1):
        n = int(cu[i + 1] - cu[i])
        out.append(torch.cat([lp[j:j + n - 1], lp.new_zeros(1)]))
        j += n - 1
    return torch.cat(out)

