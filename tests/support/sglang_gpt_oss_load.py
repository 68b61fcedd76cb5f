"""Run with SGLang's Python (repository on PYTHONPATH): SGLANG_PY tests/support/sglang_gpt_oss_load.py --config C --ckpt D --jobs JOBS.json --out OUT.pt

SGLang 0.5.23's own GptOssForCausalLM, built in this process on CPU (a world of one, TP1, no server:
its CPU attention backend cannot take the sinks, docs/engine.md "gpt-oss"), loads (a) the HF
checkpoint directory D's tensors and (b) each weight-sync stream of JOBS.json ({"label": stream
file of [(hf name, tensor)]}) through its own ``load_weights``. Every parameter is NaN first, so
what a load does not write stays NaN. OUT.pt: {"checkpoint" | label: {parameter: tensor},
"torch_native_takes_sinks": whether TorchNativeAttnBackend.forward_extend / forward_decode accept
the ``sinks`` keyword GptOssAttention passes}."""

from __future__ import annotations

import argparse
import inspect
import json

import torch

from tests.support.sglang_qwen3_5_load import _world_of_one


def _takes_sinks(fn) -> bool:
    ps = inspect.signature(fn).parameters
    return "sinks" in ps or any(p.kind is p.VAR_KEYWORD for p in ps.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    _world_of_one()
    from safetensors.torch import load_file
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.models.gpt_oss import GptOssConfig, GptOssForCausalLM

    hf = json.loads(open(args.config).read())
    streams = {"checkpoint": None, **json.loads(open(args.jobs).read())}
    out: dict = {"torch_native_takes_sinks": [_takes_sinks(TorchNativeAttnBackend.forward_extend),
                                             _takes_sinks(TorchNativeAttnBackend.forward_decode)]}
    for label, stream in streams.items():
        model = GptOssForCausalLM(GptOssConfig(**{k: v for k, v in hf.items() if k != "model_type"}))
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        weights = list(load_file(f"{args.ckpt}/model.safetensors").items()) if stream is None else torch.load(stream)
        model.load_weights(iter(weights))
        out[label] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(out, args.out)


if __name__ == "__main__":
    main()
