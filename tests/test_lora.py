"""LoRA on the megatron learner vs HF + PEFT (CPU, fp32; docs/lora.md).

One 2-rank torchrun launch (tests/dist/lora_layouts.py) at TP1, TP2, TP2 + sequence
parallelism and PP2 (logits and merged weights), against PEFT's LoraModel on the same tiny Qwen2 (GQA 4/2 heads, qkv bias) with the
same non-zero random adapters on all seven projections: logits, adapter gradients, and the merged
weights the weight sync's fallback sends vs PEFT's merge_and_unload(); negative control: the
model before the adapters are loaded. The config checks are a cheap default-suite test.
"""

from __future__ import annotations

import pytest
import torch

from areal_mega.megatron.lora import TARGETS, LoraConfig
from tests.support.dist import run_layouts_script
from tests.support.launch import child_env, run_checked, torchrun_cmd
from tests.support.numerics import fp32_tol, transformer_reductions

LENS = [7, 13, 4, 10]  # packed; 34 tokens (a multiple of TP 2 for sequence parallelism)
LORA = dict(rank=4, alpha=8.0, dropout=0.0, target_modules=list(TARGETS))
# Every weighted matmul of a layer gains two adapter reductions (A x over <= 128 terms, B h over r)
OPS = transformer_reductions(4) + 2 * 4 * 4
K = 128  # the longest reduction: the MLP (intermediate 128)


def test_lora_config_checks():
    LoraConfig().validate()  # rank 0 = off
    LoraConfig(**LORA).validate()
    for bad, msg in [(dict(rank=-1), "lora.rank"), (dict(rank=4, alpha=0), "lora.alpha"),
                     (dict(rank=4, dropout=1.0), "lora.dropout"),
                     (dict(rank=4, target_modules=["qkv_proj"]), "lora.target_modules")]:
        with pytest.raises(ValueError, match=msg):
            LoraConfig(**bad).validate()
    assert LoraConfig(rank=4, alpha=8).scaling == 2.0


def _peft_reference(work):
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model, get_peft_model_state_dict

    from areal_mega.demo.models import tiny_model

    m = tiny_model("qwen2", vocab_size=300, noise=0.1, noise_seed=3)
    m.config._attn_implementation = "eager"
    m.save_pretrained(work / "hf")
    torch.manual_seed(1)
    pm = get_peft_model(m, PeftConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                      target_modules=LORA["target_modules"], init_lora_weights=False))
    adapters = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pm).items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (sum(LENS),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)))
    R = torch.randn(sum(LENS), 300, generator=g)
    logits = torch.cat([pm(ids[cu[i]: cu[i + 1]].view(1, -1)).logits[0] for i in range(len(LENS))])
    (logits * R).sum().backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in pm.named_parameters() if "lora_" in n}
    merged = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}
    ref = dict(input_ids=ids, cu_seqlens=cu, R=R, lora=LORA, adapters=adapters)
    torch.save(ref, work / "ref.pt")
    return dict(logits=logits.detach(), grads=grads, merged=merged, adapters=adapters, input_ids=ids, cu_seqlens=cu)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora")
    ref = _peft_reference(work)
    res = run_layouts_script("tests/dist/lora_layouts.py", work, timeout_s=400)
    res["work"] = str(work)
    return ref, res


@pytest.mark.slow
def test_lora_logits_equal_peft_every_layout(layouts):
    ref, res = layouts
    tol = fp32_tol(K, float(ref["logits"].abs().max()), ops=OPS)
    assert set(res["logits"]) == {"tp1", "tp2", "tp2sp", "pp2"}
    for key, lg in res["logits"].items():
        d = (lg - ref["logits"]).abs().max().item()
        assert d <= tol, f"{key}: max |LoRA megatron - PEFT| = {d} > {tol}"
        # negative control: the same model with the adapters not applied (B = 0)
        off = (res["base"][key] - ref["logits"]).abs().max().item()
        assert off > 100 * tol, f"{key}: adapters barely matter (|base - PEFT| = {off})"
        print(f"lora logits {key}: max|LoRA-PEFT| {d:.3g} bound {tol:.3g} control {off:.3g}")


