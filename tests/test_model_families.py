"""The family registry (areal_mega/models/registry.py): exact keys; each family's SGLang facts on
its own adapter; a Llama-like family added from outside the package as one class (the steps of
docs/layout.md "Adding a model family"), and the one-line refusal of a family never registered."""

from __future__ import annotations

import pytest

from areal_mega.models import FAMILIES, ModelAdapter, adapter_class, get_adapter, register_family
from areal_mega.models.qwen3 import Qwen3MoeAdapter
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.weight_sync.reshard import plan_reshard
from areal_mega.weight_sync.sglang_layout import EngineLayout, check_supported, check_syncable, engine_params
from tests.support.models import tiny_config

# What each built-in family's adapter says about a reshard sync into SGLang: "synced" (a layout),
# "planned" (a layout, a runtime sync refused: sglang_not_synced), "none" (no layout: broadcast).
SGLANG = {"llama": "synced", "qwen2": "synced", "qwen3": "synced", "qwen3_moe": "synced",
          "deepseek_v3": "synced", "mixtral": "none", "qwen2_moe": "none", "glm4_moe": "none",
          "qwen3_5_text": "none", "qwen3_5": "none", "qwen3_5_moe_text": "none", "qwen3_5_moe": "none",
          "qwen3_next": "none"}
SGLANG["gpt_oss"] = "none"  # SGLang's gpt_oss layout not written (broadcast serves it; docs/engine.md "gpt-oss")
SGLANG.update({"deepseek_v32": "none", "glm_moe_dsa": "none"})  # DSA: SGLang cannot serve it on CPU (tests/test_dsa.py)
SGLANG["kimi_k25"] = "none"  # models/kimi_k25.py: DeepSeek-V3's layout renamed is not written; broadcast serves it
TINY_MOE = {  # tiny configs of the families tiny_config leaves dense (tests/test_moe_families_plan.py's)
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=48),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4, num_nextn_predict_layers=0),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                     first_k_dense_replace=1, attention_bias=True, partial_rotary_factor=0.5,
                     num_nextn_predict_layers=0),
}
TINY_MOE["deepseek_v32"] = TINY_MOE["glm_moe_dsa"] = {**TINY_MOE["deepseek_v3"], "index_topk": 4, "index_head_dim": 16,
                                                      "index_n_heads": 2}
LIKE = "tiny_llama_like"


