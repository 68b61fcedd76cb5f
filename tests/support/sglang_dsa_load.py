"""Run with SGLang's Python: SGLANG_PY tests/support/sglang_dsa_load.py --jobs JOBS.json --out OUT.pt

SGLang 0.5.23's own DeepSeek-V3.2 / GLM-5 model classes (DeepseekV32ForCausalLM,
GlmMoeDsaForCausalLM), built in this process on CPU (a world of one, TP1, no server: SGLang cannot
serve DSA on CPU, docs/engine.md "DeepSeek sparse attention"), load a weight-sync stream through
their own ``load_weights``. JOBS.json: a list of {"label", "config" (an HF config.json path),
"stream" (a torch file: the [(hf name, tensor)] list the learner's export sends)}. Every parameter
is NaN first, so what the stream does not write stays NaN. OUT.pt: {label: {SGLang parameter
name: tensor after the load}}.

SGLang reads V3-style config attributes transformers' DeepseekV32Config / GlmMoeDsaConfig lack
(moe_layer_freq, topk_method, scoring_func: a released config.json carries them), so the config
is built as a DeepseekV3Config with them set; its CPU RoPE factory asserts a rope_scaling
(rotary_embedding/factory.py get_rope_cpu), so a plain-RoPE config gets YaRN at factor 1 (the
identity; RoPE holds no weights)."""

from __future__ import annotations

import argparse
import json

import torch

from tests.support.sglang_qwen3_5_load import _world_of_one


def _model(hf: dict) -> torch.nn.Module:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(**{k: v for k, v in hf.items()
                              if k not in ("model_type", "mlp_layer_types", "layer_types", "indexer_types")})
    cfg.moe_layer_freq, cfg.topk_method, cfg.scoring_func = 1, "noaux_tc", "sigmoid"
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type") != "yarn":
        rope = {"rope_type": "yarn", "rope_theta": rope.get("rope_theta", 10000.0), "factor": 1.0,
                "original_max_position_embeddings": hf["max_position_embeddings"], "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    cfg.rope_scaling = rope
    if hf["model_type"] == "deepseek_v32":
        from sglang.srt.models.deepseek_v2 import DeepseekV32ForCausalLM as cls
    else:
        from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM as cls
    return cls(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _world_of_one()
    out = {}
    for job in json.loads(open(args.jobs).read()):
        model = _model(json.loads(open(job["config"]).read()))
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        model.load_weights(iter(torch.load(job["stream"])))
        out[job["label"]] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(out, args.out)


if __name__ == "__main__":
    main()
