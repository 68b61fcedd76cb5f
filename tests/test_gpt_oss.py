"""gpt-oss (models/gpt_oss.py) against transformers' GptOssForCausalLM, fp32 on CPU.

Default suite: the whole tiny model at TP1 through the registry (build_model / load_hf_weights /
export_hf_weights / forward_logits), three sequences packed in one row, two of them longer than
the sliding window, vs HF per sequence; the controls (sinks dropped, window off, SwiGLU unclamped);
plus sub-second checks (refusals, the sync plan's tensors, the memory model's count). Under the
families_serve marker (``make test-families-serve``): TP2 / PP2 / EP2 / CP2 and the conversion round
trip under torchrun (tests/dist/gpt_oss_layouts.py), the sync stream through SGLang's own loader,
gradients vs HF.
"""

from __future__ import annotations

import pytest
import torch

LAYER = pytest.mark.families_serve
WINDOW = 8
CFG = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
           rms_norm_eps=1e-5, max_position_embeddings=512, swiglu_limit=7.0,
           rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                truncate=False, original_max_position_embeddings=16))
LENS = [23, 5, 30]
"""Packed row: two sequences longer than the window (8), one shorter; YaRN's original context 16 < 30."""


def tiny(seed: int = 0):
    """A tiny random GptOssForCausalLM (4 layers: sliding, full, sliding, full; 4 experts top-2),
    fp32, eager attention (the sinks path), every weight moved off HF's init (zero biases, router 0)
    by N(0, 1) x 0.1 -- and the expert weights scaled up so the clamp at 7 binds on some tokens."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    m = GptOssForCausalLM(GptOssConfig(**CFG))
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
            if "sinks" in n:
                p.mul_(20)  # sinks O(1): the control "sinks dropped" must move the result
            if n.endswith("experts.gate_up_proj"):
                p.mul_(10)
    return m.float().eval()


def packed_reference(m, seed: int = 3) -> dict:
    from tests.support.models import packed_hf_logits

    return packed_hf_logits(m, LENS, 300, seed)


def logprob_tol(ref_logits: torch.Tensor) -> float:
    """fp32 log-probs of the same weights two ways (megatron packed, any layout, vs HF per
    sequence): 4 layers' reductions of up to K = 64 terms (hidden 64, heads 4 x 16 + the sink,
    experts 32 x 2) relative to the largest |logit| (tests/support/numerics.py), x 2 for the
    log-softmax (|d log p| <= 2 max |d logit|)."""
    from tests.support.numerics import fp32_tol, transformer_reductions

    return 2 * fp32_tol(64, float(ref_logits.abs().max()), ops=transformer_reductions(4) - 1)


def clamp_binds(m, ids) -> float:
    """Fraction of expert gate/up pre-activations HF clamps on ``ids`` (the clamp must matter)."""
    hits, total = [], []

    def hook(mod, args, out):
        x = args[0]
        for e in range(mod.num_experts):
            z = x @ mod.gate_up_proj[e] + mod.gate_up_proj_bias[e]
            hits.append(int((z[..., ::2] > mod.limit).sum() + (z[..., 1::2].abs() > mod.limit).sum()))
            total.append(z.numel())

    hs = [layer.mlp.experts.register_forward_hook(hook) for layer in m.model.layers]
    with torch.no_grad():
        m(input_ids=ids[None])
    for h in hs:
        h.remove()
    return sum(hits) / sum(total)


@pytest.fixture(scope="module", autouse=True)
def _world_released():
    """The megatron world of one set up here is torn down after the module (test_workflow expects
    no default process group in the pytest process)."""
    from tests.support.dist import megatron_world_released

    yield from megatron_world_released()


def test_adapter_refuses_what_it_cannot_run():
    from areal_mega.models import get_adapter

    base = {**CFG, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}
    a = get_adapter(base).arch
    assert a.sliding_window == WINDOW and a.sliding_window_layers == (0, 2) and a.attention_sinks
    assert a.yarn is not None and not a.yarn.truncate and a.swiglu_limit == 7.0 and a.linear_bias
    for bad, msg in ((dict(swiglu_alpha=1.5), "^swiglu_alpha: 1.5"),
                     (dict(quantization_config={"quant_method": "mxfp4"}), "^quantization_config: 'mxfp4'"),
                     (dict(layer_types=["sliding_attention"] * 3), "^layer_types:"),
                     (dict(rope_parameters={**CFG["rope_parameters"], "attention_factor": 2.0}),
                      "^rope_parameters.attention_factor")):
        with pytest.raises(ValueError, match=msg):
            get_adapter({**base, **bad})


def test_tiny_model_logprobs_match_hf_packed(tmp_path):
    """TP1 through the registry: packed log-probs = HF per sequence within the fp32 bound; the
    parameter count equals transformers'; export_hf (weight sync's path) stacked back = the HF
    file bit for bit; controls far off: sinks dropped, window off, clamp off."""

    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, export_hf_weights, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel
    from tests.support.models import packed_logprobs

    hf = tiny()
    hf.save_pretrained(tmp_path)
    ref = packed_reference(hf)
    ids, cu = ref["input_ids"], ref["cu_seqlens"]
    assert clamp_binds(hf, ids[cu[2]:]) > 0.01  # the clamp is exercised
    from tests.support.dist import megatron_world_of_one

    groups = megatron_world_of_one()
    try:
        with pytest.raises(ValueError, match="^actor.model.layer_spec: te is not supported for gpt_oss"):
            build_model(tmp_path, groups, MegatronModelConfig(layer_spec="te"))
        model = build_model(tmp_path, groups, MegatronModelConfig())
        load_hf_weights(model, tmp_path)
        (mc,) = model.chunks
        pad = 2 * (model.padded_vocab_size - 300) * 64  # zero vocab-padding rows of embedding + output layer
        assert sum(p.numel() for p in mc.parameters()) - pad == sum(p.numel() for p in hf.parameters())
        disk = HFCheckpointReader(tmp_path)
        out = dict(model.adapter.stack_hf(export_hf_weights(model)))
        assert sorted(out) == sorted(disk.names()) and all(torch.equal(out[n], disk.read(n)) for n in out)
        hf_lp = packed_logprobs(ref["logits"], ids, cu)
        tol = logprob_tol(ref["logits"])

        def err():
            return (packed_logprobs(forward_logits(model, ids, cu), ids, cu) - hf_lp).abs().max().item()

        e = err()
        print(f"gpt_oss TP1 packed log-probs: max|mc-hf|={e:.2e} bound={tol:.2e}")
        assert e <= tol
        controls = {}
        attn = [layer.self_attention.core_attention for layer in mc.decoder.layers]
        sinks = [a.softmax_offset for a in attn]
        for a in attn:
            a.softmax_offset = None
        controls["sinks dropped"] = err()
        for a, s in zip(attn, sinks):
            a.softmax_offset = s
        windows = [a.window_left for a in attn]
        assert windows == [WINDOW - 1, None, WINDOW - 1, None]
        for a in attn:
            a.window_left = None
        controls["window off"] = err()
        for a, w in zip(attn, windows):
            a.window_left = w
        mc.config.activation_func_clamp_value = None
        controls["clamp off"] = err()
        mc.config.activation_func_clamp_value = 7.0
        print("gpt_oss controls:", {k: f"{v:.2e}" for k, v in controls.items()})
        assert all(v > 100 * tol for v in controls.values()), controls
        assert err() == e
    finally:
        destroy_model_parallel(groups)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """tests/dist/gpt_oss_layouts.py (2 gloo ranks) over the tiny model."""
    from tests.support.dist import run_layouts_script

    work = tmp_path_factory.mktemp("gpt_oss_layouts")
    m = tiny()
    m.save_pretrained(work / "model")
    ref = packed_reference(m)
    torch.save(ref, work / "ref.pt")
    return work, ref, run_layouts_script("tests/dist/gpt_oss_layouts.py", work, timeout_s=1200)


@LAYER
def test_layouts_logprobs_match_hf(layouts):
    """TP1 (x DP2), TP2 (sequence parallel), PP2, EP2, CP2 (the window on global indices) vs HF per
    sequence; the controls far off."""
    from tests.dist.gpt_oss_layouts import CP_LAYOUT, LAYOUTS, NEGATIVE, key_of
    from tests.support.models import packed_logprobs

    _, r, res = layouts
    hf_lp = packed_logprobs(r["logits"], r["input_ids"], r["cu_seqlens"])
    tol = logprob_tol(r["logits"])
    assert set(res["logits"]) == {key_of(*lay) for lay in LAYOUTS} | {key_of(*CP_LAYOUT[:3]) + "cp2"}
    table = {}
    for key, lg in res["logits"].items():
        table[key] = (packed_logprobs(lg, r["input_ids"], r["cu_seqlens"]) - hf_lp).abs().max().item()
    print(f"gpt_oss max |log-prob megatron - HF| (bound {tol:.2e}):", {k: f"{v:.2e}" for k, v in table.items()})
    assert all(v <= tol for v in table.values()), (table, tol)
    assert set(res["negative"]) == set(NEGATIVE)
    neg = {c: (packed_logprobs(lg, r["input_ids"], r["cu_seqlens"]) - hf_lp).abs().max().item()
           for c, lg in res["negative"].items()}
    print("gpt_oss controls:", {k: f"{v:.2e}" for k, v in neg.items()})
    assert all(v > 100 * tol for v in neg.values()), neg


@LAYER
def test_layouts_export_bit_exact_each_tensor_once(layouts):
    """export_hf (live sync / conversion) at every layout: every plan tensor once, bit-identical
    to the HF file's (expert slice of the stacked) tensor."""
    from areal_mega.models import get_adapter

    work, _, res = layouts
    names = get_adapter(work / "model").hf_names()
    for key, rows in res["export"].items():
        seen = []
        for pp, sender, same, diff, got in [row for row in rows if row is not None]:
            assert diff == 0, f"{key} stage {pp}: {diff} tensors differ"
            if sender:
                assert same == len(got)
                seen += got
        assert sorted(seen) == sorted(names), key


