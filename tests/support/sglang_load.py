"""Run with SGLang's Python: SGLANG_PY tests/support/sglang_load.py --jobs JOBS.json --out OUT.pt [--probe-sinks]

SGLang 0.5.23's own model classes of the families it cannot serve here (Qwen3.5, Kimi-K2.5,
DeepSeek-V3.2 / GLM-5, gpt-oss), built in this process on CPU (a world of one, TP1, no server:
docs/engine.md, each family's "Serving"), load a weight-sync stream through their own
``load_weights``. JOBS.json: a list of {"label", "config" (an HF config.json path), "stream" (a
torch file: the [(hf name, tensor)] list the learner's export sends; or a ``.safetensors``
checkpoint file)}. Every parameter is set to NaN first, so what the stream does not write stays
NaN. OUT.pt: {label: {SGLang parameter name: tensor after the load}}; with ``--probe-sinks`` also
"torch_native_takes_sinks": whether TorchNativeAttnBackend.forward_extend / forward_decode accept
the ``sinks`` keyword GptOssAttention passes (gpt-oss's serving blocker).

DSA: SGLang reads V3-style config attributes transformers' DeepseekV32Config / GlmMoeDsaConfig
lack (moe_layer_freq, topk_method, scoring_func: a released config.json carries them), so the
config is built as a DeepseekV3Config with them set; its CPU RoPE factory asserts a rope_scaling
(rotary_embedding/factory.py get_rope_cpu), so a plain-RoPE config gets YaRN at factor 1 (the
identity; RoPE holds no weights)."""

from __future__ import annotations

import argparse
import inspect
import json
import os

import torch


def _world_of_one() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29643"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()  # what sglang.test.test_utils.publish_build_topology does (that module needs `datasets`)
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def _dsa_model(hf: dict) -> torch.nn.Module:
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


def _takes_sinks(fn) -> bool:
    ps = inspect.signature(fn).parameters
    return "sinks" in ps or any(p.kind is p.VAR_KEYWORD for p in ps.values())


def _model(hf: dict) -> torch.nn.Module:
    """The class SGLang serves the config's architecture with (its EntryClass), from its config."""
    cfg = {k: v for k, v in hf.items() if k != "model_type"}
    if hf["model_type"] in ("deepseek_v32", "glm_moe_dsa"):
        return _dsa_model(hf)
    if hf["model_type"] == "gpt_oss":
        from sglang.srt.models.gpt_oss import GptOssConfig, GptOssForCausalLM

        return GptOssForCausalLM(GptOssConfig(**cfg))
    if hf["model_type"] == "kimi_k25":
        from sglang.srt.configs.kimi_k25 import KimiK25Config
        from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

        c = KimiK25Config(**cfg)
        c.encoder_only = c.language_only = False  # what SGLang's ModelConfig sets on a served config
        return KimiK25ForConditionalGeneration(c)
    from sglang.srt.configs.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

    if hf["model_type"] == "qwen3_5_text":
        from sglang.srt.models.qwen3_5_text import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))
    from sglang.srt.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--probe-sinks", action="store_true")
    args = ap.parse_args()
    _world_of_one()
    out: dict = {}
    if args.probe_sinks:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        out["torch_native_takes_sinks"] = [_takes_sinks(TorchNativeAttnBackend.forward_extend),
                                           _takes_sinks(TorchNativeAttnBackend.forward_decode)]
    for job in json.loads(open(args.jobs).read()):
        model = _model(json.loads(open(job["config"]).read()))
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        if job["stream"].endswith(".safetensors"):
            from safetensors.torch import load_file

            weights = list(load_file(job["stream"]).items())
        else:
            weights = torch.load(job["stream"])
        model.load_weights(iter(weights))
        out[job["label"]] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(out, args.out)


if __name__ == "__main__":
    main()