@pytest.mark.slow
def test_lora_grads_equal_peft_every_layout(layouts):
    ref, res = layouts
    for key, grads in res["grads"].items():
        assert set(grads) == set(ref["grads"]), key
        for n, g in grads.items():
            r = ref["grads"][n]
            # the backward runs the forward chain again (ops x 2), terms up to max |grad|
            tol = fp32_tol(K * sum(LENS), float(r.abs().max()), ops=2 * OPS)
            d = (g - r).abs().max().item()
            assert d <= tol, f"{key} {n}: max |grad - PEFT grad| = {d} > {tol}"
            assert r.abs().max() > 0


@pytest.mark.slow
def test_lora_merged_sync_weights_equal_peft_merge(layouts):
    ref, res = layouts
    for key, merged in res["merged"].items():
        assert set(merged) == set(ref["merged"]), key
        adapted = 0
        for n, t in merged.items():
            r = ref["merged"][n]
            # W + s * B A: one reduction over r terms of size |s B A| <= max |W| + |delta|
            d = (t - r).abs().max().item()
            assert d <= fp32_tol(LORA["rank"], float(r.abs().max()), ops=2), f"{key} {n}: {d}"
            adapted += any(n.replace(".weight", "") + ".lora_A" in k for k in ref["adapters"])
        assert adapted == 4 * 7, key  # every projection of every layer merged


@pytest.mark.slow
def test_lora_engine_optimizes_adapters_only(layouts):
    _, res = layouts
    in_opt, adapters, trainable = res["engine"]
    # TP2 rank 0's local adapters: 4 layers x rank 4 x (q,k,v,o,gate,up,down); base frozen
    assert adapters > 0 and in_opt == adapters == trainable, res["engine"]


@pytest.mark.slow
def test_lora_checkpoint_exports_peft_dir_and_merged_hf(layouts):
    """The engine's TP2 LoRA checkpoint, exported by the conversion tool's path: the PEFT adapter
    directory (written at PP2) loads with peft.PeftModel on the base it names, and the merged HF
    directory loads with transformers; both give PEFT's reference logits. Control: the base."""
    import json
    from pathlib import Path

    ref, res = layouts
    work = Path(res["work"])
    cfg = json.loads((work / "peft" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], Path(cfg["base_model_name_or_path"])) == (LORA["rank"], LORA["alpha"], (work / "hf").resolve())
    _check_exported_dirs(ref, work, cfg, fp32_tol(K, float(ref["logits"].abs().max()), ops=OPS))