@LAYER
def test_conversion_tools_roundtrip_bit_exact(layouts):
    """HF -> megatron (EP2) -> HF (TP2) with tools/convert_*: the stacked checkpoint's every
    tensor bit-exact, the same names, model_type kept."""
    import json

    from areal_mega.megatron.model import HFCheckpointReader

    work, _, _ = layouts
    a, b = HFCheckpointReader(work / "model"), HFCheckpointReader(work / "model_hf")
    assert sorted(a.names()) == sorted(b.names())
    bad = [n for n in a.names() if not torch.equal(a.read(n), b.read(n))]
    assert not bad, f"not bit-exact: {bad[:5]}"
    assert json.loads((work / "model_hf" / "config.json").read_text())["model_type"] == "gpt_oss"


def test_memory_model_counts_transformers_params():
    """The memory model's parameter count (sinks, o_proj / router / expert biases included) =
    transformers' GptOssForCausalLM's, exactly."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from areal_mega.models import get_adapter
    from areal_mega.simulator.memory import total_params

    m = GptOssForCausalLM(GptOssConfig(**CFG))
    assert total_params(get_adapter({**CFG, "model_type": "gpt_oss"}).arch) == sum(p.numel() for p in m.parameters())


@LAYER
def test_sync_stream_loads_into_sglangs_own_model(layouts, tmp_path):
    """SGLang cannot serve gpt-oss on CPU (its torch_native backend takes no sinks: checked here on
    its signatures), so the sync is checked against SGLang's own loader: the stream the learner's
    export sends at TP2, stacked (stack_hf), goes through SGLang 0.5.23's GptOssForCausalLM
    ``load_weights`` in-process (tests/support/sglang_load.py) and must leave every
    parameter bit-identical to what the same loader makes of the HF checkpoint, none unwritten.
    Controls: a stream missing one stacked tensor leaves its parameter NaN; one expert's gate_up
    columns reversed make the fused w13 differ."""
    import json

    from tests.support.launch import SGLANG_PYTHON, child_env, run_checked

    if not SGLANG_PYTHON:
        pytest.skip("AREAL_MEGA_SGLANG_PYTHON not set (run through make test-families-serve)")
    work, _, _ = layouts
    stream = torch.load(work / "sync_tp2.pt")
    drop, flip = "model.layers.1.mlp.experts.down_proj_bias", "model.layers.0.mlp.experts.gate_up_proj"
    assert {n for n, _ in stream} >= {drop, flip}  # stacked names, as the checkpoint's
    torch.save([(n, t) for n, t in stream if n != drop], tmp_path / "dropped.pt")
    torch.save([(n, torch.cat([t[:2], t[2:3].flip(-1), t[3:]]) if n == flip else t) for n, t in stream],
               tmp_path / "flipped.pt")
    streams = {"checkpoint": str(work / "model" / "model.safetensors"), "sync": str(work / "sync_tp2.pt"),
               "dropped": str(tmp_path / "dropped.pt"), "flipped": str(tmp_path / "flipped.pt")}
    config = str(work / "model" / "config.json")
    (tmp_path / "jobs.json").write_text(json.dumps([{"label": k, "config": config, "stream": v} for k, v in streams.items()]))
    run_checked([SGLANG_PYTHON, "tests/support/sglang_load.py", "--jobs", str(tmp_path / "jobs.json"),
                 "--out", str(tmp_path / "out.pt"), "--probe-sinks"],
                timeout_s=600, env=child_env(PYTHONWARNINGS="ignore", MASTER_PORT=str(_free_port())), merge_stderr=True)
    res = torch.load(tmp_path / "out.pt")
    assert res["torch_native_takes_sinks"] == [False, False]  # the serving blocker (docs/engine.md "gpt-oss")
    want, got = res["checkpoint"], res["sync"]
    assert set(got) == set(want) and not any(t.isnan().any() for t in want.values())
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, bad[:5]
    nan = [n for n, t in res["dropped"].items() if t.isnan().any()]
    assert nan == ["model.layers.1.mlp.experts.w2_weight_bias"], nan
    w13 = "model.layers.0.mlp.experts.w13_weight"
    assert not torch.equal(res["flipped"][w13], want[w13])


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # the loader's world of one (other sessions' may hold its default port)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sync_plan_sends_the_checkpoints_tensors(tmp_path):
    """The weight-sync plan (weight_sync/sync.py: checkpoint_specs, the stream through stack_hf)
    names exactly the checkpoint's tensors with its shapes -- the stacked experts SGLang's gpt-oss
    loader takes -- at PP2 x EP2; a stage's stream stacked in plan order matches the plan's order
    (senders) and yields None where a rank holds no experts (the other ranks); the checkpoint read
    through checkpoint_view and stacked back is bit-identical."""
    from areal_mega.megatron.model import HFCheckpointReader
    from areal_mega.models import get_adapter
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from areal_mega.weight_sync.planner import plan_weight_sync

    tiny().save_pretrained(tmp_path)
    adapter, disk = get_adapter(tmp_path), HFCheckpointReader(tmp_path)
    lay = ParallelLayout.build(ParallelConfig(pipeline_parallel=2, expert_parallel=2, expert_tensor_parallel=1), 4)
    stages = adapter.plan(lay)
    specs = [adapter.checkpoint_specs(s.tensors) for s in stages]
    plan = plan_weight_sync(specs, lay, 1 << 16)
    assert {t.name: t.shape for t in plan.tensors} == {n: disk.shape(n) for n in disk.names()}
    view = adapter.checkpoint_view(disk)
    for s, sp in zip(stages, specs):
        got = list(adapter.stack_hf((t.name, view.read(t.name)) for t in s.tensors))
        assert [n for n, _ in got] == [t.name for t in sp]
        assert all(torch.equal(t, disk.read(n)) for n, t in got)
        none = list(adapter.stack_hf((t.name, None if ".experts." in t.name else view.read(t.name)) for t in s.tensors))
        assert [n for n, _ in none] == [t.name for t in sp] and sum(t is None for _, t in none) == 4 * 2


@LAYER
def test_gradients_of_sinks_and_biases_match_hf(tmp_path):
    """What RL trains: the gradient of the packed log-prob sum (TP1, megatron's autograd through
    CoreAttention's sinks, the window and the biased experts) equals HF's (per-sequence sums) for
    every layer's sinks, router bias and expert gate_up / down biases, within the fp32 bound of
    a forward + backward over K = tokens x 64 terms relative to the largest gradient entry.
    Control: the same gradient with the window off is far off."""

    from areal_mega.megatron.model import MegatronModelConfig, build_model, load_hf_weights
    from areal_mega.megatron.parallel_state import destroy_model_parallel
    from tests.dist.qwen3_5_layouts import packed_logprob_sum
    from tests.support.numerics import fp32_tol, transformer_reductions

    hf = tiny()
    hf.save_pretrained(tmp_path)
    ref = packed_reference(hf)
    ids, cu = ref["input_ids"], ref["cu_seqlens"]
    for i in range(len(LENS)):
        s, e = int(cu[i]), int(cu[i + 1])
        lp = torch.log_softmax(hf(input_ids=ids[s:e][None]).logits[0].float(), -1)
        lp[:-1].gather(-1, ids[s + 1: e, None]).sum().backward()
    want = {}
    for i, layer in enumerate(hf.model.layers):
        ex = layer.mlp.experts
        want[f"{i}.sinks"] = layer.self_attn.sinks.grad
        want[f"{i}.router_bias"] = layer.mlp.router.bias.grad
        want[f"{i}.fc1_bias"] = torch.cat([ex.gate_up_proj_bias.grad[:, 0::2], ex.gate_up_proj_bias.grad[:, 1::2]], 1)
        want[f"{i}.fc2_bias"] = ex.down_proj_bias.grad
    from tests.support.dist import megatron_world_of_one

    groups = megatron_world_of_one()
    try:
        model = build_model(tmp_path, groups, MegatronModelConfig())
        load_hf_weights(model, tmp_path)
        (mc,) = model.chunks

        def grads() -> dict[str, torch.Tensor]:
            for p in mc.parameters():
                p.grad = None
            packed_logprob_sum(model, ids, cu).backward()
            out = {}
            for i, layer in enumerate(mc.decoder.layers):
                experts = layer.mlp.experts.local_experts
                out[f"{i}.sinks"] = layer.self_attention.core_attention.softmax_offset.grad
                out[f"{i}.router_bias"] = layer.mlp.router.bias.grad
                out[f"{i}.fc1_bias"] = torch.stack([x.linear_fc1.bias.grad for x in experts])
                out[f"{i}.fc2_bias"] = torch.stack([x.linear_fc2.bias.grad for x in experts])
            return out

        def diff(got):
            return max((got[k] - want[k]).abs().max().item() for k in want)

        scale = max(g.abs().max().item() for g in want.values())
        tol = fp32_tol(sum(LENS) * 64, scale, ops=transformer_reductions(4, backward=True))
        d = diff(grads())
        attn = [layer.self_attention.core_attention for layer in mc.decoder.layers]
        for a in attn:
            a.window_left = None
        bad = diff(grads())
        print(f"gpt_oss TP1 grads (sinks, router/expert biases): max|mc-hf|={d:.2e} bound={tol:.2e} "
              f"(max|grad| {scale:.2e}); window off: {bad:.2e}")
        assert d <= tol and bad > 100 * tol
    finally:
        destroy_model_parallel(groups)