def _qwen3_5_config(family: str) -> dict:
    """Qwen3.5's tiny configs (tests/test_qwen3_5.py), text or vision-language, dense or MoE, as HF
    writes them."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    from tests.test_qwen3_5 import CFG, MOE, VISION

    moe = {**{k: v for k, v in CFG.items() if k != "intermediate_size"}, **MOE}
    return {"qwen3_5_text": lambda: Qwen3_5TextConfig(**CFG),
            "qwen3_5": lambda: Qwen3_5Config(text_config=CFG, vision_config=VISION),
            "qwen3_5_moe_text": lambda: Qwen3_5MoeTextConfig(**moe),
            "qwen3_5_moe": lambda: Qwen3_5MoeConfig(text_config=moe, vision_config=VISION),
            "qwen3_next": lambda: Qwen3NextConfig(**CFG, **MOE)}[family]().to_dict()


def _gpt_oss_config() -> dict:
    from tests.test_gpt_oss import CFG

    return {**CFG, "model_type": "gpt_oss"}
def _kimi_k25_config() -> dict:
    from transformers import Kimi_K25Config

    from tests.test_kimi_k25 import TEXT, VISION

    return Kimi_K25Config(text_config=dict(TEXT), vision_config=VISION, projection_hidden_size=32).to_dict()


def _sglang_status(cls: type[ModelAdapter]) -> str:
    return "none" if cls.sglang_layout is None else ("planned" if cls.sglang_not_synced else "synced")


@pytest.mark.parametrize("family", sorted(SGLANG))
def test_each_built_in_family_owns_its_sglang_facts(family):
    """Every family's adapter answers for SGLang, and the reshard checks read that answer: a layout
    of TP2 ranks (or the one-line refusal naming the family), a sync (or the refusal saying why)."""
    assert set(FAMILIES) == set(SGLANG)  # the built-ins, nothing left registered by a test
    cls = adapter_class(family)
    assert cls.model_type == family and _sglang_status(cls) == SGLANG[family]
    adapter = get_adapter(_qwen3_5_config(family) if family.startswith(("qwen3_5", "qwen3_next")) else
                          _gpt_oss_config() if family == "gpt_oss" else
                          _kimi_k25_config() if family == "kimi_k25" else
                          tiny_config(family, **TINY_MOE.get(family, {})))
    if SGLANG[family] == "none":
        with pytest.raises(ValueError, match=f"no SGLang layout for model_type '{family}' .*use broadcast$"):
            check_supported(adapter)
        return
    params = [engine_params(adapter, EngineLayout(2), r) for r in range(2)]
    assert [p.name for p in params[0]] == [p.name for p in params[1]]  # every rank holds the same parameters
    # every HF tensor of the checkpoint lands somewhere on the server, and nothing else
    assert {b.hf_name for ps in params for p in ps for b in p.blocks} == set(adapter.hf_names())
    if SGLANG[family] == "planned":
        with pytest.raises(ValueError, match=f"planned but not run for model_type '{family}'"):
            check_syncable(adapter)
    else:
        check_syncable(adapter)


def test_family_keys_are_exact():
    for near in ("Llama", "llama3", "qwen", "qwen3-moe", "deepseek"):
        with pytest.raises(ValueError, match=f"model_type: '{near}' is not supported; known model types: "):
            get_adapter({**tiny_config("llama"), "model_type": near})


def test_an_moe_family_without_its_own_sglang_layout_is_refused():
    """The default (Llama's dense) layout would drop the experts: it refuses an MoE arch."""
    inherited = type("InheritedMoe", (Qwen3MoeAdapter,), {"sglang_layout": ModelAdapter.sglang_layout})
    adapter = inherited(tiny_config("qwen3_moe", **TINY_MOE["qwen3_moe"]))
    with pytest.raises(ValueError, match="'qwen3_moe': an MoE family needs its own sglang_layout"):
        engine_params(adapter, EngineLayout(1), 0)
    assert engine_params(get_adapter(tiny_config("qwen3_moe", **TINY_MOE["qwen3_moe"])), EngineLayout(1), 0)


# ---------------------------------------------------------------- a family added from outside
class TinyLlamaLikeAdapter(ModelAdapter):
    """The whole of a Llama-like family: Llama's HF <-> megatron mapping and SGLang layout are
    ModelAdapter's defaults (registered by the fixture below, as a user module would at import)."""

    model_type = LIKE
    architecture = "TinyLlamaLikeForCausalLM"


@pytest.fixture
def llama_like():
    register_family(TinyLlamaLikeAdapter)
    yield TinyLlamaLikeAdapter
    del FAMILIES[LIKE]


def test_a_llama_like_family_registered_from_a_test_module(llama_like):
    cfg = {**tiny_config("llama", vocab_size=300, tie_word_embeddings=False), "model_type": LIKE}
    adapter, llama = get_adapter(cfg), get_adapter(tiny_config("llama", vocab_size=300, tie_word_embeddings=False))
    assert type(adapter) is TinyLlamaLikeAdapter and adapter.arch.model_type == LIKE
    # the learner's plan: Llama's, tensor for tensor, at PP2
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 4)
    assert ([[(t.name, t.shape) for t in s.tensors] for s in adapter.plan(layout)]
            == [[(t.name, t.shape) for t in s.tensors] for s in llama.plan(layout)])
    # SGLang's layout: Llama's, box for box, and a reshard sync runs
    for tp in (1, 2, 4):
        for r in range(tp):
            assert engine_params(adapter, EngineLayout(tp), r) == engine_params(llama, EngineLayout(tp), r)
    check_syncable(adapter)
    plan = plan_reshard(adapter, layout, [EngineLayout(2)], bucket_bytes=40_000)
    assert plan.bytes_per_engine_rank() == plan_reshard(llama, layout, [EngineLayout(2)],
                                                        bucket_bytes=40_000).bytes_per_engine_rank()
    # the registry lists it with the families that have a layout
    mixtral = get_adapter(tiny_config("mixtral", **TINY_MOE["mixtral"]))
    with pytest.raises(ValueError, match=f"known: \\[.*'{LIKE}'.*\\]"):
        check_supported(mixtral)
    # one class per name: a second one is refused, the same one again is a no-op
    assert register_family(TinyLlamaLikeAdapter) is TinyLlamaLikeAdapter
    other = type("OtherAdapter", (ModelAdapter,), {"model_type": LIKE, "architecture": "OtherForCausalLM"})
    with pytest.raises(ValueError, match=f"model_type '{LIKE}' is already served by TinyLlamaLikeAdapter"):
        register_family(other)
    with pytest.raises(ValueError, match="OtherAdapter needs a model_type and an architecture"):
        register_family(type("OtherAdapter", (ModelAdapter,), {"architecture": "OtherForCausalLM"}))


def test_an_unregistered_family_is_refused_in_one_line():
    """Negative control: the same class, never registered, serves nothing."""
    assert LIKE not in FAMILIES
    with pytest.raises(ValueError) as e:
        get_adapter({**tiny_config("llama"), "model_type": LIKE})
    assert str(e.value).startswith(f"model_type: '{LIKE}' is not supported; known model types: ['deepseek_v3'")
    assert "\n" not in str(e.value)


def test_a_family_named_in_the_yaml_needs_no_registration():
    """actor.model.family = "package.module:Adapter" (through the one loader) serves a model whose
    model_type no registered family has; without it the same config is refused (the control)."""
    from areal_mega.config import ConfigError
    from areal_mega.experiment import load_experiment
    from areal_mega.megatron.model import MegatronModelConfig, model_adapter

    cfg = {**tiny_config("llama", vocab_size=300, tie_word_embeddings=False), "model_type": LIKE}
    adapter = model_adapter(cfg, MegatronModelConfig(family="tests.test_model_families:TinyLlamaLikeAdapter"))
    # (pytest imports this file under another module name: compare the class by name)
    assert type(adapter).__qualname__ == "TinyLlamaLikeAdapter" and adapter.arch.model_type == LIKE and LIKE not in FAMILIES
    with pytest.raises(ValueError, match=f"model_type: '{LIKE}' is not supported"):
        model_adapter(cfg, MegatronModelConfig())
    with pytest.raises(ConfigError, match="actor.model.family: model 'no_pkg:A': cannot import no_pkg"):
        load_experiment("configs/grpo_tiny.yaml", ["model_path=/m", "actor.model.family=no_pkg:A"])
