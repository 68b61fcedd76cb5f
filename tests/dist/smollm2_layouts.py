"""The megatron learner on a REAL pretrained model, SmolLM2-135M-Instruct (tools/make_smollm2.py:
Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, vocab 49152), in the
layouts its shape allows, against HF transformers (driven by tests/test_smollm2.py):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 3 \
        tests/dist/smollm2_layouts.py --work-dir D --out R.json --model M --layouts tp3,pp3,tp3_pad

Layouts (world size in brackets): tp1 (dp = world), pp2 [2], pp2_vpp3 [2: 6 virtual stages of 5
layers, interleaved], tp3 [3: 3 query heads + 1 KV head per rank], pp3 [3: 10 layers per stage,
the tied embedding split between the first and the last stage], tp3_pad [3: vocabulary padded
to a multiple of 125 * 3 = 375, 49152 -> 49500: 348 padded logit columns per the whole vocab
that must not leak into the log-softmax; the default multiple 128 * 3 = 384 divides 49152].

One real text (SmolLM2's chat template, a question and its answer, ~40 tokens) in fp32 through
``forward_logprobs``; rank 0 computes HF's next-token log-probs once and reports the max
difference per layout.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine
from areal_mega.megatron.model import MegatronModelConfig
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout

LAYOUTS = {  # name: (tp, pp, vpp, make_vocab_size_divisible_by)
    "tp1": (1, 1, None, 128), "pp2": (1, 2, None, 128), "pp2_vpp3": (1, 2, 3, 128),
    "tp3": (3, 1, None, 128), "pp3": (1, 3, None, 128), "tp3_pad": (3, 1, None, 125),
}
MESSAGES = [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "12 + 7 = 19."}]


def real_text(model_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return list(tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=False))


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    out = torch.zeros(len(ids))
    out[:-1] = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return out


def run_layout(name: str, model_dir: str, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    tp, pp, vpp, divisible = LAYOUTS[name]
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp,
                                                 virtual_pipeline_parallel=vpp), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1)
    cfg = MegatronEngineConfig(model=MegatronModelConfig(dtype="float32", make_vocab_size_divisible_by=divisible),
                               max_tokens_per_microbatch=4096)
    engine = MegatronTrainEngine.create(cfg, load_hf_config(model_dir), groups, model_dir, trainable=False)
    lp = engine.forward_logprobs(batch, temperature=1.0)
    info = {"layout": str(layout), "padded_vocab": int(engine.model.padded_vocab_size)}
    del engine
    destroy_model_parallel(groups)
    return lp, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layouts", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    ids = real_text(args.model)
    batch = {"input_ids": torch.tensor(ids), "cu_seqlens": torch.tensor([0, len(ids)]),
             "loss_mask": torch.ones(len(ids), dtype=torch.int64)}
    ref = hf_logprobs(args.model, ids) if dist.get_rank() == 0 else None
    out: dict = {"num_tokens": len(ids), "layouts": {}}
    for name in args.layouts.split(","):
        lp, info = run_layout(name, args.model, batch)
        if ref is not None:
            out["layouts"][name] = {**info, "max_abs_diff": float((lp[:-1] - ref[:-1]).abs().max()),
                                    "mean_logprob": float(ref[:-1].mean())}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