def _check_exported_dirs(ref: dict, work, cfg: dict, tol: float) -> None:
    """The PEFT adapter directory work/peft (on the base its adapter_config ``cfg`` names) and the
    merged HF directory work/merged_hf each give PEFT's reference logits within ``tol``; the base
    alone (the control) is more than 100 x ``tol`` off."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids, cu = ref["input_ids"], ref["cu_seqlens"]

    def logits(m):
        m.config._attn_implementation = "eager"
        with torch.no_grad():
            return torch.cat([m(ids[cu[i]: cu[i + 1]].view(1, -1)).logits[0] for i in range(len(LENS))])

    base = AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"], dtype=torch.float32)
    off = (logits(base) - ref["logits"]).abs().max().item()
    peft_lg = logits(PeftModel.from_pretrained(base, work / "peft"))
    merged_lg = logits(AutoModelForCausalLM.from_pretrained(work / "merged_hf", dtype=torch.float32))
    for name, lg in (("peft dir", peft_lg), ("merged hf", merged_lg)):
        d = (lg - ref["logits"]).abs().max().item()
        print(f"lora export {name}: max|export - PEFT| {d:.3g} bound {tol:.3g} control {off:.3g}")
        assert d <= tol, f"{name}: {d} > {tol}"
    assert off > 100 * tol, f"the base alone is within {off} of the LoRA logits"


def test_lora_init_same_on_every_rank_and_layout():
    """apply_lora's A init (_init_a) is a function of (init_seed, HF name) only: the same whatever
    each rank's global RNG holds (DP replicas that started apart diverged after the first update:
    server vs learner log-probs 0.40-0.64 off at DP2, tests/test_lora_sync.py), and a row-parallel A
    split over TP2 is the TP1 draw sliced (fan-in = the full input, as PEFT). Exact: same draws."""
    from types import SimpleNamespace

    from areal_mega.megatron.lora import _init_a

    def draw(kind, cols, tp_rank=0, tp=1, seed=0, rng=0):
        torch.manual_seed(rng)  # a different global RNG state per call: must not matter
        ad = SimpleNamespace(kind=kind, A={"o_proj": torch.nn.Parameter(torch.empty(4, cols))})
        _init_a(ad, "model.layers.3.self_attn.o_proj", seed, tp_rank, tp)
        return ad.A["o_proj"].detach()

    full = draw("row", 16, rng=1)
    assert torch.equal(full, draw("row", 16, rng=2))
    assert torch.equal(torch.cat([draw("row", 8, 0, 2, rng=3), draw("row", 8, 1, 2, rng=4)], dim=1), full)
    assert torch.equal(draw("column", 16, rng=5), full)  # column A: replicated, the whole draw
    assert not torch.equal(draw("row", 16, seed=1), full)  # control: another init_seed, other adapters
    assert float(full.abs().max()) <= 16 ** -0.5  # kaiming-uniform(a=sqrt 5) bound at the full fan-in 16


def test_lora_refusals():
    from types import SimpleNamespace

    from areal_mega.megatron.lora import check_lora

    on = LoraConfig(**LORA)
    dense = SimpleNamespace(is_moe=False, mla=None)
    lay = SimpleNamespace(tp=1, cp=1)
    check_lora(on, dense, lay, "local")
    check_lora(LoraConfig(**MOE_LORA), SimpleNamespace(is_moe=True, mla=None), SimpleNamespace(tp=1, cp=1, etp=1), "local")
    check_lora(LoraConfig(), SimpleNamespace(is_moe=True, mla=None), lay, "te")  # off: nothing checked
    for args, kw, msg in [
        ((LoraConfig(**MOE_LORA), dense, lay, "local"), {}, "need a mixture-of-experts model"),
        ((LoraConfig(**MOE_LORA), SimpleNamespace(is_moe=True, mla=None), SimpleNamespace(tp=2, cp=1, etp=2), "local"),
         {}, "expert_tensor_parallel"),
        ((LoraConfig(**MOE_LORA), SimpleNamespace(is_moe=True, mla="mla"), lay, "local"), {}, "multi-latent attention"),
        ((on, SimpleNamespace(is_moe=True, mla=None), lay, "local"), {}, "no dense MLP layers"),
        ((on, dense, lay, "te"), {}, "layer_spec: local"),
        ((on, dense, SimpleNamespace(tp=1, cp=2), "local"), {}, "context_parallel"),
        ((LoraConfig(rank=4, dropout=0.1), dense, SimpleNamespace(tp=2, cp=1), "local"), {}, "lora.dropout"),
        ((on, dense, lay, "local"), {"critic": True}, "critic.lora"),
    ]:
        with pytest.raises(ValueError, match=msg):
            check_lora(*args, **kw)


def test_lora_memory_model_prices_adapters_only():
    from areal_mega.demo.models import tiny_config
    from areal_mega.megatron.lora import TARGETS as T
    from areal_mega.models import get_adapter
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from areal_mega.simulator.memory import LearnerSettings, lora_layer_params, stage_state

    arch = get_adapter(tiny_config("qwen2")).arch  # hidden 64, MLP 128, heads 4/2 of 16
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=2), 2)
    full = stage_state(arch, LearnerSettings(dtype="bfloat16"), lay, 0)
    lora = stage_state(arch, LearnerSettings(dtype="bfloat16", lora_rank=4, lora_targets=T), lay, 0)
    # per layer at TP2: q 4*64+4*64/2, k,v 4*64+4*32/2 each, o 4*64/2+4*64, gate,up 4*64+4*128/2 each, down 4*128/2+4*64
    per_layer = (256 + 128) + 2 * (256 + 64) + (128 + 256) + 2 * (256 + 256) + (256 + 256)
    assert lora_layer_params(arch, 4, T, 2) == per_layer
    a = 4 * per_layer
    assert lora.weights == full.weights + 2 * a  # bf16 adapters on a frozen bf16 base
    assert lora.grads == 4 * a and lora.optimizer == 12 * a  # fp32 grads; Adam m, v + fp32 master (dp 1)
    assert full.grads == 4 * full.params and lora.params == full.params + a  # full FT: grads for every param


@pytest.mark.slow
def test_lora_checkpoint_saved_tp2_loads_tp2_sp(layouts):
    _, res = layouts
    # engine.save at TP2 (base + sharded adapters + adapter-only optimizer), engine.load at TP2 + SP
    assert res["ckpt"] and all(res["ckpt"].values()), res["ckpt"]
    assert len(res["ckpt"]) == 4 * 7 * 2  # A and B of every projection of every layer


@pytest.mark.families_serve
def test_lora_adapter_sync_into_sglang(tmp_path):
    """Adapter-only sync into a real SGLang CPU server (--enable-lora; sglang_cpu_shim entry 5):
    after version 2 (replacing version 1's adapter) the server's log-probs with the adapter equal
    the TP2 learner's within the fp32 bound and its greedy continuations equal HF + PEFT's (merged);
    the same server without the adapter (the control) is far off on both."""
    import json
    import os

    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model, get_peft_model_state_dict

    from areal_mega.demo.models import tiny_model
    from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
    from areal_mega.inference.server import launch_servers
    from tests.dist.lora_adapter_sync import NEW
    from tests.dist.wsync_tp2pp2 import SEQS
    from tests.support.launch import run_dist_script
    from tests.test_families_serve import greedy_agreement, hf_greedy

    python = os.environ.get("AREAL_MEGA_SGLANG_PYTHON")
    if not python:
        pytest.skip("AREAL_MEGA_SGLANG_PYTHON not set (make test-families-serve sets it)")
    m = tiny_model("qwen2", vocab_size=512, noise=0.1, noise_seed=3)
    m.save_pretrained(tmp_path / "hf")
    torch.manual_seed(1)
    pm = get_peft_model(m, PeftConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                      target_modules=LORA["target_modules"], init_lora_weights=False))
    torch.save({"lora": LORA, "adapters": {k: v.detach().clone() for k, v in get_peft_model_state_dict(pm).items()}},
               tmp_path / "adapters.pt")
    pm.merge_and_unload().save_pretrained(tmp_path / "merged")  # HF + PEFT's reference for greedy
    icfg = InferenceConfig(num_servers=1, server=SGLangServerConfig(
        python=python, model_path=str(tmp_path / "hf"), device="cpu", dtype="float32", max_total_tokens=4096,
        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900, log_dir=str(tmp_path / "logs"),
        extra_args=["--enable-lora", "--max-lora-rank", str(LORA["rank"]), "--lora-target-modules", "all",
                    "--lora-backend", "torch_native", "--max-loras-per-batch", "1"]))
    servers = launch_servers(icfg)
    try:
        res = run_dist_script("lora_adapter_sync.py", 2, tmp_path, timeout_s=600,
                              args=("--hf-dir", tmp_path / "hf", "--adapters", tmp_path / "adapters.pt",
                                    "--servers", servers[0].url))
    finally:
        for s in servers:
            s.stop()
    # fp32 on both sides: the logits' bound (OPS: transformer + two adapter reductions per matmul),
    # doubled for log-softmax (|d lp| <= 2 max |d logit|)
    lp_tol = 2 * fp32_tol(K, res["learner"]["logit_scale"], ops=OPS)
    diff = lambda a, b: max(abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))  # noqa: E731
    d1 = diff(res["with_adapter"]["logprobs"], res["learner"]["logprobs"])
    d0 = diff(res["without_adapter"]["logprobs"], res["learner"]["logprobs"])
    hf = hf_greedy(tmp_path / "merged", SEQS, NEW)
    tol = fp32_tol(K, max(h[2] for h in hf), ops=OPS)
    equal, problems = greedy_agreement(res["greedy_with"], hf, tol)
    _, problems0 = greedy_agreement(res["greedy_without"], hf, tol)
    adapter_bytes = sum(t.numel() * 4 for t in torch.load(tmp_path / "adapters.pt")["adapters"].values())
    print(json.dumps({"logprob_diff": d1, "bound": lp_tol, "control": d0, "greedy_equal": equal,
                      "of": len(SEQS) * NEW, "sync": res["sync"], "adapter_bytes": adapter_bytes}))
    assert res["with_adapter"]["version"] == "2"
    assert [s["bytes"] for s in res["sync"]] == [adapter_bytes] * 2  # adapters only, every version
    assert d1 <= lp_tol, f"server with the adapter off the learner's log-probs by {d1} > {lp_tol}"
    assert not problems and equal >= len(SEQS) * NEW // 2, (equal, problems)
    assert d0 > 100 * lp_tol, f"the server without the adapter is within {d0} of the learner"
    assert problems0, "the server without the adapter decodes as HF + PEFT does"


@pytest.mark.families_serve
def test_bench_lora_sync_smoke(tmp_path):
    """tools/bench_lora_sync.py on a tiny model: the three ways sync, adapter-only moves the
    adapter bytes (rank x (in + out) per projection, bf16), merged and full the whole model."""
    import json
    import os

    from areal_mega.demo.models import tiny_model

    python = os.environ.get("AREAL_MEGA_SGLANG_PYTHON")
    if not python:
        pytest.skip("AREAL_MEGA_SGLANG_PYTHON not set (make test-families-serve sets it)")
    tiny_model("qwen2", vocab_size=512, noise=0.1, noise_seed=3).save_pretrained(tmp_path / "hf")
    p = run_checked(torchrun_cmd(1, "tools/bench_lora_sync.py", "--model", tmp_path / "hf", "--sglang-python", python,
                                 "--rank", "4", "--repeats", "1"), timeout_s=900, env=child_env(), merge_stderr=True)
    rows = {r["way"]: r for r in (json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith('{"way"'))}
    # tiny qwen2: 4 layers, hidden 64, q 64 / k,v 32 (GQA 4/2 of 16), MLP 128
    per_layer = sum(4 * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)])
    assert rows["adapter"]["bytes"] == 4 * per_layer * 2, rows
    assert rows["merged"]["bytes"] == rows["full"]["bytes"] > 10 * rows["adapter"]["bytes"], rows


# ---- MoE: per-expert adapters (PEFT target_parameters on the fused Qwen3-MoE experts) ----------
MOE_LORA = dict(rank=4, alpha=8.0, dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"])
# tests/test_megatron_moe.py's tiny Qwen3-MoE: 2 layers, hidden 64, 8 experts (top 2) of 32
MOE_MODEL = dict(family="qwen3_moe", vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, num_hidden_layers=2, max_position_embeddings=256, noise=0.1, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, tie_word_embeddings=False,
                 norm_topk_prob=True, noise_seed=2)
MOE_OPS = transformer_reductions(2) + 2 * 4 * 2  # + two adapter reductions per adapted matmul


@pytest.fixture(scope="module")
def moe_layouts(tmp_path_factory):
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model, get_peft_model_state_dict

    from tests.support.models import tiny_model

    work = tmp_path_factory.mktemp("lora_moe")
    m = tiny_model(**MOE_MODEL)
    m.config._attn_implementation = "eager"
    m.save_pretrained(work / "hf")
    torch.manual_seed(1)
    pm = get_peft_model(m, PeftConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=MOE_LORA["target_modules"][:4],
                                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                      init_lora_weights=False))
    adapters = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pm).items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (sum(LENS),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)))
    R = torch.randn(sum(LENS), 300, generator=g)
    logits = torch.cat([pm(ids[cu[i]: cu[i + 1]].view(1, -1)).logits[0] for i in range(len(LENS))])
    (logits * R).sum().backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in pm.named_parameters() if "lora_" in n}
    merged = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}
    torch.save(dict(input_ids=ids, cu_seqlens=cu, R=R, lora=MOE_LORA, adapters=adapters), work / "ref.pt")
    res = run_layouts_script("tests/dist/lora_moe_layouts.py", work, timeout_s=400)
    res["work"] = str(work)
    return dict(logits=logits.detach(), grads=grads, merged=merged, adapters=adapters, input_ids=ids, cu_seqlens=cu), res


@pytest.mark.slow
def test_lora_moe_logits_grads_equal_peft(moe_layouts):
    ref, res = moe_layouts
    tol = fp32_tol(K, float(ref["logits"].abs().max()), ops=MOE_OPS)
    assert set(res["logits"]) == {"tp1", "ep2", "tp2ep2"}
    for key, lg in res["logits"].items():
        d = (lg - ref["logits"]).abs().max().item()
        off = (res["base"][key] - ref["logits"]).abs().max().item()
        no_exp = (res["no_experts"][key] - ref["logits"]).abs().max().item()
        print(f"lora moe logits {key}: max|LoRA-PEFT| {d:.3g} bound {tol:.3g} control {off:.3g} "
              f"(expert adapters only off: {no_exp:.3g})")
        assert no_exp > 100 * tol, f"{key}: the expert adapters barely matter ({no_exp})"
        assert d <= tol, f"{key}: max |LoRA megatron - PEFT| = {d} > {tol}"
        assert off > 100 * tol, f"{key}: adapters barely matter (|base - PEFT| = {off})"
        grads = res["grads"][key]
        assert set(grads) == set(ref["grads"]) and any(".experts." in n for n in grads), key
        for n, g in grads.items():
            r = ref["grads"][n]
            gtol = fp32_tol(K * sum(LENS), float(r.abs().max()), ops=2 * MOE_OPS)
            assert (g - r).abs().max().item() <= gtol and r.abs().max() > 0, (key, n)
        # every adapter gathered to rank 0 in PEFT's names and fused layout: the loaded ones, exactly
        assert set(res["peft"][key]) == set(ref["adapters"])
        assert all(torch.equal(res["peft"][key][k], v) for k, v in ref["adapters"].items()), key
    for other in ("ep2", "tp2ep2"):  # EP2 and TP2 + SP x EP2 vs TP1 (dp 2): the same adapter gradients
        for n in ref["grads"]:
            a, b = res["grads"]["tp1"][n], res["grads"][other][n]
            assert (a - b).abs().max().item() <= fp32_tol(K * sum(LENS), float(a.abs().max()), ops=2 * MOE_OPS), (other, n)


@pytest.mark.slow
def test_lora_moe_merged_export_equals_peft_merge(moe_layouts):
    ref, res = moe_layouts
    for key, merged in res["merged"].items():
        for n, t in merged.items():
            if ".experts." not in n:
                continue
            # HF 5 fused experts: PEFT's merged gate_up_proj [E, 2I, H] / down_proj [E, H, I]
            layer, rest = n.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            fused = ref["merged"][f"{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(e)]
            i = fused.shape[0] // 2
            r = {"gate_proj": fused[:i], "up_proj": fused[i:], "down_proj": fused}[proj]
            d = (t - r).abs().max().item()
            assert d <= fp32_tol(4, float(r.abs().max()), ops=2), f"{key} {n}: {d}"


@pytest.mark.slow
def test_lora_moe_engine_and_checkpoint_ep2_to_tp1(moe_layouts):
    ref, res = moe_layouts
    in_opt, trainable, experts = res["engine"]
    # EP2 rank 0: its 4 of 8 experts' adapters (2 layers x 4 x r 4 x (64 + 64 + 32 + 64)) are expert
    # params (allreduce False: DDP reduces them over expert-dp); the optimizer holds the adapters only
    assert experts == 2 * 4 * 4 * ((64 + 2 * 32) + (32 + 64)), res["engine"]
    assert in_opt == trainable > experts, res["engine"]
    assert res["ckpt"] and len(res["ckpt"]) == len(ref["adapters"]) and all(res["ckpt"].values()), res["ckpt"]


@pytest.mark.slow
def test_lora_moe_checkpoint_exports_peft_dir_and_merged_hf(moe_layouts):
    """The EP2 engine checkpoint exported by the conversion tool's path: the PEFT adapter directory
    (written at EP2; target_parameters for the experts) loads with peft.PeftModel on its base, the
    merged HF directory with transformers; both give PEFT's reference logits. Control: the base."""
    import json
    from pathlib import Path

    ref, res = moe_layouts
    work = Path(res["work"])
    cfg = json.loads((work / "peft" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], cfg
    _check_exported_dirs(ref, work, cfg, fp32_tol(K, float(ref["logits"].abs().max()), ops=MOE_OPS))
